"""The operator end to end: real kopf and kubernetes client, the real API server, moto S3, fake pods."""

from __future__ import annotations

from tests.operator.harness import OperatorThread, condition, wait_for


def test_happy_path_to_ready_with_per_pod_status(world, artifacts):
    world.create_base(replicas=2)
    with OperatorThread(world):
        a, b = world.add_pod(), world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        adapter = world.wait_ready("chat", version="v1")
        status = adapter["status"]
        assert status["digest"] == artifacts.digests["v1"]
        assert status["readyPods"] == status["desiredPods"] == 2
        assert status["rank"] == 4
        assert sorted(p["state"] for p in status["pods"]) == ["Serving", "Serving"]
        for type_ in ("Validated", "Cached", "Warmed", "Ready"):
            assert condition(adapter, type_)["status"] == "True", type_
        assert condition(adapter, "Degraded")["status"] == "False"
        assert a.serving("chat") == b.serving("chat") == "v1"
        base = wait_for(
            lambda: (
                (b_ := world.get("LoRABase", "demo"))
                and condition(b_, "Ready").get("status") == "True"
                and b_
            )
        )
        assert base["status"]["readyReplicas"] == 2
        assert base["status"]["observedBaseHash"] == world.base_hash


def events(world, reason: str | None = None) -> list[dict]:
    return world.events(reason)


def test_every_reason(world, artifacts):
    world.create_base(replicas=1)
    world.create_base("offline", replicas=1, endpoint="http://127.0.0.1:9")  # nothing listens on 9
    cases = {
        "bad-signature": ("bad_signature", "BadSignature", {}),
        "nested-signature": ("nested_signature", "BadSignature", {}),
        "unsigned": ("unsigned", "Unsigned", {}),
        "unknown-key": ("unknown_key", "UnknownKey", {}),
        "base-mismatch": ("base_mismatch", "BaseMismatch", {}),
        "rank-too-high": ("rank_too_high", "RankTooHigh", {}),
        "digest-mismatch": ("v1", "DigestMismatch", {"manifestDigest": "sha256:" + "0" * 64}),
    }
    with OperatorThread(world):
        world.add_pod()
        for name, (label, _, pin) in cases.items():
            world.create_adapter(
                name, artifacts.uris[label], "v1", source={"uri": artifacts.uris[label], **pin}
            )
        world.create_adapter("unreachable", artifacts.uris["v1"], "v1", base="offline")
        world.create_adapter("orphan", artifacts.uris["v1"], "v1", base="missing")
        for name, (_, reason, _) in cases.items():
            adapter = world.wait_reason(name, reason)
            assert condition(adapter, "Validated") == {**condition(adapter, "Validated"), "status": "False",
                                                       "reason": reason}  # fmt: skip
            assert condition(adapter, "Ready")["status"] == "False"
        adapter = world.wait_reason("unreachable", "SourceUnreachable")
        assert condition(adapter, "Validated")["status"] == "Unknown"  # transient: retried with backoff
        world.wait_reason("orphan", "BaseNotFound")
        assert not any(p.count("PUT") for p in world.pods.values()), "nothing unverified reaches a pod"
        wait_for(lambda: events(world, "BadSignature") and events(world, "BaseNotFound"), what="Events")


def test_pod_added_removed_and_scaled(world, artifacts):
    world.create_base(replicas=2)
    with OperatorThread(world):
        first = world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        world.wait_adapter("chat", lambda a: a["status"].get("readyPods") == 1, what="1 pod serving")
        assert condition(world.adapter("chat"), "Ready")["status"] == "False"
        second = world.add_pod()
        world.wait_ready("chat")
        assert second.serving("chat") == "v1" and first.serving("chat") == "v1"
        world.remove_pod(next(n for n, p in world.pods.items() if p is second))
        world.wait_adapter("chat", lambda a: condition(a, "Ready")["status"] == "False", what="not ready")
        world.plane.kubectl(
            "scale", "lorabase", "demo", "--replicas=1", "-n", world.ns
        )  # the scale subresource
        world.wait_ready("chat")
        deployment = wait_for(lambda: (d := world.get("Deployment", "demo"))["spec"]["replicas"] == 1 and d)
        assert deployment["metadata"]["ownerReferences"][0]["kind"] == "LoRABase"


def test_restarted_pod_gets_adapters_back_without_touching_the_cr(world, artifacts):
    world.create_base(replicas=1)
    with OperatorThread(world):
        pod = world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        before = world.wait_ready("chat")
        pod.restart()  # the container restarted: its adapters are gone, the CR did not change
        wait_for(lambda: pod.serving("chat") == "v1", what="adapter restored by the drift check")
        assert world.adapter("chat")["metadata"]["generation"] == before["metadata"]["generation"]


def test_new_version_with_a_failing_pod_rolls_back(world, artifacts):
    world.create_base(replicas=3)
    with OperatorThread(world):
        pods = [world.add_pod() for _ in range(3)]
        world.create_adapter("chat", artifacts.uris["v1"], "v1", rollout={"maxUnavailable": 2})
        world.wait_ready("chat", version="v1")
        pods[2].fail = "warm_fail:v2"
        world.api(
            "PATCH",
            "LoRAAdapter",
            "chat",
            {"spec": {"source": {"uri": artifacts.uris["v2"]}, "version": "v2"}},
        )
        adapter = world.wait_reason("chat", "WarmFailed")
        assert adapter["status"]["servingVersion"] == "v1"
        wait_for(lambda: all(p.versions("chat") == {"v1"} for p in pods), what="v2 unloaded everywhere")
        assert all(p.serving("chat") == "v1" for p in pods), "the old version serves everywhere"
        wait_for(lambda: events(world, "WarmFailed") and events(world, "RolledBack"), what="Events")
        pods[2].fail = None
        world.wait_ready("chat", version="v2", timeout=40)
        wait_for(lambda: all(p.versions("chat") == {"v2"} for p in pods), what="v1 unloaded after the switch")


def test_operator_restart_mid_rollout(world, artifacts):
    world.create_base(replicas=2)
    with OperatorThread(world):
        a, b = world.add_pod(), world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        world.wait_ready("chat", version="v1")
        b.fail = "hold_warm"  # b stays loading until the new operator runs, however slow the machine
        world.api(
            "PATCH",
            "LoRAAdapter",
            "chat",
            {"spec": {"source": {"uri": artifacts.uris["v2"]}, "version": "v2"}},
        )
        wait_for(lambda: "v2" in a.versions("chat") | b.versions("chat"), what="v2 loading")
    assert a.serving("chat") == b.serving("chat") == "v1", "no switch before every pod is warm"
    with OperatorThread(world):  # a new process: state from the API and the pods only
        b.fail = None
        world.wait_ready("chat", version="v2", timeout=60)
        wait_for(lambda: a.versions("chat") == b.versions("chat") == {"v2"})


def test_deletion_holds_until_every_pod_unloads(world, artifacts):
    world.create_base(replicas=2)
    with OperatorThread(world):
        a, b = world.add_pod(), world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        world.wait_ready("chat")
        b.stop()
        world.api("DELETE", "LoRAAdapter", "chat")
        held = world.wait_reason("chat", "UnloadFailed", timeout=30)
        assert held["metadata"].get("deletionTimestamp")
        assert "loraplane.dev/finalizer" in held["metadata"]["finalizers"]
        assert any(p["state"] == "Unreachable" for p in held["status"]["pods"])
        wait_for(lambda: events(world, "UnloadFailed"), what="an UnloadFailed Event")
        b.start()
        wait_for(lambda: not _exists(world, "chat"), timeout=30, what="finalizer released")
        assert a.versions("chat") == b.versions("chat") == set()


def _exists(world, name: str) -> bool:
    try:
        world.adapter(name)
        return True
    except LookupError:  # 404 only: ControlPlane.get raises RuntimeError for anything else
        return False


def test_conflict_storm(world, artifacts):
    import threading

    world.create_base(replicas=2)
    stop = threading.Event()
    written = []  # the storm's successful writes, in order

    def storm():
        n = 0
        while not stop.is_set():
            n += 1
            try:
                world.api("PATCH", "LoRAAdapter", "chat", {"metadata": {"annotations": {"storm": str(n)}}})
                written.append(str(n))
            except Exception:  # noqa: BLE001 - before creation
                pass

    with OperatorThread(world):
        world.add_pod(), world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        writer = threading.Thread(target=storm, daemon=True)
        writer.start()
        try:
            world.wait_ready("chat", timeout=40)
        finally:
            stop.set()
            writer.join()
        wait_for(lambda: "loraplane.dev/finalizer" in world.adapter("chat")["metadata"].get("finalizers", ()),
                 what="kopf's finalizer, once the storm has passed")  # fmt: skip
        # the operator's writes (status, kopf's finalizer) never overwrote the storm's: its last write stands
        assert written and world.wait_ready("chat")["metadata"]["annotations"]["storm"] == written[-1]


def test_pod_side_failures_are_reported_per_pod(world, artifacts):
    world.create_base(replicas=2)
    with OperatorThread(world):
        good, bad = world.add_pod(), world.add_pod()
        bad.fail = "hang"
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        adapter = world.wait_reason("chat", "PodUnreachable")
        rows = {row["state"] for row in adapter["status"]["pods"]}
        assert rows == {"Serving", "Unreachable"} and good.serving("chat") == "v1"
        bad.fail = "wrong_base"
        world.wait_reason("chat", "BaseMismatch")
        bad.base_hash = "00" * 32  # the pod loaded other weights: the base says so
        base = wait_for(lambda: (b := world.get("LoRABase", "demo")) and condition(b, "Degraded").get("reason")
                        == "PodBaseMismatch" and b, what="PodBaseMismatch")  # fmt: skip
        assert base["status"].get("observedBaseHash") is None  # the pods disagree
        bad.fail, bad.base_hash = None, world.base_hash
        world.wait_ready("chat")


def test_a_version_that_fails_validation_leaves_the_old_one_serving_even_on_restarted_pods(world, artifacts):
    world.create_base(replicas=1)
    with OperatorThread(world):
        pod = world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        assert world.wait_ready("chat", version="v1")["status"]["servingSource"] == artifacts.uris["v1"]
        bad = artifacts.uris["bad_signature"]
        world.api("PATCH", "LoRAAdapter", "chat", {"spec": {"source": {"uri": bad}, "version": "v2"}})
        adapter = world.wait_reason("chat", "BadSignature")
        assert adapter["status"]["servingVersion"] == "v1" and pod.serving("chat") == "v1"
        pod.restart()
        wait_for(lambda: pod.serving("chat") == "v1", what="the old version restored while v2 is refused")
        assert pod.versions("chat") == {"v1"}, "nothing unverified reaches a pod"
