"""Torch-free checks of a PEFT LoRA folder against the base model's ``config.json``.

``parse_adapter_config`` is the one reading of ``adapter_config.json``'s content: ``adapter pack``, the
engine's loader (``serve --adapter`` and the admin API) and these checks all go through it, so a value one
of them accepts is a value every one of them can compute with.

Only the safetensors header is read here (shapes, dtypes, a layout that fits the file); the tensor bytes
are checked by tensors.py in the pass that hashes them. PEFT key layout:
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`` with lora_A [r, in]
and lora_B [out, r].
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import CONFIG_FILE, KNOWN_MODULES, WEIGHTS_FILE
from loraplane.artifacts.tensors import read_layout

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z_]+)\.lora_(A|B)\.weight$"
)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
DEFAULT_MAX_RANK = 64
DEFAULT_R = 8  # PEFT LoraConfig's defaults for a config that leaves them out
DEFAULT_ALPHA = 8
EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "word_embeddings")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict = field(default_factory=dict)  # PEFT: regex key -> rank, first match wins
    alpha_pattern: dict = field(default_factory=dict)  # PEFT: regex key -> lora_alpha

    def rank_of(self, module_key: str) -> int:
        """The rank PEFT gives ``module_key`` (e.g. 'model.layers.0.self_attn.q_proj')."""
        return _pattern_value(self.rank_pattern, module_key, self.rank)

    def alpha_of(self, module_key: str) -> float:
        return float(_pattern_value(self.alpha_pattern, module_key, self.alpha))

    def scale_of(self, module_key: str) -> tuple[int, float]:
        """(rank, scale) PEFT uses for ``module_key``."""
        rank = self.rank_of(module_key)
        return rank, lora_scale(self.alpha_of(module_key), rank, self.use_rslora)


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


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's ``LoraLayer.update_layer``: alpha / sqrt(r) with rsLoRA, else alpha / r."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _pattern_value(patterns: dict, key: str, default):
    r"""PEFT's ``get_pattern_key``: the first pattern ``p`` (in file order) with ``(.*\.)?(p)$`` matching ``key``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


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


def read_adapter_config(path: Path) -> AdapterConfig:
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise E.ArtifactError(E.BAD_MANIFEST, f"unreadable ({exc})", CONFIG_FILE) from None
    except RecursionError:
        raise E.ArtifactError(E.BAD_MANIFEST, "JSON nested too deeply", CONFIG_FILE) from None
    return parse_adapter_config(cfg)


def parse_adapter_config(cfg: object) -> AdapterConfig:
    """adapter_config.json's content, every value the math uses checked (the error names the field)."""
    if not isinstance(cfg, dict):
        raise E.ArtifactError(E.BAD_MANIFEST, "not a JSON object", CONFIG_FILE)
    _refuse_unserved(cfg)
    _check_target_modules(cfg.get("target_modules"))
    use_rslora = cfg.get("use_rslora", False)
    if use_rslora is not None and not isinstance(use_rslora, bool):
        raise E.ArtifactError(E.BAD_MANIFEST, f"{use_rslora!r} is not true or false", _field("use_rslora"))
    return AdapterConfig(
        rank=_positive(cfg.get("r", DEFAULT_R), int, _field("r")),
        alpha=float(_positive(cfg.get("lora_alpha", DEFAULT_ALPHA), int | float, _field("lora_alpha"))),
        use_rslora=bool(use_rslora),
        rank_pattern=_patterns(cfg, "rank_pattern", int),
        alpha_pattern=_patterns(cfg, "alpha_pattern", int | float),
    )


def _field(key: str) -> str:
    return f"{CONFIG_FILE}.{key}"


def _refuse_unserved(cfg: dict) -> None:
    def unserved(key: str, why: str) -> E.ArtifactError:
        return E.ArtifactError(E.UNSUPPORTED_ADAPTER, why, _field(key))

    if cfg.get("peft_type", "LORA") != "LORA":
        raise unserved("peft_type", f"{cfg.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA adapters are not served"),
                     ("fan_in_fan_out", "transposed (Conv1D) weights are not served"),
                     ("modules_to_save", "full-weight modules are not served"),
                     ("lora_bias", "LoRA biases are not served")):  # fmt: skip
        if cfg.get(key):
            raise unserved(key, why)
    if cfg.get("bias", "none") != "none":
        raise unserved("bias", f"{cfg.get('bias')!r}: only 'none' is served")


def _check_target_modules(targets: object) -> None:
    """Names the weights file must agree with; a regex or all-linear leaves that to the weights file."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise E.ArtifactError(
            E.BAD_MANIFEST, "must be a list of module names or a regex", _field("target_modules")
        )
    for name in targets:
        if name in EMBEDDING_NAMES:
            raise E.ArtifactError(
                E.UNSUPPORTED_ADAPTER,
                f"{name!r}: embedding / lm_head LoRA is not served",
                _field("target_modules"),
            )
        if name != "all-linear" and name not in _PARENT:
            raise E.ArtifactError(
                E.UNKNOWN_MODULE, f"{name!r} is none of {list(_PARENT)}", _field("target_modules")
            )


def _positive(value: object, kind, field_: str):
    """A finite number > 0 of ``kind`` (JSON's true is no number; null is no number either)."""
    number = isinstance(value, kind) and not isinstance(value, bool)
    if not number or (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
        what = "a positive integer" if kind is int else "a positive finite number"
        raise E.ArtifactError(E.BAD_MANIFEST, f"{value!r} is not {what}", field_)
    return value


def _patterns(cfg: dict, name: str, kind) -> dict:
    """PEFT's rank_pattern / alpha_pattern: regex -> number; each regex as PEFT will use it must compile."""
    value = cfg.get(name)
    value = {} if value is None else value
    if not isinstance(value, dict) or len(value) > 1024:
        raise E.ArtifactError(E.BAD_MANIFEST, "must be an object pattern -> value", _field(name))
    for pattern, item in value.items():
        field_ = f"{_field(name)}.{pattern}"
        if not 0 < len(pattern) <= 256:
            raise E.ArtifactError(E.BAD_MANIFEST, "a pattern is 1 to 256 characters", field_)
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as exc:
            raise E.ArtifactError(E.BAD_MANIFEST, f"not a regular expression ({exc})", field_) from None
        _positive(item, kind, field_)
    return value


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
