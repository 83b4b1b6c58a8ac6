"""``pack`` and ``sign`` refuse on the producer's machine what a pod would refuse later."""

from __future__ import annotations

import json

import pytest
from adapter_factory import TINY_BASE_CONFIG, make_peft_folder, random_tensor_bytes, write_safetensors

from loraplane.artifacts import errors as E
from loraplane.artifacts.pack import pack_folder, sign_folder
from loraplane.artifacts.signing import verify_signature

HASH = "d" * 64


def _refused(folder, reason, **kwargs):
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", **({"base_hash": HASH} | kwargs))
    assert err.value.reason == reason, err.value
    return err.value


def test_pack_checks_shapes_against_the_base(tmp_path, base_dir):
    folder = make_peft_folder(tmp_path / "a", target_modules=("q_proj", "k_proj", "down_proj"), rank=8)
    manifest = pack_folder(folder, name="demo", version="v1", base_dir=base_dir)
    assert dict(manifest.ranks) == {"down_proj": 8, "k_proj": 8, "q_proj": 8}
    wider = dict(TINY_BASE_CONFIG, hidden_size=32, head_dim=8)
    other = make_peft_folder(tmp_path / "b", base_config=wider)
    err = _refused(other, E.SHAPE_MISMATCH, base_dir=base_dir, base_hash=None)
    assert err.field == "adapter_model.safetensors" and "[r, 64]" in err.message
    deeper = make_peft_folder(tmp_path / "c", base_config=dict(TINY_BASE_CONFIG, num_hidden_layers=3))
    _refused(deeper, E.SHAPE_MISMATCH, base_dir=base_dir, base_hash=None)


def test_pack_records_per_module_ranks_and_limits_them(tmp_path):
    folder = make_peft_folder(
        tmp_path / "a", target_modules=("q_proj", "v_proj"), rank=4, ranks={"v_proj": 16}
    )
    manifest = pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert dict(manifest.ranks) == {"q_proj": 4, "v_proj": 16} and manifest.max_rank == 16
    err = _refused(folder, E.RANK_TOO_HIGH, max_rank=8)
    assert "v_proj" in err.field


def test_pack_refuses_pickle_unexpected_and_missing(tmp_path):
    folder = make_peft_folder(tmp_path / "a")
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04")
    _refused(folder, E.PICKLE_WEIGHTS)
    (folder / "adapter_model.bin").unlink()
    (folder / "training_args.json").write_text("{}")
    _refused(folder, E.UNEXPECTED_FILE)
    (folder / "training_args.json").unlink()
    (folder / "checkpoints").mkdir()
    _refused(folder, E.UNEXPECTED_FILE)
    (folder / "checkpoints").rmdir()
    (folder / "adapter_config.json").unlink()
    _refused(folder, E.MISSING_FILE)


def test_pack_refuses_unknown_modules_and_unserved_options(tmp_path):
    folder = make_peft_folder(tmp_path / "a")
    shape = (4, 64)
    write_safetensors(
        folder / "adapter_model.safetensors",
        {
            "base_model.model.lm_head.lora_A.weight": (
                "float32",
                shape,
                random_tensor_bytes(shape, "float32", __import__("random").Random()),
            )
        },
    )
    _refused(folder, E.UNKNOWN_MODULE)
    folder = make_peft_folder(tmp_path / "b")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    assert _refused(folder, E.UNSUPPORTED_ADAPTER).field == "adapter_config.json.use_dora"


def _with_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    config = {k: v for k, v in {**config, **changes}.items() if v is not ...}  # ...: drop the key
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "changes, field",
    [({"r": None}, "r"), ({"r": "4"}, "r"), ({"r": 4.0}, "r"), ({"r": True}, "r"), ({"r": 0}, "r"),
     ({"lora_alpha": None}, "lora_alpha"), ({"lora_alpha": float("nan")}, "lora_alpha"),
     ({"rank_pattern": {"q_proj": None}}, "rank_pattern.q_proj"),
     ({"alpha_pattern": {"q_proj": [1]}}, "alpha_pattern.q_proj"), ({"alpha_pattern": {"[": 1}}, "alpha_pattern.["),
     ({"rank_pattern": []}, "rank_pattern"), ({"use_rslora": "yes"}, "use_rslora"),
     ({"target_modules": {"q_proj": 1}}, "target_modules")],
)  # fmt: skip
def test_pack_refuses_config_values_that_are_not_numbers_naming_them(tmp_path, changes, field):
    folder = _with_config(make_peft_folder(tmp_path / "a"), **changes)
    assert _refused(folder, E.BAD_MANIFEST).field == f"adapter_config.json.{field}"


def test_a_config_without_r_means_peft_default_8_checked_against_the_weights(tmp_path):
    eight = _with_config(make_peft_folder(tmp_path / "a", rank=8), r=..., lora_alpha=...)
    manifest = pack_folder(eight, name="demo", version="v1", base_hash=HASH)
    assert dict(manifest.ranks) == {"q_proj": 8, "v_proj": 8} and manifest.alpha == 8  # PEFT's defaults
    four = _with_config(make_peft_folder(tmp_path / "b", rank=4), r=...)
    assert _refused(four, E.RANK_MISMATCH).field == "adapter_config.json.r"


def test_pack_reads_half_precision_and_rslora(tmp_path):
    folder = make_peft_folder(tmp_path / "a", dtype="bfloat16", use_rslora=True, alpha=32)
    manifest = pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert manifest.dtype == "bfloat16" and manifest.use_rslora and manifest.alpha == 32


def test_sign_rechecks_files_and_a_new_pack_voids_the_signature(tmp_path, keys):
    folder = make_peft_folder(tmp_path / "a")
    manifest = pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    signed = sign_folder(folder, keys.private_pem)
    sig = (folder / "loraplane-manifest.sig").read_bytes()
    assert verify_signature(manifest.canonical_bytes(), sig, keys.trusted) == keys.key_id
    assert signed["digest"] == manifest.digest()
    (folder / "adapter_config.json").write_text((folder / "adapter_config.json").read_text() + " ")
    with pytest.raises(E.ArtifactError) as err:
        sign_folder(folder, keys.private_pem)
    assert err.value.reason == E.FILE_SIZE_MISMATCH
    pack_folder(folder, name="demo", version="v2", base_hash=HASH)
    assert not (folder / "loraplane-manifest.sig").exists()


def test_packing_shared_files_hashes_each_once_and_a_rewrite_is_seen(tmp_path, keys, monkeypatch):
    """Many artifacts over one weights file (hard links): packing hashes and checks each settled file once
    per process (signing, the gate, hashes it every time); a rewrite that keeps the size and puts the mtime
    back still changes the ctime, and is hashed again."""
    import os
    import time

    from loraplane.artifacts import fsutil, pack

    first = make_peft_folder(tmp_path / "a")
    weights = first / "adapter_model.safetensors"
    folders = [first]
    for i in range(3):
        other = tmp_path / f"b{i}"
        other.mkdir()
        for f in first.iterdir():
            os.link(f, other / f.name)
        folders.append(other)
    time.sleep(fsutil.SETTLE_NS / 1e9 + 0.1)  # every file older than a timestamp tick
    hashed = []
    real = pack.hash_file
    monkeypatch.setattr(pack, "hash_file", lambda p, n, e=None: hashed.append(n) or real(p, n, e))
    digests = set()
    for i, folder in enumerate(folders):
        digests.add(
            pack_folder(folder, name=f"a{i}", version="v1", base_hash=HASH).files[weights.name].sha256
        )
        sign_folder(folder, keys.private_pem)
    assert len(digests) == 1
    assert hashed.count(weights.name) == 1 + len(folders)  # the first pack, then each sign

    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of some tensor: same size, other bytes
    st = os.stat(weights)
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back; the ctime moved
    with pytest.raises(E.ArtifactError) as err:
        sign_folder(folders[1], keys.private_pem)
    assert err.value.reason == E.FILE_HASH_MISMATCH
    before = hashed.count(weights.name)
    new = pack_folder(folders[2], name="a2", version="v2", base_hash=HASH).files[weights.name].sha256
    assert hashed.count(weights.name) == before + 1 and new not in digests
