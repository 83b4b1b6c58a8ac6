"""Canary rollouts against the real control plane and fake pods: a version that fails to warm on one pod is rolled
back before any traffic moves, and stays out until the spec changes. (The whole canary, traffic split and
analysis on real servers: e2e/test_3_canary.py.)"""

from __future__ import annotations

import time

from tests.operator.harness import OperatorThread, condition, wait_for

CANARY = {"strategy": "Canary", "steps": [{"weight": 10, "pause": "1s"}], "analysis": {"minRequests": 5}}


def test_a_canary_that_fails_to_warm_on_one_pod_is_rolled_back_everywhere(world, artifacts):
    world.create_base(replicas=2)
    with OperatorThread(world):
        a, b = world.add_pod(), world.add_pod()
        world.create_adapter("chat", artifacts.uris["v1"], "v1", rollout=CANARY)
        world.wait_ready(
            "chat", version="v1"
        )  # a first version has nothing to compare with: it serves at once
        assert "canary" not in world.adapter("chat")["status"]
        b.fail = "warm_fail:v2"
        world.api("PATCH", "LoRAAdapter", "chat",
                  {"spec": {"source": {"uri": artifacts.uris["v2"]}, "version": "v2"}})  # fmt: skip
        adapter = world.wait_adapter("chat", lambda a: condition(a, "Canary").get("status") == "False",
                                     what="the canary rolled back")  # fmt: skip
        assert condition(adapter, "Canary")["reason"] == "WarmFailed"
        assert condition(adapter, "Degraded")["status"] == "True"
        canary = adapter["status"]["canary"]
        assert (canary["version"], canary["step"], canary["weight"]) == ("v2", 0, 0)
        wait_for(
            lambda: a.versions("chat") == {"v1"} and b.versions("chat") == {"v1"},
            what="v2 unloaded everywhere",
        )
        assert a.serving("chat") == b.serving("chat") == "v1"
        assert a.count("PUT", "/admin/adapters/chat/split") == 0, "no traffic moved before every pod was warm"
        wait_for(lambda: world.events("CanaryRolledBack"), what="the Event")
        b.fail = None  # the pod would warm it now, but a rolled-back canary stays out until the spec changes
        loads = a.count("PUT", "/admin/adapters/chat") + b.count("PUT", "/admin/adapters/chat")
        wait_for(
            lambda: world.adapter("chat")["status"]["observedGeneration"] == adapter["metadata"]["generation"]
        )
        time.sleep(3)
        assert a.count("PUT", "/admin/adapters/chat") + b.count("PUT", "/admin/adapters/chat") == loads
        assert a.versions("chat") == {"v1"}
