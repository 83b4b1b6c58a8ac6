"""What the runner watches while the soak runs, each on a bounded loop of its own:

- ``Monitor`` (every second): is the system converged? The operator's Pod Ready; every server Pod Ready; each
  Pod's own `GET /admin/adapters` serving the ledger's current version of every adapter; each LoRAAdapter Ready
  on it, with observedGeneration current and `status.pods` naming exactly the ready Pods. It also marks
  versions Ready in the ledger (which bounds when the previous version may still answer) and records when the
  canary's status write arrives.
- ``Sampler`` (every few seconds): RSS, threads, open fds and CPU of every Pod's process, from /proc.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from e2e.soak.world import BASE, CANARY, is_ready, operator_pods, proc_sample, running_processes
from e2e.stack import admin_list, condition

API = "loraplane.dev/v1alpha1"


@dataclass
class Snapshot:
    t: float
    converged: bool
    operator: str | None  # the ready operator Pod's name
    servers: list[str]
    lagging: list[str]


def pods_truth(pods: list[dict]) -> dict[str, dict[str, str]]:
    """Pod name -> {adapter: version it serves}, from each Pod's admin API."""
    truth = {}
    for pod in pods:
        listed = admin_list(pod)["adapters"]
        truth[pod["metadata"]["name"]] = {a["name"]: a["version"] for a in listed if a.get("serving")}
    return truth


def lagging_adapters(
    items: list[dict], expected: dict[str, str], truth: dict[str, dict[str, str]]
) -> list[str]:
    """What keeps each adapter from having converged; empty when all have."""
    ready = set(truth)
    lagging = []
    by_name = {i["metadata"]["name"]: i for i in items}
    for name, version in expected.items():
        item = by_name.get(name)
        if item is None:
            lagging.append(f"{name}: missing")
            continue
        status = item.get("status") or {}
        on_pods = [p for p, served in truth.items() if served.get(name) != version]
        if on_pods:
            lagging.append(f"{name}: pods {on_pods} do not serve {version}")
        elif condition(item, "Ready").get("status") != "True" or status.get("servingVersion") != version:
            lagging.append(
                f"{name}: status {condition(item, 'Ready').get('reason')} {status.get('servingVersion')}"
            )
        elif status.get("observedGeneration") != item["metadata"]["generation"]:
            lagging.append(f"{name}: observedGeneration {status.get('observedGeneration')}")
        elif {p["name"] for p in status.get("pods") or ()} != ready:
            lagging.append(f"{name}: status.pods {[p['name'] for p in status.get('pods') or ()]}")
    return lagging


class Monitor:
    def __init__(self, stack, ledger, origin: float, replicas: int, interval: float = 1.0):
        self.stack, self.ledger, self.origin = stack, ledger, origin
        self.replicas, self.interval = replicas, interval
        self.snapshots: list[Snapshot] = []
        self.errors: list[str] = []
        self.canary_writes: dict[int, float] = {}  # generation -> when its observedGeneration was first seen
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="soak-monitor", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.origin

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.snapshots.append(self.poll())
            except Exception as exc:  # noqa: BLE001 - a poll that failed is "not converged", kept for the report
                self.errors.append(f"{self.now():.1f}: {type(exc).__name__}: {exc}"[:300])
                self.snapshots.append(Snapshot(self.now(), False, None, [], [f"poll failed: {exc}"[:200]]))
            self.stop.wait(self.interval)

    def poll(self) -> Snapshot:
        t = self.now()
        operators = [p["metadata"]["name"] for p in operator_pods(self.stack) if is_ready(p)]
        servers = [p for p in self.stack.server_pods(BASE) if is_ready(p)]
        items = self.stack.plane.list(API, "LoRAAdapter", self.stack.namespace)
        self._canary(items, t)
        truth = pods_truth(servers)
        expected = {name: self.ledger.current(name) for name in self.ledger.applied}
        lagging = lagging_adapters(items, expected, truth)
        for name, version in expected.items():
            if not any(line.startswith(f"{name}:") for line in lagging) and len(servers) == self.replicas:
                self.ledger.mark_ready(name, version, time.monotonic())
        converged = bool(operators) and len(servers) == self.replicas and not lagging
        names = sorted(p["metadata"]["name"] for p in servers)
        return Snapshot(t, converged, operators[0] if operators else None, names, lagging[:5])

    def _canary(self, items: list[dict], t: float) -> None:
        canary = next((i for i in items if i["metadata"]["name"] == CANARY), None)
        observed = ((canary or {}).get("status") or {}).get("observedGeneration")
        if isinstance(observed, int):
            self.canary_writes.setdefault(observed, t)

    def wait_converged(self, after: float, deadline: float) -> float | None:
        """The monotonic time of the first converged poll that began after monotonic ``after``; None when there
        is none by monotonic ``deadline``."""
        begin = after - self.origin
        while True:
            first = next((s for s in list(self.snapshots) if s.t > begin and s.converged), None)
            if first is not None:
                return first.t + self.origin
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)


@dataclass
class Sampler:
    stack: object
    origin: float
    interval: float = 5.0
    samples: list[dict] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            t = round(time.monotonic() - self.origin, 2)
            for pod, pid in running_processes(self.stack).items():
                sample = proc_sample(pid)
                if sample is not None:
                    kind = "server" if pod.startswith(f"{BASE}-") else "operator"
                    self.samples.append({"t": t, "pod": pod, "kind": kind, **sample})
            self.stop.wait(self.interval)
