"""Tamper matrix: every way an artifact can be wrong is refused with its own reason, by the manifest check
(what the operator runs) and by the host cache (what a pod runs), and nothing unverified becomes loadable."""

from __future__ import annotations

import json

import pytest
from adapter_factory import build_signed_adapter, make_keys
from tamper import assert_cache_holds_only_verified, manifest_dict, resign, upload_folder

from loraplane.artifacts import errors as E
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.manifest import MANIFEST_FILE, SIGNATURE_FILE
from loraplane.artifacts.verify import fetch_verified_manifest

W, C = "adapter_model.safetensors", "adapter_config.json"


def _flip_weights(ctx):
    data = bytearray(ctx.files[W])
    data[-1] ^= 0xFF  # same size, other content: only streaming hash can see it
    ctx.s3.put_object(Bucket=ctx.bucket, Key=ctx.prefix + W, Body=bytes(data))


def _grow_weights(ctx):
    ctx.s3.put_object(Bucket=ctx.bucket, Key=ctx.prefix + W, Body=ctx.files[W] + b"\0" * 8)


def _edit_manifest(ctx, edit, *, resign_with=None):
    m = manifest_dict(ctx.folder)
    edit(m)
    if resign_with is None:  # the attacker cannot sign: old signature, new bytes
        from loraplane.artifacts.manifest import canonical_json

        ctx.s3.put_object(Bucket=ctx.bucket, Key=ctx.prefix + MANIFEST_FILE, Body=canonical_json(m))
    else:
        resign(ctx.s3, ctx.bucket, ctx.prefix, m, resign_with)


def _lie_about_modules(ctx):
    """Signed (by a trusted but careless producer) manifest that under-reports the weights' modules."""

    def edit(m):
        m["ranks"] = {"q_proj": 4}
        m["target_modules"] = ["q_proj"]
        m["alphas"], m["scales"] = {"q_proj": m["alphas"]["q_proj"]}, {"q_proj": m["scales"]["q_proj"]}

    _edit_manifest(ctx, edit, resign_with=ctx.keys.private_pem)


class Ctx:
    pass


# reason -> (mutate S3, extra kwargs for the check, does fetch_verified_manifest see it without weights?)
CASES = {
    "Unsigned": (lambda c: c.s3.delete_object(Bucket=c.bucket, Key=c.prefix + SIGNATURE_FILE), {}, True),
    "UnknownKey": (
        lambda c: resign(c.s3, c.bucket, c.prefix, manifest_dict(c.folder), c.stranger.private_pem),
        {},
        True,
    ),
    "BadSignature": (lambda c: _edit_manifest(c, lambda m: m.update(alpha=64)), {}, True),
    "BadSignature-garbage": (
        lambda c: c.s3.put_object(Bucket=c.bucket, Key=c.prefix + SIGNATURE_FILE, Body=b'{"alg":"ed25519"}'),
        {},
        True,
    ),
    "DigestMismatch": (lambda c: None, {"pinned_digest": "sha256:" + "0" * 64}, True),
    "BaseMismatch": (lambda c: None, {"expected_base_hash": "f" * 64}, True),
    "FileHashMismatch": (_flip_weights, {}, False),
    "FileSizeMismatch": (_grow_weights, {}, True),
    "MissingFile": (lambda c: c.s3.delete_object(Bucket=c.bucket, Key=c.prefix + C), {}, True),
    "UnexpectedFile": (
        lambda c: c.s3.put_object(Bucket=c.bucket, Key=c.prefix + "notes.txt", Body=b"hi"),
        {},
        True,
    ),
    "BadPath": (
        lambda c: _edit_manifest(
            c, lambda m: m["files"].update({"../escape": m["files"][C]}), resign_with=c.keys.private_pem
        ),
        {},
        True,
    ),
    "BadPath-nested-object": (
        lambda c: c.s3.put_object(Bucket=c.bucket, Key=c.prefix + "sub/x.json", Body=b"{}"),
        {},
        True,
    ),
    "PickleWeights": (
        lambda c: c.s3.put_object(
            Bucket=c.bucket, Key=c.prefix + "adapter_model.bin", Body=b"\x80\x04pickle"
        ),
        {},
        True,
    ),
    "PickleWeights-in-manifest": (
        lambda c: _edit_manifest(
            c,
            lambda m: m["files"].update({"adapter_model.bin": m["files"][W]}),
            resign_with=c.keys.private_pem,
        ),
        {},
        True,
    ),
    "RankTooHigh": (lambda c: None, {"max_rank": 2}, True),
    "UnknownModule": (lambda c: None, {"allowed_modules": {"q_proj"}}, True),
    "UnknownModule-weights-disagree": (_lie_about_modules, {}, False),
    "FileTooLarge": (lambda c: None, {"max_file_bytes": 1000}, True),
    "BadManifest": (
        lambda c: resign(
            c.s3,
            c.bucket,
            c.prefix,
            json.dumps(manifest_dict(c.folder), indent=1).encode(),
            c.keys.private_pem,
        ),
        {},
        True,
    ),
    "NotFound": (
        lambda c: [c.s3.delete_object(Bucket=c.bucket, Key=c.prefix + k) for k in c.files],
        {},
        True,
    ),
}


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("stranger"))


@pytest.fixture(scope="module")
def signed(tmp_path_factory, keys, base_dir):
    return build_signed_adapter(
        tmp_path_factory.mktemp("a") / "demo", name="demo", version="v1", keys=keys, base_dir=base_dir
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_tamper_matrix(case, tmp_path, s3, bucket, keys, stranger, signed, base_hash, retry):
    mutate, kwargs, visible_in_manifest = CASES[case]
    reason = case.split("-")[0]
    ctx = Ctx()
    ctx.s3, ctx.bucket, ctx.prefix, ctx.folder, ctx.keys, ctx.stranger = (
        s3,
        bucket,
        "demo/v1/",
        signed.folder,
        keys,
        stranger,
    )
    ctx.files = upload_folder(s3, bucket, ctx.prefix, signed.folder)
    mutate(ctx)
    uri = f"s3://{bucket}/{ctx.prefix}"
    check = {"trusted_keys": keys.trusted, "expected_base_hash": base_hash, **kwargs}

    if visible_in_manifest:  # the operator's check refuses it before any pod is touched
        with pytest.raises(E.ArtifactError) as err:
            fetch_verified_manifest(uri, s3_client=s3, retry=retry, **check)
        assert err.value.reason == reason, err.value

    max_file = check.pop("max_file_bytes", None)
    cache = HostCache(
        tmp_path / "cache", 1 << 30, s3, retry=retry, **({"max_file_bytes": max_file} if max_file else {})
    )
    with pytest.raises(E.ArtifactError) as err:
        cache.pull(uri, **check)
    assert err.value.reason == reason, err.value
    assert err.value.field, "every refusal names the field or file it concerns"
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []
    assert list((tmp_path / "cache" / "blobs").iterdir()) == [], "nothing of a refused adapter stays"
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_untampered_control(tmp_path, s3, bucket, keys, signed, base_hash, retry):
    """The same fixture, untouched, passes both checks (so each refusal above is the tampering's doing)."""
    upload_folder(s3, bucket, "demo/v1/", signed.folder)
    uri = f"s3://{bucket}/demo/v1/"
    fetch_verified_manifest(
        uri, trusted_keys=keys.trusted, expected_base_hash=base_hash, s3_client=s3, retry=retry
    )
    cache = HostCache(tmp_path / "cache", 1 << 30, s3, retry=retry)
    local = cache.pull(
        uri, trusted_keys=keys.trusted, expected_base_hash=base_hash, pinned_digest=signed.digest, max_rank=4
    )
    assert local.digest == signed.digest
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)
