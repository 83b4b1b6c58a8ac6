"""kube.py against the real API server: idempotent apply, 409 re-read and re-apply, status, secrets by name.

Conflicts come from a fault proxy in front of the real server (tests/controlplane/faults.py): a real server
answers 409 only to a racing writer, which a test cannot time.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import REGISTRY

from loraplane.operator import builders as B
from loraplane.operator.crd_models import BaseSpec
from loraplane.operator.event_lane import EVENT_SOURCE, EVENT_THREADS, EVENT_TIMEOUT
from loraplane.operator.kube import API_THREADS, Kube, Ref, base_ref, is_subset
from tests.controlplane.faults import FaultProxy


def _base(plane, namespace: str) -> dict:
    """A real LoRABase, so the objects built from it have an owner the garbage collector knows."""
    return plane.create({
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "LoRABase",
        "metadata": {"name": "demo", "namespace": namespace},
        "spec": {"model": {"uri": "s3://m/", "sha256": "ab" * 32}, "replicas": 0},
    })  # fmt: skip


def test_apply_is_idempotent_and_retries_conflicts(control_plane, namespace):
    base = _base(control_plane, namespace)
    with FaultProxy(control_plane) as proxy:
        kube = Kube(proxy.api_client())
        desired = B.build_deployment(base, BaseSpec.parse(base["spec"]))
        assert asyncio.run(kube.apply(desired)) == "created"
        assert asyncio.run(kube.apply(desired)) == "unchanged", "server defaults are not a change"
        writes = proxy.count("PUT", "/deployments/demo")
        changed = B.build_deployment(base, BaseSpec.parse({**base["spec"], "replicas": 3}))
        proxy.fail("PUT", rf".*/namespaces/{namespace}/deployments/demo", 409, times=2)
        assert asyncio.run(kube.apply(changed)) == "updated"
        assert proxy.count("PUT", "/deployments/demo") == writes + 3  # two 409s, then the write
    assert control_plane.get("apps/v1", "Deployment", "demo", namespace)["spec"]["replicas"] == 3


def test_admin_token_is_created_once_and_read_by_name(control_plane, namespace):
    base = _base(control_plane, namespace)
    with FaultProxy(control_plane) as proxy:
        kube = Kube(proxy.api_client())
        assert asyncio.run(kube.create_if_absent(B.build_admin_token_secret(base, token="one")))
        assert not asyncio.run(kube.create_if_absent(B.build_admin_token_secret(base, token="two")))
        assert asyncio.run(kube.secret_data(namespace, "demo-admin-token")) == {"token": "one"}
        assert asyncio.run(kube.secret_data(namespace, "missing")) is None
        assert not [r for r in proxy.requests if r[0] == "GET" and r[1].endswith("/secrets")], "never listed"


def test_concurrent_secret_reads_make_one_get_and_a_rotation_is_seen(control_plane, namespace):
    """Hundreds of passes asking for one Secret while the API server is slow make one GET; a rotated Secret
    is seen once its entry expires, or at once when a pod's refusal says it changed."""
    control_plane.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3", "namespace": namespace},
                          "stringData": {"key": "one"}})  # fmt: skip
    path = rf"/api/v1/namespaces/{namespace}/secrets/s3"
    with FaultProxy(control_plane) as proxy:
        kube = Kube(proxy.api_client())

        async def many(ttl: float) -> list:
            return await asyncio.gather(*(kube.secret_data(namespace, "s3", ttl) for _ in range(300)))

        proxy.delay("GET", path, 0.5)  # every ask arrives while the first GET is held
        assert asyncio.run(many(30.0)) == [{"key": "one"}] * 300
        assert proxy.count("GET", "/secrets/s3") == 1
        assert asyncio.run(many(30.0)) == [{"key": "one"}] * 300 and proxy.count("GET", "/secrets/s3") == 1
        control_plane.request("PATCH", path, {"stringData": {"key": "two"}},
                              content_type="application/merge-patch+json")  # fmt: skip
        assert asyncio.run(kube.secret_data(namespace, "s3")) == {"key": "one"}, "within its ttl"
        proxy.delay("GET", path, 0.5)
        assert asyncio.run(many(0.0)) == [{"key": "two"}] * 300, "expired: read again"
        assert proxy.count("GET", "/secrets/s3") == 2
        control_plane.request("PATCH", path, {"stringData": {"key": "three"}},
                              content_type="application/merge-patch+json")  # fmt: skip
        kube.forget_secret(namespace, "s3")
        assert asyncio.run(kube.secret_data(namespace, "s3")) == {"key": "three"}, "forgotten: read again"


def test_events_go_through_the_pooled_client_with_kopfs_fields(control_plane, namespace):
    """A burst of Events (every adapter's status write when a pod is replaced) reuses the client's kept-alive
    connections instead of opening one each; each Event carries the fields `kubectl describe` shows."""
    base = _base(control_plane, namespace)
    with FaultProxy(control_plane) as proxy:
        kube = Kube(proxy.api_client(pool_size=API_THREADS))  # as load_api_client sizes it

        async def burst() -> list[bool]:
            return await asyncio.gather(
                *(kube.event(base, "Normal", "Loaded", f"event {i}") for i in range(80))
            )

        assert asyncio.run(burst()) == [True] * 80
        assert asyncio.run(burst()) == [True] * 80
        assert proxy.count("POST", "/events") == 160
        assert proxy.connections <= API_THREADS, f"{proxy.connections} connections for 160 Events"
        assert proxy.connections <= EVENT_THREADS, "Events use their own lane's threads"
    events = [e for e in control_plane.list("v1", "Event", namespace) if e.get("reason") == "Loaded"]
    assert len(events) == 160
    event = events[0]
    involved = event["involvedObject"]
    assert (involved["kind"], involved["name"], involved["uid"]) == (
        "LoRABase",
        "demo",
        base["metadata"]["uid"],
    )
    assert involved["apiVersion"] == "loraplane.dev/v1alpha1" and involved["namespace"] == namespace
    assert (event["type"], event["source"]["component"], event["count"]) == ("Normal", EVENT_SOURCE, 1)
    assert event["firstTimestamp"] and event["lastTimestamp"] and event["message"].startswith("event ")


def test_an_event_that_cannot_be_posted_is_logged_not_raised(control_plane, namespace, caplog):
    base = _base(control_plane, namespace)
    with FaultProxy(control_plane) as proxy:
        kube = Kube(proxy.api_client())
        proxy.fail("POST", rf"/api/v1/namespaces/{namespace}/events", 500)
        assert asyncio.run(kube.event(base, "Warning", "WarmFailed", "x" * 5000)) is False
        assert "could not post the Event Warning WarmFailed" in caplog.text

        async def in_background() -> None:
            kube.post_event(base, "Warning", "WarmFailed", "x" * 5000)  # a pass does not wait for it
            await kube.events.flush()

        asyncio.run(in_background())
    posted = [e for e in control_plane.list("v1", "Event", namespace) if e.get("reason") == "WarmFailed"]
    assert len(posted) == 1 and len(posted[0]["message"]) == 1024, "the message is cut to Kubernetes' bound"


def test_a_burst_of_api_calls_holds_at_most_api_threads_connections(control_plane, namespace):
    """Every adapter's status write at once (a replaced pod): the calls share the Kube's few threads, each on
    its own kept-alive connection, so a burst after the API server closed them makes few TLS handshakes."""
    _base(control_plane, namespace)
    with FaultProxy(control_plane) as proxy:
        kube = Kube(proxy.api_client(pool_size=API_THREADS + EVENT_THREADS))  # as load_api_client sizes it

        async def burst() -> list:
            return await asyncio.gather(*(kube.get(base_ref(namespace, "demo")) for _ in range(60)))

        assert all(found is not None for found in asyncio.run(burst()))
        assert proxy.count("GET", "/lorabases/demo") == 60
        assert proxy.connections <= API_THREADS, f"{proxy.connections} connections for 60 calls at once"


def test_a_stalled_event_lane_never_holds_up_a_status_patch(control_plane, namespace):
    """Hundreds of Events posted at once to an API server that stalls them: a status patch still goes through
    at once (the Events have threads of their own), and a stalled Event is given up after its short timeout."""
    base = _base(control_plane, namespace)
    events = rf"/api/v1/namespaces/{namespace}/events"
    with FaultProxy(control_plane) as proxy:
        kube = Kube(proxy.api_client(pool_size=API_THREADS + EVENT_THREADS))
        proxy.delay("POST", events, EVENT_TIMEOUT + 3, times=None, code=503)  # every Event post hangs

        async def burst_then_patch() -> float:
            for i in range(300):  # as when a replaced pod makes every adapter write its status
                kube.post_event(base, "Normal", "Loaded", f"event {i}")
            await asyncio.sleep(0.5)  # the Event lane is busy with stalled posts
            start = time.monotonic()
            assert await kube.patch_status(base_ref(namespace, "demo"), {"observedGeneration": 7}) is not None
            return time.monotonic() - start

        assert asyncio.run(burst_then_patch()) < 2.0, "a status patch waited behind Events"
        assert proxy.count("PATCH", "/demo/status") == 1
        fresh = Kube(proxy.api_client())

        async def one_stalled() -> tuple[bool, float]:
            start = time.monotonic()
            return await fresh.event(base, "Normal", "Loaded", "stalled"), time.monotonic() - start

        posted, took = asyncio.run(one_stalled())
        assert not posted and EVENT_TIMEOUT - 0.5 <= took < EVENT_TIMEOUT + 2.5, f"gave up after {took:.1f} s"


def test_the_event_backlog_drops_the_oldest_and_merges_duplicates(control_plane, namespace, caplog):
    """A backlog of 5: of 20 Events posted before any could go, the 5 newest wait and 15 are dropped (counted);
    an Event identical to one waiting bumps its count instead of queueing again."""
    base = _base(control_plane, namespace)
    dropped = REGISTRY.get_sample_value("loraplane_operator_events_dropped_total") or 0.0
    kube = Kube(control_plane.api_client(), event_backlog=5)

    async def post_all() -> None:
        for i in range(20):
            kube.post_event(base, "Normal", "Loaded", f"event {i}")
        assert kube.events.waiting() == 5
        for _ in range(3):  # the first drops "event 15"; the other two are the same Event again
            kube.post_event(base, "Warning", "WarmFailed", "again")
        assert kube.events.waiting() == 5
        await kube.events.flush()

    with caplog.at_level(logging.INFO, logger="loraplane.operator.event_lane"):
        asyncio.run(post_all())
    assert kube.events.dropped == 16
    assert REGISTRY.get_sample_value("loraplane_operator_events_dropped_total") == dropped + 16
    assert caplog.text.count("the Event backlog is full") == 1, "logged once in a while, not per Event"
    posted = {e["message"]: e for e in control_plane.list("v1", "Event", namespace)
              if e.get("reason") in ("Loaded", "WarmFailed")}  # fmt: skip
    assert sorted(posted) == ["again", "event 16", "event 17", "event 18", "event 19"]
    assert posted["again"]["count"] == 3 and posted["event 19"]["count"] == 1


def test_status_patch_of_a_missing_object_is_none(control_plane, namespace):
    kube = Kube(control_plane.api_client())
    assert asyncio.run(kube.patch_status(Ref("/api/v1", "pods", namespace, "nope"), {"phase": "x"})) is None


def test_is_subset_ignores_server_defaults():
    want = {"spec": {"containers": [{"name": "a", "image": "i"}]}}
    have = {"spec": {"containers": [{"name": "a", "image": "i", "imagePullPolicy": "IfNotPresent"}], "x": 1}}
    assert is_subset(want, have)
    assert not is_subset({"spec": {"containers": [{"name": "a"}, {"name": "b"}]}}, have)
