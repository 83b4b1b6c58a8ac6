"""The soak's plan and its two actors.

- ``Roller`` (one thread): a new signed version of one adapter every ``bump_every_s`` (round robin: a merge
  patch of its spec, as `kubectl apply` sends), rolled out by the operator; and the liveness canary, a trivial spec change (`spec.rollout.maxUnavailable` 1 <-> 2) every
  ``canary_every_s``, whose status write the monitor waits for.
- ``Faults`` (one thread): a server Pod killed every ``kill_every_s`` (the youngest ready one, through the
  kubelet stand-in: its process stopped, the Pod evicted, the ReplicaSet replaces it), and the operator's Pod
  killed ``operator_restarts`` times, half-way between two Pod kills in the first part of the run, so that the
  last operator lives through most of it. After each fault the system must converge within its bound
  (measured by the monitor); a fault waits until the previous one converged (at most its bound), so each is
  measured alone.

Keeping the oldest server Pod alive is deliberate: one server and the last operator then live through most of
the run, long enough for a trend in their RSS, threads and fds to show.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from e2e.soak.world import BASE, CANARY, is_ready, operator_pods, publish

API = "loraplane.dev/v1alpha1"
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Plan:
    minutes: float = 60.0
    adapters: int = 20
    replicas: int = 2
    clients: int = 4
    bump_every_s: float = 60.0
    kill_every_s: float = 300.0
    operator_restarts: int = 2
    canary_every_s: float = 180.0
    warmup_s: float = 60.0  # load before the first fault; RSS trends are judged after it
    sample_every_s: float = 5.0
    kill_bound_s: float = 240.0  # a killed server Pod: replaced, Ready, every adapter back on it
    operator_bound_s: float = 180.0  # a killed operator: back, its status writes resumed, all converged
    canary_bound_s: float = 60.0  # a canary change gets its status write (from the operator being up)
    final_bound_s: float = 240.0

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    def kill_times(self) -> list[float]:
        times = (k * self.kill_every_s for k in itertools.count(1))
        return list(itertools.takewhile(lambda t: t < self.duration_s - 30, times))

    def restart_times(self) -> list[float]:
        halves = ((k + 0.5) * self.kill_every_s for k in range(1000))
        return [t for t in halves if t >= self.warmup_s][: self.operator_restarts]

    def bump_times(self) -> list[float]:
        times = (self.warmup_s + k * self.bump_every_s for k in range(100000))
        return list(itertools.takewhile(lambda t: t < self.duration_s - 15, times))

    def canary_times(self) -> list[float]:
        times = (self.canary_every_s * (k + 0.5) for k in range(100000))
        return list(itertools.takewhile(lambda t: t < self.duration_s, times))


def sleep_until(stop: threading.Event, at: float) -> bool:
    """Wait until monotonic ``at``; False when stopped first."""
    return not stop.wait(max(0.0, at - time.monotonic()))


@dataclass
class Roller:
    stack: object
    plan: Plan
    ledger: object
    start: float  # monotonic time the load started; the plan's times count from it
    names: list[str]
    events: list[dict] = field(default_factory=list)
    canaries: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="soak-roller", daemon=True)
        self._versions = dict.fromkeys(self.names, 1)
        self._canary_lock = threading.Lock()
        self._unavailable = 1

    def _loop(self) -> None:
        actions = [(t, "bump") for t in self.plan.bump_times()] + [
            (t, "canary") for t in self.plan.canary_times()
        ]
        turn = itertools.cycle(self.names)
        for at, what in sorted(actions):
            if not sleep_until(self.stop, self.start + at):
                return
            try:
                self.bump(next(turn)) if what == "bump" else self.poke_canary("scheduled")
            except Exception as exc:  # noqa: BLE001 - reported; the soak goes on
                self.errors.append(f"{what} at {at:.0f} s: {type(exc).__name__}: {exc}"[:400])

    def bump(self, name: str) -> None:
        self._versions[name] += 1
        version = f"v{self._versions[name]}"
        manifest = publish(
            self.stack, name, version, seed=1000 * self._versions[name] + self.names.index(name)
        )
        t = time.monotonic()
        self.ledger.apply(name, version, t)  # before the change: no switch can precede it
        path = self.stack.plane.path(API, "LoRAAdapter", name, self.stack.namespace)
        try:
            status, answer = self.stack.plane.request(
                "PATCH", path, {"spec": manifest["spec"]}, content_type=MERGE_PATCH
            )
        except OSError as exc:  # no answer: the spec is read back to settle whether it changed
            status, answer = self._settle(name, version, exc)
        if status != 200:
            self.ledger.retract(name, version)
            raise RuntimeError(f"new version of {name}: {status} {answer[:200]!r}")
        self.events.append(
            {"kind": "bump", "t": round(t - self.start, 2), "adapter": name, "version": version}
        )

    def _settle(self, name: str, version: str, exc: OSError) -> tuple[int, bytes]:
        """After a PATCH that got no answer: 200 if the spec holds ``version`` now, else the error."""
        for _ in range(10):
            try:
                spec = self.stack.get("LoRAAdapter", name)["spec"]
                return (200, b"") if spec["version"] == version else (0, repr(exc).encode())
            except (OSError, RuntimeError):
                time.sleep(3)
        return 0, repr(exc).encode()

    def poke_canary(self, why: str) -> None:
        """The trivial spec change; the monitor records when its generation's status write lands."""
        with self._canary_lock:
            self._unavailable = 3 - self._unavailable
            path = self.stack.plane.path(API, "LoRAAdapter", CANARY, self.stack.namespace)
            body = {"spec": {"rollout": {"maxUnavailable": self._unavailable}}}
            t = time.monotonic()
            status, answer = self.stack.plane.request("PATCH", path, body, content_type=MERGE_PATCH)
            if status != 200:
                raise RuntimeError(f"canary patch: {status} {answer[:200]!r}")
            generation = json.loads(answer)["metadata"]["generation"]
            self.canaries.append({"t": round(t - self.start, 2), "generation": generation, "why": why})


@dataclass
class Faults:
    stack: object
    plan: Plan
    monitor: object
    roller: Roller
    start: float
    events: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="soak-faults", daemon=True)

    def _loop(self) -> None:
        actions = [(t, "kill_pod") for t in self.plan.kill_times()]
        actions += [(t, "restart_operator") for t in self.plan.restart_times()]
        for at, what in sorted(actions):
            if not sleep_until(self.stop, self.start + at):
                return
            try:
                self.kill_pod(at) if what == "kill_pod" else self.restart_operator(at)
            except Exception as exc:  # noqa: BLE001 - reported; the soak goes on
                self.errors.append(f"{what} at {at:.0f} s: {type(exc).__name__}: {exc}"[:400])

    def _record(self, kind: str, t: float, victim: str, bound: float, **extra) -> dict:
        event = {"kind": kind, "t": round(t - self.start, 2), "victim": victim, "bound_s": bound, **extra}
        self.events.append(event)
        return event

    def kill_pod(self, scheduled: float) -> None:
        victim = self._victim()
        t = time.monotonic()
        self.stack.kubelet.kill(victim)
        event = self._record("kill_pod", t, victim, self.plan.kill_bound_s, scheduled=scheduled)
        event["converged_s"] = self._converged_since(t, self.plan.kill_bound_s)

    def _victim(self) -> str:
        """The youngest server Pod, once it is Ready (at most the kill bound): never the oldest, which lives
        through the run."""
        deadline = time.monotonic() + self.plan.kill_bound_s
        while True:
            pods = sorted(self.stack.server_pods(BASE), key=lambda p: p["metadata"]["creationTimestamp"])
            pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            if len(pods) > 1 and (is_ready(pods[-1]) or time.monotonic() > deadline):
                return pods[-1]["metadata"]["name"]
            time.sleep(1.0)

    def restart_operator(self, scheduled: float) -> None:
        victim = next(p["metadata"]["name"] for p in operator_pods(self.stack) if is_ready(p))
        t = time.monotonic()
        self.stack.kubelet.kill(victim)
        event = self._record("restart_operator", t, victim, self.plan.operator_bound_s, scheduled=scheduled)
        deadline = t + self.plan.operator_bound_s
        while time.monotonic() < deadline and not any(
            is_ready(p) and p["metadata"]["name"] != victim for p in operator_pods(self.stack)
        ):
            time.sleep(0.5)
        event["operator_ready_s"] = round(time.monotonic() - t, 1)
        self.roller.poke_canary("after operator restart")  # its status write shows the new operator works
        event["converged_s"] = self._converged_since(t, self.plan.operator_bound_s)

    def _converged_since(self, t: float, bound: float) -> float | None:
        """Seconds from the fault at ``t`` until the monitor saw the system converged again, from a poll that
        began after the fault was done (None: not within the bound)."""
        at = self.monitor.wait_converged(time.monotonic(), t + bound)
        return None if at is None else round(at - t, 1)


# The CI version: the same soak in about four minutes of load (a Pod kill every 90 s, one operator restart,
# a version bump every 30 s, the canary every 60 s), with the same bounds.
CI_PLAN = Plan(minutes=4.0, bump_every_s=30.0, kill_every_s=90.0, operator_restarts=1, canary_every_s=60.0,
               warmup_s=30.0)  # fmt: skip
