"""Torch-free checks of a PEFT LoRA folder against the base model's ``config.json``.

Only the safetensors header is read here (shapes, dtypes, a layout that fits the file); the tensor bytes
are checked by tensors.py in the pass that hashes them. PEFT key layout:
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`` with lora_A [r, in]
and lora_B [out, r].
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from loraplane.server.artifacts import errors as E
from loraplane.server.artifacts.manifest import CONFIG_FILE, KNOWN_MODULES, WEIGHTS_FILE
from loraplane.server.artifacts.tensors import read_layout

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z_]+)\.lora_(A|B)\.weight$"
)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
DEFAULT_MAX_RANK = 64


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    ranks: dict[str, int]  # module -> largest rank over layers
    dtype: str  # float32 | float16 | bfloat16
    layers: tuple[int, ...]  # layer indices that carry at least one LoRA pair


def read_adapter_config(path: Path) -> AdapterConfig:
    field_ = CONFIG_FILE
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise E.ArtifactError(E.BAD_MANIFEST, f"unreadable ({exc})", field_) from None
    except RecursionError:
        raise E.ArtifactError(E.BAD_MANIFEST, "JSON nested too deeply", field_) from None
    if not isinstance(cfg, dict):
        raise E.ArtifactError(E.BAD_MANIFEST, "not a JSON object", field_)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise E.ArtifactError(
            E.BAD_MANIFEST, f"peft_type {cfg.get('peft_type')!r} is not LORA", f"{field_}.peft_type"
        )
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise E.ArtifactError(E.BAD_MANIFEST, f"{flag}=true is not served", f"{field_}.{flag}")
    if cfg.get("bias", "none") != "none":
        raise E.ArtifactError(E.BAD_MANIFEST, "only bias='none' is served", f"{field_}.bias")
    if cfg.get("modules_to_save"):
        raise E.ArtifactError(
            E.BAD_MANIFEST, "modules_to_save (full weights) is not served", f"{field_}.modules_to_save"
        )
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise E.ArtifactError(E.BAD_MANIFEST, f"r={rank!r} is not a positive integer", f"{field_}.r")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise E.ArtifactError(E.BAD_MANIFEST, f"lora_alpha={alpha!r} is not positive", f"{field_}.lora_alpha")
    if cfg.get("alpha_pattern"):
        raise E.ArtifactError(E.BAD_MANIFEST, "alpha_pattern is not served", f"{field_}.alpha_pattern")
    return AdapterConfig(rank=rank, alpha=float(alpha), use_rslora=bool(cfg.get("use_rslora", False)))


def inspect_weights(path: Path, *, allowed_modules=KNOWN_MODULES) -> AdapterWeights:
    """Ranks, dtype and layers from the safetensors header; refuses unknown keys and inconsistent pairs."""
    field_ = WEIGHTS_FILE
    try:
        spans = read_layout(Path(path), field_)
    except OSError as exc:
        raise E.ArtifactError(E.BAD_MANIFEST, str(exc), field_) from None
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    dtypes = set()
    for span in spans:
        key = span.name
        m = _KEY.match(key)
        if not m:
            raise E.ArtifactError(
                E.UNKNOWN_MODULE, f"tensor {key!r} is not a LoRA A/B weight of a layer", field_
            )
        layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in allowed_modules or _PARENT.get(module) != parent:
            raise E.ArtifactError(
                E.UNKNOWN_MODULE, f"tensor {key!r}: module {parent}.{module} is not served", field_
            )
        shape = list(span.shape)
        if len(shape) != 2 or not all(d > 0 for d in shape):
            raise E.ArtifactError(
                E.SHAPE_MISMATCH, f"tensor {key!r} has shape {shape!r}, expected 2-D", field_
            )
        dtypes.add(span.dtype)
        pairs.setdefault((layer, module), {})[ab] = shape
    if not pairs:
        raise E.ArtifactError(E.BAD_MANIFEST, "no LoRA tensors", field_)
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        raise E.ArtifactError(
            E.BAD_MANIFEST, f"dtypes {sorted(map(str, dtypes))}: need one of F32/F16/BF16", field_
        )
    ranks: dict[str, int] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise E.ArtifactError(
                E.MISSING_FILE, f"layer {layer} {module}: lora_A and lora_B must both exist", field_
            )
        if ab["A"][0] != ab["B"][1]:
            raise E.ArtifactError(
                E.SHAPE_MISMATCH,
                f"layer {layer} {module}: lora_A {ab['A']} and lora_B {ab['B']} ranks differ",
                field_,
            )
        ranks[module] = max(ranks.get(module, 0), ab["A"][0])
    return AdapterWeights(
        ranks=dict(sorted(ranks.items())),
        dtype=_DTYPES[next(iter(dtypes))],
        layers=tuple(sorted({layer for layer, _ in pairs})),
    )


def expected_shapes(base_config: dict) -> tuple[int, dict[str, tuple[int, int]]]:
    """(num layers, module -> (in_features, out_features)) for a llama-style base ``config.json``."""

    def get(key: str) -> int:
        value = base_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise E.ArtifactError(
                E.BAD_MANIFEST, f"{key}={value!r} is not a positive integer", f"config.json.{key}"
            )
        return value

    hidden, inter, heads = get("hidden_size"), get("intermediate_size"), get("num_attention_heads")
    kv_heads = base_config.get("num_key_value_heads") or heads
    head_dim = base_config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return get("num_hidden_layers"), {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_against_base(weights_path: Path, base_config: dict) -> None:
    """Every lora_A is [r, in] and lora_B is [out, r] for the base's projection; layers exist."""
    n_layers, shapes = expected_shapes(base_config)
    for span in read_layout(Path(weights_path), WEIGHTS_FILE):
        key, info = span.name, {"shape": list(span.shape)}
        m = _KEY.match(key)
        layer, module, ab = int(m[1]), m[3], m[4]
        if layer >= n_layers:
            raise E.ArtifactError(E.SHAPE_MISMATCH, f"{key!r}: the base has {n_layers} layers", WEIGHTS_FILE)
        fan_in, fan_out = shapes[module]
        got = info["shape"]
        ok = got[1] == fan_in if ab == "A" else got[0] == fan_out
        if not ok:
            want = f"[r, {fan_in}]" if ab == "A" else f"[{fan_out}, r]"
            raise E.ArtifactError(
                E.SHAPE_MISMATCH, f"{key!r} has shape {got}, the base needs {want}", WEIGHTS_FILE
            )


def check_rank(ranks: dict[str, int], max_rank: int | None, field_: str = "manifest.ranks") -> None:
    if max_rank is None:
        return
    for module, rank in ranks.items():
        if rank > max_rank:
            raise E.ArtifactError(
                E.RANK_TOO_HIGH, f"{module} has rank {rank} > limit {max_rank}", f"{field_}.{module}"
            )
