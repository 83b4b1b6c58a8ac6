"""A file whose header was fully parsed before loads through its learned layout (one gather per factor):
the same tensors, bit for bit, as a full parse, with layers in layer order although the file sorts names
as text (layer 10 before layer 2); a NaN in such a file is still named; files without one fixed layout
(ranks that differ by layer, another dtype) always take the full parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from loraplane.engine.api import AdapterError  # noqa: E402
from loraplane.engine.lora.weights import LAYOUTS, load_adapter_weights  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402

L = 12  # past 10 layers, text order and layer order differ
RAW = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}  # fmt: skip
MODULES = {"q_proj": ("self_attn", 64, 64), "v_proj": ("self_attn", 64, 32), "down_proj": ("mlp", 128, 64)}


@pytest.fixture(autouse=True)
def no_layouts():
    LAYOUTS.clear()
    yield
    LAYOUTS.clear()


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(RAW, max_model_len=256)


def write(folder: Path, seed: int, dtype=torch.bfloat16, ranks=None, nan_at: int | None = None) -> Path:
    """r 4 on q/v/down (``ranks``: layer -> rank instead), lora_alpha 8; ``nan_at``: that layer's v B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(L):
        r = (ranks or {}).get(layer, 4)
        for m, (parent, fan_in, fan_out) in MODULES.items():
            p = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen).to(dtype)
            tensors[f"{p}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen).to(dtype)
    if nan_at is not None:
        tensors[f"base_model.model.model.layers.{nan_at}.self_attn.v_proj.lora_B.weight"][1, 0] = float("nan")
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(MODULES), "bias": "none"}
    if ranks:
        config["rank_pattern"] = {f"layers.{layer}.*": r for layer, r in ranks.items()}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def load(folder: Path, cfg, dtype=torch.bfloat16):
    return load_adapter_weights(folder, cfg, max_rank=16, dtype=dtype)


def same(x, y) -> bool:
    return x.ranks == y.ranks and all(
        torch.equal(x.a[m], y.a[m]) and torch.equal(x.b[m], y.b[m]) and x.scales.get(m) == y.scales.get(m)
        for m in x.ranks
    )


def test_a_learned_layout_loads_the_same_tensors_as_a_full_parse(tmp_path, cfg):
    first, second = write(tmp_path / "a", 0), write(tmp_path / "b", 1)
    full = load(second, cfg)  # full parse (learns the layout)
    assert len(LAYOUTS) == 1
    fast = load(second, cfg)
    load(first, cfg)
    assert len(LAYOUTS) == 1 and same(fast, full) and fast.digest() == full.digest() is not None
    raw = load_file(str(second / "adapter_model.safetensors"))  # layer order, spot-checked
    a10 = raw["base_model.model.model.layers.10.mlp.down_proj.lora_A.weight"]
    b2 = raw["base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(fast.a["down_proj"][10], a10)
    # B as on file, its layers' one scale (8 / 4) left for the slot to apply
    assert torch.equal(fast.b["q_proj"][2], b2) and fast.scales["q_proj"] == full.scales["q_proj"] == 2.0


def test_a_nan_in_a_file_of_a_known_layout_is_named(tmp_path, cfg):
    load(write(tmp_path / "good", 0), cfg)
    assert len(LAYOUTS) == 1
    with pytest.raises(AdapterError, match=r"layers\.7\.self_attn\.v_proj\.lora_B") as err:
        load(write(tmp_path / "bad", 1, nan_at=7), cfg)
    assert err.value.reason == "NonFiniteWeights"


@pytest.mark.parametrize("case", ["ranks by layer", "another dtype"])
def test_files_without_one_fixed_layout_take_the_full_parse(tmp_path, cfg, case):
    if case == "ranks by layer":
        folders = [write(tmp_path / n, i, ranks={3: 8}) for i, n in enumerate("ab")]
        dtype = torch.bfloat16
    else:
        folders = [write(tmp_path / n, i, dtype=torch.float32) for i, n in enumerate("ab")]
        dtype = torch.bfloat16
    results = [load(f, cfg, dtype) for f in folders]
    assert len(LAYOUTS) == 0
    if case == "ranks by layer":
        assert results[0].ranks["q_proj"] == 8 and not results[0].a["q_proj"][0, 4:].any()
