"""``adapter_config.json``: the one reading of its content, for ``adapter pack``, the engine's loader
(``serve --adapter`` and the admin API) and the host cache alike, so a config one of them accepts is one every
one of them computes with in the same way.

Two rules. Every number the math uses must be a number of its kind (``"r": null`` is refused by name, not
met later as a TypeError); a missing ``r`` or ``lora_alpha`` is PEFT's default. And a key is accepted only
when it is known not to change what the adapter computes at inference (the tables below, written against
PEFT 0.21's LoraConfig): a key that changes it unless it holds its neutral value (``use_dora: false``,
``alora_invocation_tokens: null``) is accepted only at that value, and any other key is refused by name,
never ignored: a PEFT option this table does not know may change the math.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import CONFIG_FILE, KNOWN_MODULES

DEFAULT_R = 8  # PEFT LoraConfig's defaults for a config that leaves them out
DEFAULT_ALPHA = 8
EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "word_embeddings")

# Keys parse_adapter_config reads and checks itself.
READ_KEYS = frozenset(
    {"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules"}
)
# Keys that never change what a trained adapter computes: metadata, training-only settings (dropout is the
# identity at inference; EVA only initialises A), runtime options, options that only matter beside a key
# refused below (megatron_core without megatron_config, qalora_group_size without use_qalora), and a narrowing
# of target_modules (exclude_modules) that the weights file states anyway.
HARMLESS_KEYS = frozenset({
    "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "lora_dropout", "eva_config", "runtime_config", "megatron_core", "qalora_group_size", "exclude_modules",
    "merge_weights",  # PEFT < 0.3: merge at eval time, the same math
})  # fmt: skip
_SERVED_INITS = (True, False, "gaussian", "eva", "orthogonal")  # initialisations that leave the base alone
# Keys that change the math unless they hold a neutral value: key -> (neutral values, what they would change).
NEUTRAL_KEYS: dict[str, tuple[tuple, str]] = {
    "use_dora": ((False,), "DoRA adapters are not served"),
    "fan_in_fan_out": ((False,), "transposed (Conv1D) weights are not served"),
    "bias": (("none",), "trained biases are not served"),
    "modules_to_save": ((None, []), "full-weight modules are not served"),
    "lora_bias": ((False,), "LoRA biases are not served"),
    "init_lora_weights": (_SERVED_INITS, "PiSSA, OLoRA, CorDA and LoftQ change the base weights and MiCA the "
                          "forward; save the adapter converted to plain LoRA (path_initial_model_for_weight_conversion)"),
    "layers_to_transform": ((None, []), "LoRA on some layers only is not served"),
    "layers_pattern": ((None, [], ""), "LoRA on some layers only is not served"),
    "alora_invocation_tokens": ((None,), "activated LoRA (after invocation tokens only) is not served"),
    "use_qalora": ((False,), "QA-LoRA (pooled inputs) is not served"),
    "trainable_token_indices": ((None,), "trained embedding rows are not served"),
    "layer_replication": ((None,), "replicated layers change the base"),
    "loftq_config": ((None, {}), "LoftQ changes the base weights"),
    "corda_config": ((None,), "CorDA changes the base weights"),
    "lora_ga_config": ((None,), "LoRA-GA initialisation is not served"),
    "megatron_config": ((None,), "Megatron-parallel layers are not served"),
    "velora_config": ((None,), "VeLoRA is not served"),
    "monteclora_config": ((None,), "MonteCLoRA is not served"),
    "target_parameters": ((None, []), "LoRA on parameters (expert weights) is not served"),
    "use_bdlora": ((None, False), "block-diagonal LoRA is not served"),
    "arrow_config": ((None,), "Arrow routing is not served"),
    "kasa_config": ((None,), "KaSA is not served"),
    "ensure_weight_tying": ((False,), "tied trained embeddings are not served"),
    "enable_lora": ((None,), "fused (MergedLinear) LoRA is not served"),  # PEFT < 0.3
}  # fmt: skip


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


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's ``LoraLayer.update_layer``: alpha / sqrt(r) with rsLoRA, else alpha / r."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _pattern_value(patterns: dict, key: str, default):
    r"""PEFT's ``get_pattern_key``: the first pattern ``p`` (in file order) with ``(.*\.)?(p)$`` matching ``key``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


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
    _check_keys(cfg)
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


def _check_keys(cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _unserved("peft_type", f"{cfg.get('peft_type')!r} is not LORA")
    for key, value in cfg.items():
        if key in READ_KEYS or key in HARMLESS_KEYS:
            continue
        if key not in NEUTRAL_KEYS:
            raise _unserved(key, "not a PEFT LoraConfig key known to leave the math unchanged; refused, "
                                 "not ignored")  # fmt: skip
        neutral, why = NEUTRAL_KEYS[key]
        if not any(type(value) is type(n) and value == n for n in neutral):  # 0 is not false here
            shown = " or ".join(json.dumps(n) for n in neutral)
            raise _unserved(key, f"{json.dumps(value)[:80]}: {why} (served: {shown})")


def _unserved(key: str, why: str) -> E.ArtifactError:
    return E.ArtifactError(E.UNSUPPORTED_ADAPTER, why, _field(key))


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
        if name != "all-linear" and name not in KNOWN_MODULES:
            raise E.ArtifactError(
                E.UNKNOWN_MODULE, f"{name!r} is none of {list(KNOWN_MODULES)}", _field("target_modules")
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
