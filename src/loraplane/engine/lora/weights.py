"""Read one verified PEFT LoRA folder into host tensors the pool can take, refusing what the engine cannot serve.

Input: ``adapter_config.json`` + ``adapter_model.safetensors`` (never pickle). Keys look like
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``; lora_A is [r, in], lora_B is [out, r].
The config's content is read by ``artifacts.peft.parse_adapter_config``, the same function ``adapter pack``
uses. Scaling is exactly PEFT's (peft.tuners.lora.LoraModel._create_and_replace): for the module key
``model.layers.{i}.self_attn.q_proj`` the first ``rank_pattern`` / ``alpha_pattern`` key that matches
``(.*\\.)?(key)$`` gives r and alpha, else the config's ``r`` and ``lora_alpha``; scale = alpha / r, or
alpha / sqrt(r) with ``use_rslora``. The scale is folded into B here, so the kernels apply 1.0.

Output (``AdapterWeights``): per PEFT module name (q_proj ... down_proj) the adapter targets, one stacked
pair ``a`` [L, r_m, in] and ``b`` [L, out, r_m * scale] where r_m is the module's largest rank over layers;
layers (or rank-rows) it does not have stay zero, so they add exactly nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from loraplane.artifacts.errors import BAD_MANIFEST, ArtifactError
from loraplane.artifacts.fsutil import file_identity, settled, unchanged
from loraplane.artifacts.peft_config import EMBEDDING_NAMES, AdapterConfig, parse_adapter_config
from loraplane.engine.api import AdapterError
from loraplane.engine.lora.layout import Layouts, header_key, layout_of
from loraplane.engine.lora.safetensors_io import Reader, SafetensorsFormatError, parse, read_file, read_header
from loraplane.engine.lora.stacking import (
    TARGET_MODULES,
    AdapterWeights,
    Alloc,
    new_buffer,
    stack_factors,
    stack_known,
)
from loraplane.engine.model.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(\w+)\.(\w+))\.lora_(A|B)\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the base projection."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}  # fmt: skip


def read_config(folder: Path) -> AdapterConfig:
    """adapter_config.json, checked for every value and feature the engine computes with (the message names it)."""
    path = Path(folder) / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError("BadAdapterFile", f"{CONFIG_FILE}: missing in {folder}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterError("BadAdapterFile", f"{CONFIG_FILE}: unreadable ({exc})") from None
    try:
        return parse_adapter_config(cfg)
    except ArtifactError as exc:
        reason = "BadAdapterFile" if exc.reason == BAD_MANIFEST else exc.reason
        raise AdapterError(reason, f"{exc.field}: {exc.message}") from None


def _refuse_key(key: str) -> AdapterError:
    if "lora_embedding" in key or any(f".{n}." in key for n in EMBEDDING_NAMES):
        return AdapterError("UnsupportedAdapter", f"{WEIGHTS_FILE}: tensor {key!r}: embedding / lm_head LoRA")
    if "lora_magnitude_vector" in key:
        return AdapterError("UnsupportedAdapter", f"{WEIGHTS_FILE}: tensor {key!r}: DoRA magnitude")
    if key.endswith(".bias"):
        return AdapterError("UnsupportedAdapter", f"{WEIGHTS_FILE}: tensor {key!r}: LoRA bias")
    if "modules_to_save" in key:
        return AdapterError("UnsupportedAdapter", f"{WEIGHTS_FILE}: tensor {key!r}: modules_to_save")
    return AdapterError("UnknownModule", f"{WEIGHTS_FILE}: tensor {key!r} is not a served LoRA A/B weight")


def load_adapter_weights(
    folder: Path, cfg: ModelConfig, *, max_rank: int, dtype: torch.dtype = torch.float32, pin: bool = False,
    read: Reader = read_file, sha256: str | None = None, alloc: Alloc | None = None,
    file_id: tuple | None = None,
) -> AdapterWeights:  # fmt: skip
    """Parse and validate one PEFT folder; raises AdapterError naming the field / file / tensor.

    One read of the weights file (``read``), views of its tensors, then per module one stack of A, one of B
    and one scale multiply: a few large ops that release the GIL, whatever the number of layers. The result
    lives in one buffer: ``alloc(nbytes)``'s (the host tier's page-locked arena), else a new one, page-locked
    when ``pin``. ``sha256``: the file must hash to it ("sha256:<hex>"), else ``ChecksumMismatch``; without
    it the hash of this read (which fixes the bytes) may still run when this returns: ``digest()``.
    ``file_id``: the file's identity when it last hashed to ``sha256``, recorded only once its content had
    settled (its own earlier read, or a verifier that vouches for it: ``api.VerifiedFile``); a file that has
    it before and after this read has not been written since (any write moves its mtime past the recorded
    one, and its ctime), so its hash is not computed again."""
    folder = Path(folder)
    config = read_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        pickled = [n for n in _PICKLE_FILES if (folder / n).exists()]
        why = f"only pickle weights ({', '.join(pickled)}) found; never loaded" if pickled else "missing"
        raise AdapterError("BadAdapterFile", f"{WEIGHTS_FILE}: {why}")
    timings, t0 = {}, time.perf_counter()
    try:
        before = file_identity(path)
        buf = read(path)
    except OSError as exc:
        raise AdapterError("BadAdapterFile", f"{WEIGHTS_FILE}: unreadable ({exc})") from None
    stable = settled(path, before)
    trusted = sha256 is not None and before == file_id and unchanged(path, before)
    timings["read"] = (t1 := time.perf_counter()) - t0
    shapes, alloc = module_shapes(cfg), alloc or new_buffer(pin)
    key = header_key(buf, repr(config), tuple(shapes.items()), cfg.num_layers, max_rank, dtype)
    layout = LAYOUTS.get(key, len(buf))
    tensors = _parse(buf) if layout is None else None  # views: a malformed file is named before it is hashed
    hashing = None if trusted else _HASHER.submit(_sha256, buf)  # beside the stacking: both release the GIL
    try:
        data = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        if layout is not None:
            out, bad = stack_known(layout, data, shapes, cfg.num_layers, alloc)
            factors = _factors(_parse(buf), config, cfg, max_rank) if bad else {}  # only to name the tensor
        else:
            factors = _factors(tensors, config, cfg, max_rank)
            out, bad = stack_factors(factors, shapes, cfg.num_layers, dtype, alloc)
            if not bad and (found := layout_of(factors, data, len(buf), cfg.num_layers, dtype)) is not None:
                LAYOUTS.put(key, found)
        _check_finite(bad, factors)
    finally:
        timings["stack"] = time.perf_counter() - t1
    out.timings, out.file_id = timings, before if stable or trusted else None
    if sha256 is None:  # nothing to check it against: the hash finishes off the load's path (``digest()``)
        out.hashing = hashing
        return out
    if hashing is None:  # the file verified last time, not written since
        out.sha256, timings["hash"] = sha256, 0.0
        return out
    digest, timings["hash"] = hashing.result()
    if digest != sha256:
        raise AdapterError(
            "ChecksumMismatch", f"{WEIGHTS_FILE}: hashes to {digest}, not the {sha256} it was loaded with"
        )
    out.sha256 = digest
    return out


_HASHER = ThreadPoolExecutor(4, thread_name_prefix="loraplane-adapter-hash")
LAYOUTS = Layouts()  # file layouts learned by full parses (layout.py)


def _parse(buf: memoryview) -> dict[str, torch.Tensor]:
    try:
        return parse(buf)
    except SafetensorsFormatError as exc:
        raise AdapterError(
            "BadAdapterFile", f"{WEIGHTS_FILE}: not a readable safetensors file ({exc})"
        ) from None


def _sha256(buf: memoryview) -> tuple[str, float]:
    start = time.perf_counter()
    return "sha256:" + hashlib.sha256(buf).hexdigest(), time.perf_counter() - start


def _factors(
    tensors: dict[str, torch.Tensor], config: AdapterConfig, cfg: ModelConfig, max_rank: int
) -> dict:
    """module -> {layer: (a [r, in], b [out, r], scale)}, every name, shape and rank checked."""
    shapes, num_layers = module_shapes(cfg), cfg.num_layers
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if not m or _PARENT.get(m[4]) != m[3]:
            raise _refuse_key(key)
        layer, module, ab = int(m[2]), m[4], m[5]
        if layer >= num_layers:
            raise AdapterError(
                "ShapeMismatch", f"{WEIGHTS_FILE}: tensor {key!r}: the base has {num_layers} layers"
            )
        pairs.setdefault((module, layer), {})[ab] = tensor
    if not pairs:
        raise AdapterError("BadAdapterFile", f"{WEIGHTS_FILE}: holds no LoRA tensors")
    factors: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    for (module, layer), ab in sorted(pairs.items()):
        prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(
                "BadAdapterFile", f"{WEIGHTS_FILE}: {prefix}: lora_A and lora_B must both exist"
            )
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise AdapterError(
                "ShapeMismatch",
                f"{WEIGHTS_FILE}: {prefix}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}; the base needs "
                f"[r, {fan_in}] / [{fan_out}, r]",
            )
        if r > max_rank:
            raise AdapterError(
                "RankTooHigh", f"{WEIGHTS_FILE}: {prefix}: rank {r} > the engine's max_lora_rank {max_rank}"
            )
        want_r, scale = config.scale_of(prefix.removeprefix("base_model.model."))
        if want_r != r:
            raise AdapterError(
                "ShapeMismatch",
                f"{WEIGHTS_FILE}: {prefix}: rank {r}, but {CONFIG_FILE} (r / rank_pattern) says {want_r}",
            )
        factors.setdefault(module, {})[layer] = (a, b, scale)
    return factors


def _check_finite(bad: list[str], factors: dict) -> None:
    """Name the first non-finite tensor of the modules the stacking flagged (the file's tensors are searched
    only on a failure)."""
    for module in bad:
        for layer, (a, b, _) in sorted(factors[module].items()):
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            for name, t in (("lora_A", a), ("lora_B", b)):
                if not torch.isfinite(t).all():
                    raise AdapterError(
                        "NonFiniteWeights", f"{WEIGHTS_FILE}: {prefix}.{name}.weight has NaN or Inf"
                    )
        raise AdapterError(
            "NonFiniteWeights",
            f"{WEIGHTS_FILE}: {module}: lora_B times its scale overflows the serving dtype",
        )


def header_ranks(folder: Path, cfg: ModelConfig, *, max_rank: int) -> dict[str, int]:
    """module -> largest rank over layers, from the config and the weights file's header alone (no data
    read): what registering an adapter on the disk tier needs. The full checks run when it loads."""
    folder = Path(folder)
    read_config(folder)
    path = folder / WEIGHTS_FILE
    try:
        header = read_header(path)
    except FileNotFoundError:
        raise AdapterError("BadAdapterFile", f"{WEIGHTS_FILE}: missing in {folder}") from None
    except (OSError, SafetensorsFormatError) as exc:
        raise AdapterError(
            "BadAdapterFile", f"{WEIGHTS_FILE}: not a readable safetensors file ({exc})"
        ) from None
    ranks: dict[str, int] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        m = _KEY.match(key)
        if not m or _PARENT.get(m[4]) != m[3]:
            raise _refuse_key(key)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if m[5] == "A" and isinstance(shape, list) and len(shape) == 2 and isinstance(shape[0], int):
            if shape[0] > max_rank:
                raise AdapterError(
                    "RankTooHigh",
                    f"{WEIGHTS_FILE}: {key}: rank {shape[0]} > the engine's max_lora_rank {max_rank}",
                )
            ranks[m[4]] = max(ranks.get(m[4], 0), shape[0])
    if not ranks:
        raise AdapterError("BadAdapterFile", f"{WEIGHTS_FILE}: holds no LoRA tensors")
    return {m: ranks[m] for m in TARGET_MODULES if m in ranks}


def safetensors_bytes(folder: Path) -> int:
    return (Path(folder) / WEIGHTS_FILE).stat().st_size
