"""An adapter's identity is the signed manifest's: a LoRAAdapter cannot serve another name's or another
version's artifact, and without a pinned digest it cannot go back to a version signed earlier."""

from __future__ import annotations

from loraplane.artifacts.pack import pack_folder, sign_folder
from tests.adapter_factory import make_peft_folder, push_adapter
from tests.operator.conftest import BASE_HASH, BUCKET
from tests.operator.harness import OperatorThread, condition


def _build(tmp_path, artifacts, label: str, version: str, created: str, seed: int) -> tuple[str, str]:
    """A signed "chat" version with a chosen signing time, pushed to chat/<label>/: (uri, digest)."""
    folder = make_peft_folder(tmp_path / label, seed=seed)
    pack_folder(folder, name="chat", version=version, base_hash=BASE_HASH, created=created)
    digest = sign_folder(folder, artifacts.keys.private_pem)["digest"]
    return push_adapter(folder, artifacts.s3.client(), BUCKET, prefix=f"chat/{label}/"), digest


def test_name_or_version_other_than_the_signed_ones_is_refused(world, artifacts):
    world.create_base(replicas=1)
    with OperatorThread(world):
        pod = world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v9")  # the v1 artifact, called v9
        world.create_adapter("impostor", artifacts.uris["v1"], "v1")  # chat's artifact, called impostor
        for name, field in (("chat", "spec.version"), ("impostor", "metadata.name")):
            adapter = world.wait_reason(name, "IdentityMismatch")
            validated = condition(adapter, "Validated")
            assert validated["status"] == "False" and validated["reason"] == "IdentityMismatch"
            assert validated["message"].startswith(field), validated["message"]
        assert not pod.count("PUT"), "nothing with a borrowed identity reaches a pod"


def test_an_older_signed_version_needs_a_pinned_digest(world, artifacts, tmp_path):
    new_uri, new_digest = _build(tmp_path, artifacts, "r2", "r2", "2026-11-30T10:00:00Z", seed=1)
    # r3 was signed long ago (an abandoned build): whoever can write to the bucket can put it at r3/
    old_uri, old_digest = _build(tmp_path, artifacts, "r3", "r3", "2026-06-01T10:00:00Z", seed=2)
    world.create_base(replicas=1)
    with OperatorThread(world):
        pod = world.add_pod()
        world.create_adapter("chat", new_uri, "r2")
        assert world.wait_ready("chat")["status"]["digest"] == new_digest
        world.api("PATCH", "LoRAAdapter", "chat", {"spec": {"source": {"uri": old_uri}, "version": "r3"}})
        refused = world.wait_reason("chat", "RollbackRefused")
        validated = condition(refused, "Validated")
        assert validated["status"] == "False" and "2026-06-01T10:00:00Z" in validated["message"]
        assert refused["status"]["digest"] == new_digest and pod.versions("chat") == {"r2"}
        # pinning the digest is the explicit, reviewed way to accept it
        world.api(
            "PATCH",
            "LoRAAdapter",
            "chat",
            {"spec": {"source": {"uri": old_uri, "manifestDigest": old_digest}}},
        )
        ready = world.wait_ready("chat", version="r3")
        assert ready["status"]["digest"] == old_digest
