"""``loraplane adapter`` end to end against moto: keygen, pack, sign, push, verify, pull, inspect, yaml,
with --json output and the documented exit codes. Credentials reach boto3 only through the environment."""

from __future__ import annotations

import json

import pytest
import yaml
from adapter_factory import make_peft_folder

from loraplane.artifacts.cli import main


@pytest.fixture
def env(moto, monkeypatch):
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto


def run(capsys, *argv) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_producer_to_consumer_flow(tmp_path, env, bucket, base_dir, base_hash, capsys):
    code, key = run(capsys, "keygen", "--out", str(tmp_path / "keys"), "--name", "team")
    assert code == 0 and len(key["key_id"]) == 16
    assert (tmp_path / "keys" / "team.key").stat().st_mode & 0o777 == 0o600
    folder = make_peft_folder(tmp_path / "adapter", rank=8, target_modules=("q_proj", "o_proj", "up_proj"))
    code, packed = run(
        capsys, "pack", str(folder), "--base", str(base_dir), "--name", "support", "--version", "v1"
    )
    assert code == 0 and packed["base_model_hash"] == base_hash and packed["max_rank"] == 8
    code, signed = run(capsys, "sign", str(folder), "--key", key["private_key"])
    assert code == 0 and signed["key_id"] == key["key_id"] and signed["digest"] == packed["digest"]
    uri = f"s3://{bucket}/support/v1/"
    code, pushed = run(capsys, "push", str(folder), uri)
    assert code == 0 and pushed["digest"] == packed["digest"]

    pub = key["public_key"]
    code, verified = run(
        capsys, "verify", uri, "--trusted-keys", pub, "--base-hash", base_hash, "--digest", packed["digest"]
    )
    assert code == 0 and verified["verified"] and verified["key_id"] == key["key_id"]
    code, local = run(capsys, "verify", str(folder), "--trusted-keys", pub, "--base", str(base_dir))
    assert code == 0
    code, err = run(capsys, "verify", str(folder), "--trusted-keys", str(tmp_path / "keys"))
    assert (code, err["reason"], err["field"]) == (2, "BadKey", "trusted_keys.team.key")
    code, pulled = run(
        capsys,
        "pull",
        uri,
        "--cache",
        str(tmp_path / "cache"),
        "--trusted-keys",
        pub,
        "--base-hash",
        base_hash,
    )
    assert code == 0 and pulled["digest"] == packed["digest"] and pulled["downloaded_bytes"] > 0
    code, inspected = run(capsys, "inspect", uri)
    assert (
        code == 0
        and inspected["manifest"]["name"] == "support"
        and inspected["signed_by_unverified"] == key["key_id"]
    )

    assert main(["yaml", uri, "--base-ref", "smollm2-135m", "--namespace", "ml"]) == 0
    resource = yaml.safe_load(capsys.readouterr().out)
    assert resource["apiVersion"] == "loraplane.dev/v1alpha1" and resource["kind"] == "LoRAAdapter"
    assert resource["metadata"] == {
        "name": "support",
        "namespace": "ml",
        "labels": {"loraplane.dev/version": "v1"},
    }
    assert resource["spec"] == {
        "baseRef": {"name": "smollm2-135m"},
        "version": "v1",
        "source": {"uri": uri, "manifestDigest": packed["digest"]},
    }


def test_exit_codes(tmp_path, env, bucket, keys, base_hash, capsys):
    folder = make_peft_folder(tmp_path / "adapter")
    assert main(["pack", str(folder), "--base-hash", base_hash, "--name", "x", "--version", "v1", "-q"]) == 0
    (tmp_path / "k").write_bytes(keys.private_pem)
    assert main(["sign", str(folder), "--key", str(tmp_path / "k"), "-q"]) == 0
    uri = f"s3://{bucket}/x/v1/"
    assert main(["push", str(folder), uri, "-q"]) == 0
    capsys.readouterr()
    trusted = str(keys.trusted_dir)

    code, err = run(capsys, "verify", uri, "--trusted-keys", trusted, "--base-hash", "0" * 64)
    assert (code, err["ok"], err["reason"], err["field"]) == (
        1,
        False,
        "BaseMismatch",
        "manifest.base_model_hash",
    )
    code, err = run(capsys, "verify", uri, "--trusted-keys", trusted, "--max-rank", "2")
    assert (code, err["reason"]) == (1, "RankTooHigh")
    code, err = run(capsys, "verify", "s3://Bad_Bucket/x/", "--trusted-keys", trusted)
    assert (code, err["reason"], err["field"]) == (2, "BadUri", "source.uri")
    code, err = run(capsys, "verify", f"s3://{bucket}/nothing/here/", "--trusted-keys", trusted)
    assert (code, err["reason"]) == (4, "NotFound")
    code, err = run(
        capsys,
        "verify",
        uri,
        "--trusted-keys",
        trusted,
        "--endpoint-url",
        "http://127.0.0.1:9",
        "--attempts",
        "2",
    )
    assert (code, err["reason"]) == (3, "SourceUnreachable")
    other = make_peft_folder(tmp_path / "other", seed=5)
    main(["pack", str(other), "--base-hash", base_hash, "--name", "x", "--version", "v1", "-q"])
    main(["sign", str(other), "--key", str(tmp_path / "k"), "-q"])
    capsys.readouterr()
    code, err = run(capsys, "push", str(other), uri)
    assert (code, err["reason"]) == (6, "VersionExists")
    assert main(["verify"]) == 2  # usage
    capsys.readouterr()


def test_text_mode_errors_go_to_stderr(tmp_path, env, keys, capsys):
    code = main(["verify", str(tmp_path), "--trusted-keys", str(keys.trusted_dir)])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.startswith("loraplane adapter verify: MissingFile (loraplane-manifest.json)")


def test_push_shows_progress_on_stderr(tmp_path, env, bucket, keys, base_hash, capsys):
    folder = make_peft_folder(tmp_path / "adapter")
    main(["pack", str(folder), "--base-hash", base_hash, "--name", "x", "--version", "v2", "-q"])
    (tmp_path / "k").write_bytes(keys.private_pem)
    main(["sign", str(folder), "--key", str(tmp_path / "k")])
    capsys.readouterr()
    assert main(["push", str(folder), f"s3://{bucket}/x/v2/"]) == 0
    captured = capsys.readouterr()
    assert "push x [####################] 100%" in captured.err
    assert "digest: sha256:" in captured.out
