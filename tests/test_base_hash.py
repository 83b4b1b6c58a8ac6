"""The base-hash definition: content-only, shard-independent, dtype-sensitive, and refuses non-safetensors."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from loraplane.artifacts.base_hash import BaseHashError, compute_base_hash


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((6, 4)).astype(np.float32),
        "model.norm.weight": rng.standard_normal((4,)).astype(np.float32),
    }


def test_hash_is_independent_of_sharding_and_metadata(tmp_path):
    tensors = _tensors()
    one = tmp_path / "one"
    one.mkdir()
    save_file(tensors, one / "model.safetensors", metadata={"format": "pt"})

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:1]}, sharded / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[1:]}, sharded / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 if k in names[:1] else 2}-of-00002.safetensors" for k in names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    assert compute_base_hash(one) == compute_base_hash(sharded)
    assert len(compute_base_hash(one)) == 64


def test_hash_changes_with_one_value_or_dtype(tmp_path):
    base = _tensors()
    changed = {k: v.copy() for k, v in base.items()}
    changed["model.norm.weight"][0] += 1e-3
    as_fp16 = {k: v.astype(np.float16) for k, v in base.items()}
    hashes = []
    for i, tensors in enumerate([base, changed, as_fp16]):
        d = tmp_path / str(i)
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        hashes.append(compute_base_hash(d))
    assert len(set(hashes)) == 3


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not-loaded")
    with pytest.raises(BaseHashError, match="pickle formats are not accepted"):
        compute_base_hash(tmp_path)


def test_truncated_file_is_refused(tmp_path):
    save_file(_tensors(), tmp_path / "model.safetensors")
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(BaseHashError, match="truncated"):
        compute_base_hash(tmp_path)
