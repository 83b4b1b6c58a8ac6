"""LoRABase end to end: owned objects applied once, spec changes roll pods, deletion cascades."""

from __future__ import annotations

from loraplane.operator import builders as B
from loraplane.operator import metrics
from tests.operator.harness import API, OperatorThread, condition, wait_for


def _gone(world, api_version: str, kind: str, name: str) -> bool:
    """True once the API answers 404; any other error is a failure, not "gone"."""
    try:
        world.plane.get(api_version, kind, name, world.ns)
        return False
    except LookupError:  # 404 only: ControlPlane.get raises RuntimeError for anything else
        return True


def test_objects_token_rollout_and_cascade(world):
    manifest = world.base_manifest("pool", replicas=1)
    del manifest["spec"]["adminTokenSecretRef"]  # the operator generates one
    world.plane.create(manifest)
    reconciled = metrics.RECONCILES.labels("LoRABase", "ok")._value.get()  # process-wide: take the difference
    with OperatorThread(world):
        deployment = wait_for(lambda: world.get("Deployment", "pool"), what="Deployment")
        token = wait_for(lambda: world.plane.get("v1", "Secret", "pool-admin-token", world.ns))
        assert token["metadata"]["ownerReferences"][0]["name"] == "pool"
        for name in ("pool", "pool-admin"):
            service = wait_for(
                lambda n=name: world.plane.get("v1", "Service", n, world.ns), what=f"Service {name}"
            )
            assert service["metadata"]["ownerReferences"][0]["kind"] == "LoRABase"
        base = wait_for(
            lambda: (b := world.get("LoRABase", "pool")).get("status", {}).get("adminTokenSecret") and b
        )
        assert base["status"]["adminTokenSecret"] == "pool-admin-token"
        assert base["status"]["selector"] == B.selector_string("pool")
        assert condition(base, "Ready")["status"] == "False"  # no pod yet
        first_hash = deployment["spec"]["template"]["metadata"]["annotations"][B.TEMPLATE_HASH]
        rv = deployment["metadata"]["resourceVersion"]
        world.api("PATCH", "LoRABase", "pool", {"spec": {"engine": {"maxRank": 8}}})
        rolled = wait_for(
            lambda: (d := world.get("Deployment", "pool"))["spec"]["template"]["metadata"]["annotations"][
                B.TEMPLATE_HASH] != first_hash and d, what="a new pod template")  # fmt: skip
        assert "--max-rank=8" in rolled["spec"]["template"]["spec"]["containers"][0]["args"]
        assert rolled["metadata"]["resourceVersion"] != rv
        again = world.plane.get("v1", "Secret", "pool-admin-token", world.ns)
        assert again["data"] == token["data"], "the admin token is never rewritten"
        assert metrics.RECONCILES.labels("LoRABase", "ok")._value.get() > reconciled
        world.api("DELETE", "LoRABase", "pool")
        wait_for(lambda: _gone(world, API, "LoRABase", "pool"), what="LoRABase released")
        wait_for(lambda: _gone(world, "apps/v1", "Deployment", "pool") and _gone(world, "v1", "Secret", "pool-admin-token"),
                 what="owned objects garbage-collected")  # fmt: skip
