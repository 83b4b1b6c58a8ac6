"""Torch-free checks of a PEFT LoRA folder against the base model's ``config.json``.

The config itself is read by peft_config.py.

Only the safetensors header is read here (shapes, dtypes, a layout that fits the file); the tensor bytes
are checked by tensors.py in the pass that hashes them. PEFT key layout:
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`` with lora_A [r, in]
and lora_B [out, r].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import CONFIG_FILE, KNOWN_MODULES, WEIGHTS_FILE
from loraplane.artifacts.peft_config import AdapterConfig, lora_scale
from loraplane.artifacts.tensors import TensorSpan, read_layout

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z_]+)\.lora_(A|B)\.weight$"
)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
DEFAULT_MAX_RANK = 64


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    ranks: dict[str, int]  # module -> largest rank over layers
    dtype: str  # float32 | float16 | bfloat16
    layers: tuple[int, ...]  # layer indices that carry at least one LoRA pair
    pair_ranks: dict = field(default_factory=dict)  # (layer, module) -> rank


@dataclass(frozen=True, slots=True)
class ModuleScaling:
    """What PEFT's LoraLayer uses for each module: its rank, its lora_alpha, and scaling."""

    ranks: dict[str, int]
    alphas: dict[str, float]
    scales: dict[str, float]


def module_scaling(config: AdapterConfig, weights: AdapterWeights) -> ModuleScaling:
    """Per-module rank, alpha and scale as PEFT computes them for each layer; the config's ``r`` and
    ``rank_pattern`` must give the ranks the weights hold, and each module one value over its layers."""
    per_module: dict[str, set[tuple[int, float]]] = {}
    for (layer, module), rank in sorted(weights.pair_ranks.items()):
        key = f"model.layers.{layer}.{_PARENT[module]}.{module}"  # the name PEFT matches patterns against
        want = config.rank_of(key)
        if want != rank:
            where = "rank_pattern" if want != config.rank else "r"
            raise E.ArtifactError(
                E.RANK_MISMATCH,
                f"layer {layer} {module}: the config gives rank {want}, the weights hold rank {rank}",
                f"{CONFIG_FILE}.{where}",
            )
        per_module.setdefault(module, set()).add((rank, config.alpha_of(key)))
    ranks, alphas, scales = {}, {}, {}
    for module, values in sorted(per_module.items()):
        if len(values) != 1:
            raise E.ArtifactError(
                E.BAD_MANIFEST,
                f"{module}: layers differ in (rank, alpha) {sorted(values)}; one value per module is served",
                f"{CONFIG_FILE}.rank_pattern",
            )
        ((rank, alpha),) = values
        ranks[module], alphas[module] = rank, alpha
        scales[module] = lora_scale(alpha, rank, config.use_rslora)
    return ModuleScaling(ranks, alphas, scales)


def inspect_weights(path: Path, *, allowed_modules=KNOWN_MODULES) -> AdapterWeights:
    """Ranks, dtype and layers from the safetensors header; refuses unknown keys and inconsistent pairs."""
    try:
        spans = read_layout(Path(path), WEIGHTS_FILE)
    except OSError as exc:
        raise E.ArtifactError(E.BAD_MANIFEST, str(exc), WEIGHTS_FILE) from None
    return weights_of(spans, allowed_modules=allowed_modules)


def weights_of(spans: list[TensorSpan], *, allowed_modules=KNOWN_MODULES) -> AdapterWeights:
    """inspect_weights for a header already read (a download's TensorScanner has it)."""
    field_ = WEIGHTS_FILE
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
        pair_ranks={key: ab["A"][0] for key, ab in sorted(pairs.items())},
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
