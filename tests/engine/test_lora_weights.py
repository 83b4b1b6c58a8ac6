"""Reading PEFT folders: PEFT's scaling per module, and one refusal per reason, each naming its field/tensor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

from loraplane.artifacts.peft_config import parse_adapter_config  # noqa: E402
from loraplane.engine.api import AdapterError  # noqa: E402
from loraplane.engine.lora.weights import load_adapter_weights  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402

H, F, Q, KV, L = 64, 128, 64, 32, 2
SHAPES = {"q_proj": (H, Q), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (Q, H),
          "gate_proj": (H, F), "up_proj": (H, F), "down_proj": (F, H)}  # fmt: skip
PARENT = {m: "self_attn" if m[0] in "qkvo" else "mlp" for m in SHAPES}


@pytest.fixture(scope="module")
def cfg(tiny_llama_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(str(tiny_llama_dir))


def key(layer: int, module: str, ab: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}.lora_{ab}.weight"


def write(folder: Path, config: dict | None = None, tensors: dict | None = None, r: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
              "bias": "none", **(config or {})}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is None:
        tensors = {}
        for layer in range(L):
            for m in ("q_proj", "v_proj"):
                fan_in, fan_out = SHAPES[m]
                tensors[key(layer, m, "A")] = torch.randn(r, fan_in)
                tensors[key(layer, m, "B")] = torch.randn(fan_out, r)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_scale_folded_into_b_and_pattern_keys_match_like_peft(tmp_path, cfg):
    folder = write(
        tmp_path / "a", {"rank_pattern": {"layers.1.self_attn.v_proj": 2}, "alpha_pattern": {"v_proj": 3}}
    )
    with pytest.raises(
        AdapterError, match="rank_pattern"
    ) as err:  # the file's rank disagrees with the config
        load_adapter_weights(folder, cfg, max_rank=64)
    assert err.value.reason == "ShapeMismatch"

    def module_scale(config: dict, module_key: str) -> tuple[int, float]:
        return parse_adapter_config(config).scale_of(module_key)

    assert module_scale(
        {"r": 4, "lora_alpha": 8, "rank_pattern": {"v_proj": 2}}, "model.layers.1.self_attn.v_proj"
    ) == (2, 4.0)
    assert module_scale({"r": 4, "lora_alpha": 8, "use_rslora": True}, "model.layers.0.mlp.up_proj") == (
        4,
        4.0,
    )
    # "q_proj" must not match "model.layers.0.self_attn.xq_proj"; the first matching key wins
    assert (
        module_scale(
            {"r": 4, "lora_alpha": 8, "alpha_pattern": {"q_proj": 1}}, "model.layers.0.self_attn.xq_proj"
        )[1]
        == 2.0
    )
    tensors = {key(0, "q_proj", "A"): torch.ones(4, H), key(0, "q_proj", "B"): torch.ones(Q, 4)}
    folder = write(tmp_path / "b", {"lora_alpha": 12, "use_rslora": True}, tensors)
    w = load_adapter_weights(folder, cfg, max_rank=64)
    assert w.ranks == {"q_proj": 4} and w.a["q_proj"].shape == (L, 4, H)
    # The layers' one scale is the slot's (the kernels apply it); B stays as on file.
    assert w.scales == {"q_proj": 12 / math.sqrt(4)} and torch.equal(w.b["q_proj"][0], torch.ones(Q, 4))
    assert w.b["q_proj"][1].abs().sum() == 0  # layer 1 has no LoRA: zero delta
    # Layers with different scales (alpha_pattern by layer): each is folded into its B, no slot scale.
    tensors = {key(i, "q_proj", ab): torch.ones(4, H) if ab == "A" else torch.ones(Q, 4)
               for i in range(L) for ab in "AB"}  # fmt: skip
    config = {"lora_alpha": 8, "alpha_pattern": {"model.layers.0.self_attn.q_proj": 2}}
    w = load_adapter_weights(write(tmp_path / "c", config, tensors), cfg, max_rank=64)
    assert "q_proj" not in w.scales
    assert torch.equal(w.b["q_proj"][0], torch.full((Q, 4), 2 / 4))
    assert torch.equal(w.b["q_proj"][1], torch.full((Q, 4), 8 / 4))


REFUSALS = [
    ("UnsupportedAdapter", "use_dora", dict(config={"use_dora": True})),
    ("UnsupportedAdapter", "modules_to_save", dict(config={"modules_to_save": ["lm_head"]})),
    ("UnsupportedAdapter", "fan_in_fan_out", dict(config={"fan_in_fan_out": True})),
    ("UnsupportedAdapter", "bias", dict(config={"bias": "all"})),
    ("UnsupportedAdapter", "embed_tokens", dict(config={"target_modules": ["q_proj", "embed_tokens"]})),
    ("UnsupportedAdapter", "lm_head", dict(tensors={"base_model.model.lm_head.lora_A.weight": torch.ones(4, H)})),
    ("UnsupportedAdapter", "lora_magnitude_vector",
     dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(Q)})),
    ("UnknownModule", "target_modules", dict(config={"target_modules": ["q_proj", "fc1"]})),
    ("UnknownModule", "mlp.fc1", dict(tensors={"base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.ones(4, H)})),
    ("ShapeMismatch", "q_proj", dict(tensors={key(0, "q_proj", "A"): torch.ones(4, H + 1), key(0, "q_proj", "B"): torch.ones(Q, 4)})),
    ("ShapeMismatch", "layers", dict(tensors={key(7, "q_proj", "A"): torch.ones(4, H), key(7, "q_proj", "B"): torch.ones(Q, 4)})),
    ("RankTooHigh", "max_lora_rank", dict(r=128)),
    ("NonFiniteWeights", "lora_B", dict(tensors={key(0, "q_proj", "A"): torch.ones(4, H),
                                                 key(0, "q_proj", "B"): torch.full((Q, 4), float("nan"))})),
    ("BadAdapterFile", "lora_B", dict(tensors={key(0, "q_proj", "A"): torch.ones(4, H)})),
    ("UnsupportedAdapter", "peft_type", dict(config={"peft_type": "IA3"})),
    ("UnsupportedAdapter", "adapter_config.json.some_future_key", dict(config={"some_future_key": 1})),
    ("UnsupportedAdapter", "adapter_config.json.use_qalora", dict(config={"use_qalora": True})),
    ("UnsupportedAdapter", "adapter_config.json.alora_invocation_tokens", dict(config={"alora_invocation_tokens": [5]})),
    ("BadAdapterFile", "adapter_config.json.r", dict(config={"r": None})),
    ("BadAdapterFile", "adapter_config.json.r", dict(config={"r": "4"})),
    ("BadAdapterFile", "adapter_config.json.r", dict(config={"r": 4.0})),
    ("BadAdapterFile", "adapter_config.json.lora_alpha", dict(config={"lora_alpha": None})),
    ("BadAdapterFile", "adapter_config.json.lora_alpha", dict(config={"lora_alpha": [8]})),
    ("BadAdapterFile", "adapter_config.json.rank_pattern.v_proj", dict(config={"rank_pattern": {"v_proj": None}})),
    ("BadAdapterFile", "adapter_config.json.alpha_pattern.v_proj", dict(config={"alpha_pattern": {"v_proj": "2"}})),
    ("BadAdapterFile", "adapter_config.json.alpha_pattern.(", dict(config={"alpha_pattern": {"(": 2}})),
    ("BadAdapterFile", "adapter_config.json.use_rslora", dict(config={"use_rslora": "false"})),
    ("ShapeMismatch", "r / rank_pattern", dict(config={"r": 8})),
]  # fmt: skip


@pytest.mark.parametrize("reason, named, kw", REFUSALS, ids=[f"{r}-{n}" for r, n, _ in REFUSALS])
def test_refusals_name_the_field(tmp_path, cfg, reason, named, kw):
    folder = write(tmp_path / "a", **kw)
    with pytest.raises(AdapterError) as err:
        load_adapter_weights(folder, cfg, max_rank=64)
    assert err.value.reason == reason and named in str(err.value), str(err.value)


def test_a_config_without_r_has_peft_default_rank_8(tmp_path, cfg):
    config = {"peft_type": "LORA", "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    folder = write(tmp_path / "eight", r=8)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert load_adapter_weights(folder, cfg, max_rank=64).ranks == {"q_proj": 8, "v_proj": 8}
    folder = write(tmp_path / "four", r=4)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="says 8") as err:  # the weights hold rank 4: checked, not assumed
        load_adapter_weights(folder, cfg, max_rank=64)
    assert err.value.reason == "ShapeMismatch"


def test_pickle_and_corrupt_files_are_refused(tmp_path, cfg):
    folder = write(tmp_path / "a")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle") as err:
        load_adapter_weights(folder, cfg, max_rank=64)
    assert err.value.reason == "BadAdapterFile"
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(AdapterError, match="adapter_model.safetensors") as err:
        load_adapter_weights(folder, cfg, max_rank=64)
    assert err.value.reason == "BadAdapterFile"
    (folder / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match="adapter_config.json") as err:
        load_adapter_weights(folder, cfg, max_rank=64)
    assert err.value.reason == "BadAdapterFile"


@pytest.mark.parametrize(
    "config, b_value",
    [({"lora_alpha": 4e40}, 1.0), ({"lora_alpha": 8}, 3e38)],
    ids=["scale beyond float32", "scale times B beyond the dtype"],
)
def test_a_slot_scale_that_would_overflow_is_refused_by_name(tmp_path, cfg, config, b_value):
    """The scale is applied per slot in fp32 rather than folded into B on the host; a scale or a scaled B that
    the serving dtype cannot hold is refused at load, as the fold's overflow to Inf was."""
    tensors = {key(0, "q_proj", "A"): torch.ones(4, H), key(0, "q_proj", "B"): torch.full((Q, 4), b_value)}
    folder = write(tmp_path / "big", config, tensors)
    with pytest.raises(AdapterError, match="q_proj: lora_B times its scale overflows") as err:
        load_adapter_weights(folder, cfg, max_rank=64, dtype=torch.bfloat16)
    assert err.value.reason == "NonFiniteWeights"
