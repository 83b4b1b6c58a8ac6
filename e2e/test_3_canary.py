"""Canary rollouts end to end: `spec.rollout.strategy: Canary` on the real control plane, the operator's Pod, and two
server Pods on the tiny model. A canary whose numbers hold is promoted step by step (each step's traffic share
measured by the client, an operator restart in the middle); one that cannot meet its threshold is rolled back;
no request fails on either path."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time

import httpx
import pytest

from e2e.stack import ADMIN_TOKEN, POD_START, admin_list, condition, ensure_base, wait_for
from loraplane.http.canary import BUCKETS, ROUTE_KEY_HEADER, bucket
from loraplane.http.openai_api import VERSION_HEADER

NAME = "gamma"
SWEEP = [f"conversation-{i}" for i in range(240)]  # one step's measurement: every key once
STEPS = [{"weight": 20, "pause": "25s"}, {"weight": 50, "pause": "25s"}]


@pytest.fixture(scope="module")
def pods(stack):
    try:  # the base without API keys (an earlier scenario may have set some): the load here sends none
        ensure_base(stack)
        pods = wait_for(lambda: len(stack.ready_pods()) == 2 and not any("--api-keys-file" in " ".join(
            p["spec"]["containers"][0]["args"]) for p in stack.server_pods()) and stack.ready_pods(), POD_START,
            "two Pods without API keys")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nkubelet errors: {stack.kubelet.errors[-5:]}") from None
    stack.add_adapter("g-v1", NAME, "v1", seed=31)
    stack.add_adapter("g-v2", NAME, "v2", seed=32)
    stack.add_adapter("g-v3", NAME, "v3", seed=33)
    stack.apply(canary_manifest(stack, "g-v1", "v1", analysis={}))
    wait_for(lambda: stack.get("LoRAAdapter", NAME)["status"].get("servingVersion") == "v1"
             and condition(stack.get("LoRAAdapter", NAME), "Ready").get("status") == "True", 180,
             f"{NAME} v1 Ready\n{stack.logs()}")  # fmt: skip
    return pods


def canary_manifest(stack, label: str, version: str, analysis: dict, steps=None) -> dict:
    manifest = stack.adapter_manifest(NAME, label, version)
    manifest["spec"]["rollout"] = {"strategy": "Canary", "steps": steps or STEPS, "analysis": analysis}
    return manifest


class Load:
    """Requests naming the alias, from a background thread and from sweeps; every failure is kept."""

    def __init__(self, stack):
        self.urls = [f"http://{p['status']['podIP']}:8000/v1/completions" for p in running_pods(stack)]
        # Idle connections expire before the server's keep-alive (uvicorn: 5 s), so none is reused as it closes.
        self.client = httpx.Client(timeout=60, limits=httpx.Limits(keepalive_expiry=2.0))
        self.failures: list[str] = []
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._background, daemon=True)

    def ask(self, key: str, url: str) -> str | None:
        try:
            answer = self.client.post(url, headers={ROUTE_KEY_HEADER: key},
                                      json={"model": NAME, "prompt": "hi", "max_tokens": 1})  # fmt: skip
        except httpx.HTTPError as exc:
            self.failures.append(f"{key}: {exc!r}")
            return None
        self.count += 1
        if answer.status_code != 200:
            self.failures.append(f"{key}: {answer.status_code} {answer.text[:200]}")
            return None
        return answer.headers[VERSION_HEADER]

    def _background(self):
        for i in itertools.count():
            if self.stop.is_set():
                return
            self.ask(f"background-{i % 500}", self.urls[i % len(self.urls)])

    def sweep(self) -> dict[str, str | None]:
        """Every key of SWEEP once, spread over the Pods (a key's version must not depend on the Pod)."""
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = pool.map(
                lambda ik: self.ask(ik[1], self.urls[ik[0] % len(self.urls)]), enumerate(SWEEP)
            )
            return dict(zip(SWEEP, answers, strict=True))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=120)
        self.client.close()


def running_pods(stack) -> list[dict]:
    """The server Pods whose containers run, Ready or not: what each one serves is asked of it directly. A
    busy Pod on a loaded host can miss readiness probes for a while; the rollout on it goes on, and is
    checked, all the same."""
    return [
        p
        for p in stack.server_pods()
        if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]


def splits(stack) -> list[dict | None]:
    views = []
    for pod in running_pods(stack):
        answer = httpx.get(f"http://{pod['status']['podIP']}:8001/admin/adapters/{NAME}/split",
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)  # fmt: skip
        views.append(answer.json() if answer.status_code == 200 else None)
    return views


def versions_on_pods(stack) -> list[set[str]]:
    listed = [admin_list(pod)["adapters"] for pod in running_pods(stack)]
    return [{a["version"] for a in adapters if a["name"] == NAME} for adapters in listed]


def _table(stack, cells: list[str]) -> str | None:
    """`kubectl get loraadapter gamma` once its row's last columns before AGE are ``cells``."""
    table = stack.plane.kubectl("get", "loraadapter", NAME, "-n", stack.namespace).stdout
    row = table.splitlines()[1].split()
    return table if row[-1 - len(cells) : -1] == cells else None


class StatusWatch(threading.Thread):
    """Every status.canary the operator writes, polled (the steps must never go back)."""

    def __init__(self, stack):
        super().__init__(daemon=True)
        self.stack, self.seen, self.stop = stack, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                canary = self.stack.get("LoRAAdapter", NAME).get("status", {}).get("canary")
            except Exception:  # noqa: BLE001 - the API server is busy: the next poll
                canary = None
            if canary and (not self.seen or self.seen[-1] != canary):
                self.seen.append(canary)
            time.sleep(0.3)


def test_a_healthy_canary_is_promoted_step_by_step_through_an_operator_restart(stack, pods):
    watch = StatusWatch(stack)
    watch.start()
    analysis = {"minRequests": 20, "maxErrorRate": 0.05, "maxTTFTRatio": 20.0}
    with Load(stack) as load:
        stack.apply(canary_manifest(stack, "g-v2", "v2", analysis))
        for index, step in enumerate(STEPS, start=1):
            weight = step["weight"]
            wait_for(lambda w=weight: all(s and s["weight"] == w for s in splits(stack)), 240,
                     f"step {index} ({weight}%) on both Pods\n{stack.logs()}")  # fmt: skip
            started = [s["since"] for s in splits(stack)]
            if index == 1:  # `kubectl get` shows the step and the weight
                table = wait_for(lambda: _table(stack, ["1", "20"]), 30, "the canary columns")
                assert "CANARY-STEP" in table and "CANARY-WEIGHT" in table, table
            answers = load.sweep()
            after = splits(stack)
            assert [s and (s["weight"], s["since"]) for s in after] == [(weight, t) for t in started], (
                "the step ended during the sweep: the pause is too short for this machine"
            )
            assert None not in answers.values(), load.failures[:5]
            share = 100 * sum(v == "v2" for v in answers.values()) / len(answers)
            assert abs(share - weight) <= 5, f"step {index}: {share:.1f}% on v2, weight {weight}%"
            expected = {k: "v2" if bucket(NAME, f"h:{k}") < weight * BUCKETS // 100 else "v1" for k in SWEEP}
            assert answers == expected  # one conversation, one version, whichever Pod answers
            print(f"step {index}: weight {weight}%, {share:.1f}% of {len(answers)} requests on v2")
            if index == 1:  # the operator dies mid-canary; its successor resumes at the recorded step
                operator = next(p["metadata"]["name"] for p in stack.plane.list("v1", "Pod", stack.namespace)
                                if p["metadata"]["name"].startswith("lp-loraplane"))  # fmt: skip
                stack.kubelet.kill(operator)

        def promoted():
            a = stack.get("LoRAAdapter", NAME)
            return (condition(a, "Canary").get("status") == "True" and condition(a, "Ready").get("status") == "True"
                    and a["status"]["servingVersion"] == "v2" and a)  # fmt: skip

        adapter = wait_for(promoted, 240, f"{NAME} v2 promoted\n{stack.logs()}")
        wait_for(lambda: versions_on_pods(stack) == [{"v2"}, {"v2"}], 120, "v1 unloaded after the promotion")
        time.sleep(1)
    watch.stop.set()
    assert not load.failures, load.failures[:5]
    assert load.count >= 2 * len(SWEEP)
    assert splits(stack) == [None, None]
    assert condition(adapter, "Canary")["reason"] == "CanaryPromoted"
    canary = adapter["status"]["canary"]
    assert (canary["step"], canary["weight"], canary["analysis"]["verdict"]) == (2, 100, "Promote")
    steps = [c["step"] for c in watch.seen if c.get("version") == "v2"]
    assert steps == sorted(steps) and 1 in steps and 2 in steps, watch.seen
    reasons = [e.get("reason") for e in stack.plane.list("v1", "Event", stack.namespace)
               if e["involvedObject"].get("name") == NAME]  # fmt: skip
    assert reasons.count("StepPassed") >= 2 and "CanaryPromoted" in reasons, reasons


def test_a_canary_that_cannot_meet_its_threshold_is_rolled_back(stack, pods):
    # A p95 time to first token at most 1% of the serving version's: no real version can meet it.
    analysis = {"minRequests": 20, "maxErrorRate": 0.05, "maxTTFTRatio": 0.01}
    with Load(stack) as load:
        stack.apply(canary_manifest(stack, "g-v3", "v3", analysis, steps=[{"weight": 50, "pause": "2s"}]))

        def rolled_back():
            a = stack.get("LoRAAdapter", NAME)
            return condition(a, "Canary").get("status") == "False" and a

        adapter = wait_for(rolled_back, 240, f"{NAME} v3 rolled back\n{stack.logs()}")
        wait_for(lambda: versions_on_pods(stack) == [{"v2"}, {"v2"}], 120, "v3 unloaded everywhere")
        after = [load.ask(f"after-{i}", load.urls[i % 2]) for i in range(20)]
    assert not load.failures, load.failures[:5]
    assert set(after) == {"v2"} and splits(stack) == [None, None]
    assert condition(adapter, "Canary")["reason"] == "TTFTRatioTooHigh"
    assert condition(adapter, "Degraded")["status"] == "True"
    numbers = adapter["status"]["canary"]
    assert numbers["weight"] == 0 and numbers["analysis"]["verdict"] == "RollBack"
    assert numbers["analysis"]["ttftRatio"] > 0.01 and numbers["analysis"]["canaryRequests"] >= 20
    assert adapter["status"]["servingVersion"] == "v2"
    time.sleep(8)  # passes go on: the rolled-back version is not tried again
    assert versions_on_pods(stack) == [{"v2"}, {"v2"}]
    reasons = [e.get("reason") for e in stack.plane.list("v1", "Event", stack.namespace)
               if e["involvedObject"].get("name") == NAME]  # fmt: skip
    assert "CanaryRolledBack" in reasons
