"""Weight loading: single file and sharded index, tied embeddings, base hash, and clear refusals."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from loraplane.artifacts.base_hash import compute_base_hash  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402
from loraplane.engine.model.weights import WeightsError, load_model, safetensors_files  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sharded_llama_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="40KB")
    return out


def test_sharded_index_loads_the_same_weights(tiny_llama_dir, sharded_llama_dir):
    assert (sharded_llama_dir / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded_llama_dir)) > 1
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    single = load_model(tiny_llama_dir, cfg, CPU, torch.float32).state_dict()
    sharded = load_model(sharded_llama_dir, cfg, CPU, torch.float32).state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
    # the base hash ignores how the weights are split into files
    assert compute_base_hash(tiny_llama_dir) == compute_base_hash(sharded_llama_dir)


def test_load_in_another_dtype(tiny_llama_dir):
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    for dtype in (torch.bfloat16, torch.float16):
        model = load_model(tiny_llama_dir, cfg, CPU, dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}


def test_tied_checkpoint_has_no_lm_head_and_shares_the_embedding(tiny_qwen2_dir):
    cfg = ModelConfig.from_pretrained(tiny_qwen2_dir)
    assert cfg.tie_word_embeddings
    model = load_model(tiny_qwen2_dir, cfg, CPU, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_and_unexpected_tensors_are_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_llama_dir / "model.safetensors")
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    save_file(broken, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(tmp_path, cfg, CPU, torch.float32)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="unexpected tensor model.extra.weight"):
        load_model(tmp_path, cfg, CPU, torch.float32)
    bad_shape = {**tensors, "model.norm.weight": torch.zeros(3)}
    save_file(bad_shape, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="model.norm.weight: shape"):
        load_model(tmp_path, cfg, CPU, torch.float32)


def test_pickle_only_folder_is_refused(tmp_path, tiny_llama_dir):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded, ever")
    with pytest.raises(WeightsError, match="safetensors required"):
        safetensors_files(tmp_path)


def test_broken_index_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(WeightsError, match="absent"):
        safetensors_files(tmp_path)
