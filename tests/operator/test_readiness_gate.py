"""A server pod takes traffic (Ready, a Service endpoint) only once it serves the adapters placed on it: the
pods' readiness gate, opened by the operator. Pure decisions first, then a new pod against the API server."""

from __future__ import annotations

import time

from loraplane.operator import readiness_gate as G
from loraplane.operator.admin_client import LoadedVersion, PodAddress
from loraplane.operator.pods import ADAPTERS_GATE, pod_info
from tests.operator.harness import OperatorThread, condition, wait_for


def _pod(name: str, conditions: dict[str, str], gated: bool = True) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"readinessGates": [{"conditionType": ADAPTERS_GATE}] if gated else []},
        "status": {"phase": "Running", "podIP": "127.0.0.9",
                   "conditions": [{"type": t, "status": s, "lastTransitionTime": "2026-01-01T00:00:00Z"}
                                  for t, s in conditions.items()]},
    }  # fmt: skip


def test_pod_info_reads_containers_ready_and_the_gate():
    waiting = pod_info(_pod("a", {"ContainersReady": "True", "Ready": "False"}))
    assert waiting.ready and not waiting.routable and waiting.gated and waiting.gate is None
    assert G.waiting([waiting]) == [waiting] and G.to_close([waiting]) == []
    opened = pod_info(_pod("b", {"ContainersReady": "True", "Ready": "True", ADAPTERS_GATE: "True"}))
    assert opened.routable and G.waiting([opened]) == []
    restarted = pod_info(_pod("c", {"ContainersReady": "False", "Ready": "False", ADAPTERS_GATE: "True"}))
    assert G.to_close([restarted]) == [restarted], "a restarted server starts empty: its gate closes"
    legacy = pod_info(_pod("d", {"Ready": "True"}, gated=False))  # no gate, no ContainersReady condition
    assert legacy.ready and legacy.routable and G.waiting([legacy]) == []


def test_the_gate_waits_for_served_adapters_placed_on_the_pod():
    pods = [PodAddress(f"p{i}", f"127.0.0.{i + 2}", 8001) for i in range(4)]
    adapters = [
        G.Adapter("everywhere", {}, served=True),
        G.Adapter("one-pod", {"replicas": 1}, served=True),
        G.Adapter("new", {}, served=False),  # served nowhere yet: holds no pod back
    ]
    placed = {p.name: G.placed_on(p.name, adapters, pods) for p in pods}
    assert all("everywhere" in names and "new" not in names for names in placed.values())
    assert sum("one-pod" in names for names in placed.values()) == 1
    loaded = [LoadedVersion("everywhere", "v2", "sha256:x", "warm", True),
              LoadedVersion("one-pod", "v1", "sha256:y", "warm", False)]  # fmt: skip
    assert G.missing(loaded, ["everywhere", "one-pod"]) == ["one-pod"], "loaded but not serving: no alias"
    failed = [LoadedVersion("everywhere", "v2", "sha256:x", "failed", True)]
    assert G.missing(failed, ["everywhere"]) == ["everywhere"]


def _pod_conditions(world, name: str) -> dict[str, str]:
    pod = world.plane.get("v1", "Pod", name, world.ns)
    return {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}


def test_a_new_pod_is_ready_only_once_it_serves_its_adapters(world, artifacts):
    world.create_base(replicas=2)
    with OperatorThread(world):
        first = world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1")
        world.wait_adapter("chat", lambda a: a["status"].get("readyPods") == 1, what="1 pod serving")
        first_name = next(n for n, p in world.pods.items() if p is first)
        wait_for(
            lambda: _pod_conditions(world, first_name).get("Ready") == "True", what="the first pod Ready"
        )
        world.new_pod_fail = "hold_warm"  # the next pod's loads answer 202 until cleared: no timing involved
        second = world.add_pod()
        name = next(n for n, p in world.pods.items() if p is second)
        wait_for(lambda: second.count("PUT"), what="the operator loading onto the new pod")
        time.sleep(1.0)  # several kubelet syncs and operator passes while the load is held
        held = _pod_conditions(world, name)
        assert held["ContainersReady"] == "True" and held["Ready"] == "False", held
        assert held.get(ADAPTERS_GATE) != "True"
        wait_for(lambda: (world.get("LoRABase", "demo").get("status") or {}).get("readyReplicas") == 1,
                 what="the base's status counting the first pod ready")  # fmt: skip
        time.sleep(1.0)  # more base passes (every poll interval while a pod is not ready)
        assert world.get("LoRABase", "demo")["status"]["readyReplicas"] == 1, (
            "a gated pod is not counted ready"
        )
        second.fail = None
        wait_for(lambda: second.serving("chat") == "v1", what="chat loaded on the new pod")
        opened = wait_for(lambda: (c := _pod_conditions(world, name)).get("Ready") == "True" and c,
                          what="the new pod Ready")  # fmt: skip
        assert opened[ADAPTERS_GATE] == "True"
        world.wait_ready("chat")
        wait_for(lambda: condition(world.get("LoRABase", "demo"), "Ready")["status"] == "True",
                 what="the base Ready: both pods take traffic")  # fmt: skip
