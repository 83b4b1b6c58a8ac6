"""Fixtures of the operator tests: the real control plane with our CRDs, moto S3 with signed adapters, a World."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import pytest

from tests.adapter_factory import build_signed_adapter, make_keys, push_adapter
from tests.controlplane.fixtures import control_plane, namespace  # noqa: F401
from tests.operator.harness import World
from tests.s3_servers import moto_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE_HASH = "5e" * 32
OTHER_BASE = "77" * 32
BUCKET = "adapters"


@dataclass
class Artifacts:
    s3: object
    keys: object
    uris: dict  # label -> s3 URI
    digests: dict  # label -> manifest digest


def _build(tmp: pathlib.Path, s3) -> Artifacts:
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    keys, strangers = make_keys(tmp / "keys"), make_keys(tmp / "strangers")
    uris, digests = {}, {}

    def add(label, name, version, *, signer=keys, base=BASE_HASH, rank=4):
        adapter = build_signed_adapter(tmp / label, name=name, version=version, keys=signer, base_hash=base,
                                       rank=rank)  # fmt: skip
        uris[label] = push_adapter(adapter.folder, client, BUCKET)
        digests[label] = adapter.digest
        return adapter

    add("v1", "chat", "v1")
    v2 = add("v2", "chat", "v2")
    add("v3", "chat", "v3")
    add("support_bot", "support-bot", "v1")  # examples/loraadapter.yaml's name: identity is signed
    add("unknown_key", "stranger", "v1", signer=strangers)
    add("base_mismatch", "other-base", "v1", base=OTHER_BASE)
    add("rank_too_high", "big", "v1", rank=32)
    add("unsigned", "unsigned", "v1")
    bucket, prefix = uris["unsigned"].removeprefix("s3://").split("/", 1)
    client.delete_object(Bucket=bucket, Key=prefix + "loraplane-manifest.sig")
    add("bad_signature", "tampered", "v1")
    bucket, prefix = uris["bad_signature"].removeprefix("s3://").split("/", 1)
    other_sig = (v2.folder / "loraplane-manifest.sig").read_bytes()  # a valid signature, of other bytes
    client.put_object(Bucket=bucket, Key=prefix + "loraplane-manifest.sig", Body=other_sig)
    add("nested_signature", "nested", "v1")  # a signature file of 4000 '[': a reason, never a crash
    bucket, prefix = uris["nested_signature"].removeprefix("s3://").split("/", 1)
    client.put_object(Bucket=bucket, Key=prefix + "loraplane-manifest.sig", Body=b"[" * 4000)
    return Artifacts(s3, keys, uris, digests)


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Artifacts:
    with moto_server() as s3:
        yield _build(tmp_path_factory.mktemp("artifacts"), s3)


@pytest.fixture
def world(control_plane, namespace, artifacts):  # noqa: F811
    w = World(control_plane, namespace, s3=artifacts.s3, keys=artifacts.keys, base_hash=BASE_HASH)
    try:
        yield w
    finally:
        w.close()
