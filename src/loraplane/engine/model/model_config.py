"""The decoder's shape, parsed from a Hugging Face ``config.json`` (torch-free).

Supported: Llama (rope scaling ``default``/``linear``/``llama3``, optional attention bias), Qwen2/2.5
(qkv bias) and Mistral (sliding window only when it covers ``max_model_len``). Everything else is refused
with the offending field named, so a wrong model never serves silently wrong tokens.
Both transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) layouts are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_DTYPES = ("bfloat16", "float16", "float32")
_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_MAX_MODEL_LEN = 8192


class ModelConfigError(ValueError):
    """config.json describes a model this engine does not run."""


def _refuse(field: str, value: object, why: str = "is not supported") -> ModelConfigError:
    return ModelConfigError(f"config.json: {field}={value!r} {why} (field {field})")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # linear | llama3
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise _refuse("rope_scaling.rope_type", self.rope_type)
        if not self.factor > 0:
            raise _refuse("rope_scaling.factor", self.factor, "must be > 0")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise _refuse(
                "rope_scaling.high_freq_factor", self.high_freq_factor, "must exceed low_freq_factor"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    torch_dtype: str  # the checkpoint's dtype; the engine may run in another
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise _refuse(name, value, "must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise _refuse("num_key_value_heads", self.num_kv_heads, "must divide num_attention_heads")
        if self.head_dim % 2 or self.head_dim > 256:
            raise _refuse("head_dim", self.head_dim, "must be even and <= 256")
        if self.torch_dtype not in _DTYPES:
            raise _refuse("torch_dtype", self.torch_dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def default_max_model_len(self) -> int:
        return min(self.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, max_model_len: int | None = None) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path}: no config.json in the model folder")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, max_model_len)

    @classmethod
    def from_dict(cls, raw: dict, max_model_len: int | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _refuse("model_type", model_type)
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise _refuse("hidden_act", hidden_act)
        if raw.get("mlp_bias"):
            raise _refuse("mlp_bias", raw["mlp_bias"])
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise _refuse("pretraining_tp", raw["pretraining_tp"])
        num_heads = raw.get("num_attention_heads")
        hidden = raw.get("hidden_size")
        head_dim = raw.get("head_dim") or (
            hidden // num_heads if isinstance(hidden, int) and num_heads else 0
        )
        max_pos = int(raw.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
        limit = max_model_len or min(max_pos, DEFAULT_MAX_MODEL_LEN)
        _check_sliding_window(raw, model_type, limit)
        rope_theta, scaling = _parse_rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=raw.get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=raw.get("intermediate_size"),
            num_layers=raw.get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            torch_dtype=_parse_dtype(raw),
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


def _parse_dtype(raw: dict) -> str:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype not in _DTYPES:
        raise _refuse("torch_dtype", dtype)
    return dtype


def _check_sliding_window(raw: dict, model_type: str, max_model_len: int) -> None:
    window = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        return  # Qwen2 configs carry a window they do not use
    if window is not None and window < max_model_len:
        raise _refuse(
            "sliding_window",
            window,
            f"is smaller than max_model_len={max_model_len}: sliding-window attention is not supported",
        )


def _parse_rope(raw: dict) -> tuple[float, RopeScaling | None]:
    """transformers 5.x: ``rope_parameters`` holds theta and scaling; 4.x: ``rope_theta`` + ``rope_scaling``."""
    params = raw.get("rope_parameters")
    if (
        isinstance(params, dict)
        and "rope_parameters" not in params
        and any(isinstance(v, dict) for v in params.values())
    ):
        raise _refuse("rope_parameters", "per-layer-type", "is not supported")
    scaling = dict(params) if isinstance(params, dict) else dict(raw.get("rope_scaling") or {})
    theta = (params or {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise _refuse("rope_scaling.rope_type", rope_type)
    if rope_type == "default":
        return float(theta), None
    kwargs = {"factor": float(scaling.get("factor", 1.0))}
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in scaling:
                raise _refuse(f"rope_scaling.{key}", None, "is required for llama3 scaling")
            kwargs[key] = float(scaling[key])
        kwargs["original_max_position_embeddings"] = int(
            scaling.get("original_max_position_embeddings", 8192)
        )
    return float(theta), RopeScaling(rope_type=rope_type, **kwargs)
