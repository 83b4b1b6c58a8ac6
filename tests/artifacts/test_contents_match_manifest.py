"""A validly signed artifact whose files contradict its manifest (a careless producer, a compromised signing
pipeline) is refused by every verifier that holds the files, for the same reason: ``loraplane adapter
verify`` on a folder and on S3, the host cache, and so ``serve --trusted-keys-dir --adapter`` and the pods."""

from __future__ import annotations

import json

import pytest
from adapter_factory import build_signed_adapter, edit_config, resign_edited
from tamper import assert_cache_holds_only_verified, upload_folder

from loraplane.artifacts import errors as E
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.cli import main
from loraplane.artifacts.verify import Policy, verify_folder

MODULES = ("q_proj", "v_proj")  # rank 4, lora_alpha 8 in the signed fixture: scale 2


def _keep(folder) -> None:
    """An edit that leaves the files alone (only the manifest lies)."""


CASES = {
    "hidden-module": (_keep, {"ranks": {"q_proj": 4}, "target_modules": ["q_proj"], "alphas": {"q_proj": 8},
                              "scales": {"q_proj": 2.0}}, E.UNKNOWN_MODULE),
    "rank-under-reported": (_keep, {"ranks": {"q_proj": 2, "v_proj": 2}, "scales": {"q_proj": 4, "v_proj": 4}},
                            E.RANK_TOO_HIGH),
    "rank-over-reported": (_keep, {"ranks": {"q_proj": 8, "v_proj": 8}, "scales": {"q_proj": 1, "v_proj": 1}},
                           E.RANK_MISMATCH),
    "dtype": (_keep, {"dtype": "float16"}, E.BAD_MANIFEST),
    "scales": (_keep, {"alpha": 16, "alphas": {"q_proj": 16, "v_proj": 16}, "scales": {"q_proj": 4, "v_proj": 4}},
               E.BAD_MANIFEST),
    "rslora": (_keep, {"use_rslora": True, "scales": {"q_proj": 4, "v_proj": 4}}, E.BAD_MANIFEST),
    "config-alpha": (edit_config(lora_alpha=64), {}, E.BAD_MANIFEST),
    "config-rank": (edit_config(r=8), {}, E.RANK_MISMATCH),
    "config-key": (edit_config(use_qalora=True), {}, E.UNSUPPORTED_ADAPTER),
}  # fmt: skip


@pytest.fixture(scope="module")
def signed(tmp_path_factory, keys, base_dir):
    return build_signed_adapter(tmp_path_factory.mktemp("a") / "demo", name="demo", version="v1", keys=keys,
                                base_dir=base_dir, rank=4, alpha=8, target_modules=MODULES)  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_files_that_contradict_the_manifest_are_refused_everywhere(
    case, tmp_path, moto, monkeypatch, s3, bucket, keys, signed, base_hash, capsys
):
    edit, lies, reason = CASES[case]
    folder = tmp_path / "doctored"
    resign_edited(signed.folder, folder, keys, edit, **lies)

    with pytest.raises(E.ArtifactError) as err:  # loraplane adapter verify <folder>, serve --adapter
        verify_folder(folder, trusted_keys=keys.trusted, policy=Policy())
    assert err.value.reason == reason and err.value.field, err.value

    upload_folder(s3, bucket, "demo/v1/", folder)
    uri = f"s3://{bucket}/demo/v1/"
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    code = main(["verify", uri, "--trusted-keys", str(keys.trusted_dir), "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert (code, answer["ok"], answer["reason"]) == (1, False, reason), answer

    cache = HostCache(tmp_path / "cache", 1 << 30, s3)
    with pytest.raises(E.ArtifactError) as err:  # the pods
        cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash)
    assert err.value.reason == reason, err.value
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []
    assert list((tmp_path / "cache" / "blobs").iterdir()) == [], "nothing of a refused adapter stays"
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_the_untouched_artifact_passes_everywhere(
    tmp_path, moto, monkeypatch, s3, bucket, keys, signed, base_hash, capsys
):
    folder = tmp_path / "same"
    resign_edited(signed.folder, folder, keys, _keep)
    verify_folder(folder, trusted_keys=keys.trusted, policy=Policy())
    upload_folder(s3, bucket, "demo/v1/", folder)
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    assert main(["verify", f"s3://{bucket}/demo/v1/", "--trusted-keys", str(keys.trusted_dir), "-q"]) == 0
    HostCache(tmp_path / "cache", 1 << 30, s3).pull(
        f"s3://{bucket}/demo/v1/", trusted_keys=keys.trusted, expected_base_hash=base_hash
    )
