"""The manifest's per-module rank, alpha and scale are exactly what PEFT's LoraLayer uses, and ``pack``
refuses a config whose ``r`` or ``rank_pattern`` disagrees with the weights."""

from __future__ import annotations

import json

import pytest
from adapter_factory import TINY_BASE_CONFIG, make_peft_folder

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import Manifest
from loraplane.artifacts.pack import pack_folder

HASH = "d" * 64
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {
    "plain": dict(r=4, lora_alpha=8),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True),
    "rank_pattern": dict(r=4, lora_alpha=16, rank_pattern={"v_proj": 8, "mlp.down_proj": 2}),
    "alpha_pattern": dict(r=4, lora_alpha=8, alpha_pattern={"q_proj": 32, r"self_attn\.o_proj": 3}),
    "both_rslora": dict(
        r=8,
        lora_alpha=8,
        use_rslora=True,
        rank_pattern={"k_proj": 2, "up_proj": 16},
        alpha_pattern={"k_proj": 5.5, "gate_proj": 64},
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_BASE_CONFIG.items() if k != "architectures"})
    return lambda: transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifest_scales_equal_peft_lora_layer(tmp_path, tiny_llama, case):
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(target_modules=MODULES, **CASES[case]))
    model.save_pretrained(tmp_path / "adapter")
    manifest = pack_folder(tmp_path / "adapter", name="demo", version="v1", base_hash=HASH)
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            short = name.rsplit(".", 1)[1]
            seen.setdefault(short, set()).add(
                (module.r["default"], module.lora_alpha["default"], module.scaling["default"])
            )
    assert set(seen) == set(manifest.scales) == set(MODULES)
    for short, values in seen.items():
        assert len(values) == 1, f"{short}: PEFT varies over layers {values}"
        ((rank, alpha, scale),) = values
        assert manifest.ranks[short] == rank, short
        assert manifest.alphas[short] == pytest.approx(alpha, rel=1e-12), short
        assert manifest.scales[short] == pytest.approx(scale, rel=1e-12), short
    again = Manifest.from_json(manifest.canonical_bytes())  # the per-module fields round-trip
    assert dict(again.scales) == dict(manifest.scales)


def _config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_pack_refuses_a_config_rank_that_the_weights_do_not_hold(tmp_path):
    folder = make_peft_folder(tmp_path / "a", rank=8)
    _config(folder, r=4)  # weights of rank 8 served at alpha/4 would differ from PEFT
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert err.value.reason == E.RANK_MISMATCH and err.value.field == "adapter_config.json.r"
    assert "rank 4" in err.value.message and "rank 8" in err.value.message
    _config(folder, r=4, rank_pattern={"q_proj": 8})  # v_proj still says 4
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert err.value.reason == E.RANK_MISMATCH and "v_proj" in err.value.message
    _config(folder, r=4, rank_pattern={"q_proj": 16, "v_proj": 8})
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert err.value.field == "adapter_config.json.rank_pattern"
    _config(folder, r=4, rank_pattern={"q_proj": 8, "v_proj": 8}, alpha_pattern={"v_proj": 2})
    manifest = pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert dict(manifest.scales) == {"q_proj": 1, "v_proj": 0.25}


def test_layer_specific_patterns_that_split_a_module_are_refused(tmp_path):
    folder = make_peft_folder(tmp_path / "a", rank=4, base_config=dict(TINY_BASE_CONFIG))
    _config(folder, alpha_pattern={r"layers\.0\.self_attn\.q_proj": 64})
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert err.value.reason == E.BAD_MANIFEST and "q_proj" in err.value.message
    _config(folder, alpha_pattern={"q_proj(": 64})
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert err.value.field == "adapter_config.json.alpha_pattern.q_proj("


def test_a_manifest_scale_that_is_not_alpha_over_r_is_refused():
    from test_manifest_signing import GOOD

    manifest = Manifest.from_dict({**GOOD, "alphas": {"q_proj": 32, "v_proj": 16}})
    assert dict(manifest.scales) == {"q_proj": 4, "v_proj": 1}
    for bad, field in (({"scales": {"q_proj": 3, "v_proj": 1}}, "manifest.scales.q_proj"),
                       ({"alphas": {"q_proj": 32}}, "manifest.alphas"),
                       ({"alphas": {"q_proj": -1, "v_proj": 16}}, "manifest.alphas.q_proj")):  # fmt: skip
        with pytest.raises(E.ArtifactError) as err:
            Manifest.from_dict({**GOOD, **bad})
        assert err.value.reason == E.BAD_MANIFEST and err.value.field == field
