"""A scheduler and kubelet stand-in for one fake Node, as kwok plays them, but running real containers' stand-ins.

The controller manager turns Deployments into ReplicaSets and Pods; nothing schedules or runs them. ``Kubelet``
does, for one namespace: it binds pending Pods to the Node ``stand-in``, gives each its own loopback address
(127.0.0.N, so Pod IPs differ), asks a ``Runtime`` to start the Pod (a real ``loraplane serve`` process, or a
fake admin server in the operator tests), and writes ``status.podIP``, container statuses and the
ContainersReady condition from the runtime's readiness; Ready also waits for the Pod's ``readinessGates``
(conditions someone else sets on its status), as a kubelet's status manager does. Status is written as a
strategic merge patch, so conditions it does not own stay. A Pod being deleted has its process stopped before the deletion is
confirmed, as a kubelet does; ``kill(name)`` stops a process on demand and evicts its Pod, so the ReplicaSet
replaces it.

With ``admit_all=False`` Pods stay Pending until ``admit()`` lets the next one start: tests that add pods one
at a time use that.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

NODE = "stand-in"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"  # conditions merge by type
# 127.0.0.N addresses held by this process's live Pods: N -> the open lock file that reserves it against
# other processes (other test sessions, a soak) that run stand-in Pods on loopback too. A server binds its
# ports only once its model is loaded, tens of seconds after its address was chosen: a free-port check alone
# lets two sessions pick the same address in that window. flock is released when the process exits.
_held: dict[str, int] = {}
_used: set[str] = set()
_LOCKS = Path(tempfile.gettempdir()) / "loraplane-standin-addresses"


def _free(ip: str, ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind((ip, port))
            except OSError:
                return False
    return True


def _reserve(ip: str) -> int | None:
    """The lock file's descriptor when this process now holds ``ip``; None when another process does."""
    _LOCKS.mkdir(exist_ok=True)
    fd = os.open(_LOCKS / ip, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def next_address(ports: list[int] = ()) -> str:
    """A 127.0.0.N that no live Pod of any process holds and whose ``ports`` are free, reserved until
    ``release_address``. Counted down from the top, and addresses this process used before only when no other
    is left: a new Pod rarely gets the address of one just stopped (whose clients may still be retrying)."""
    with _held_lock:
        for reuse in (False, True):
            for n in range(250, 1, -1):
                ip = f"127.0.0.{n}"
                if ip in _held or (ip in _used) != reuse:
                    continue
                fd = _reserve(ip)
                if fd is None:
                    continue
                if _free(ip, ports):
                    _held[ip] = fd
                    _used.add(ip)
                    return ip
                os.close(fd)
    raise RuntimeError("out of 127.0.0.N addresses for stand-in Pods")


def release_address(ip: str) -> None:
    with _held_lock:
        fd = _held.pop(ip, None)
    if fd is not None:
        os.close(fd)


_held_lock = threading.Lock()


class Handle(Protocol):
    def ready(self) -> bool: ...
    def alive(self) -> bool: ...
    def stop(self) -> None: ...


Runtime = Callable[[dict, str], Handle]  # (pod, ip) -> a running container stand-in


@dataclass
class Running:
    pod: dict
    ip: str
    handle: Handle
    started: str
    ready: bool | None = None
    containers_ready: bool | None = None
    alive: bool = True


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ensure_node(plane) -> None:
    """The one Node, Ready, with loopback as its address (admin writes it; idempotent)."""
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
    }
    status, body = plane.request("POST", "/api/v1/nodes", node)
    if status not in (201, 409):
        raise RuntimeError(f"creating Node {NODE}: {status} {body[:300]!r}")
    stamp = _now()
    node_status = {"status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "StandIn", "lastHeartbeatTime": stamp,
                        "lastTransitionTime": stamp}],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": NODE}],
        "capacity": {"cpu": "64", "memory": "256Gi", "pods": "250"},
        "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "250"},
    }}  # fmt: skip
    plane.request("PATCH", f"/api/v1/nodes/{NODE}/status", node_status, content_type=MERGE_PATCH)


def _gates_open(pod: dict) -> bool:
    """Every readiness gate of the Pod has its condition True (none: open)."""
    gates = [g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []]
    have = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return all(have.get(gate) == "True" for gate in gates)


class Kubelet:
    def __init__(
        self, plane, namespace: str, runtime: Runtime, *, admit_all: bool = True, interval: float = 0.2
    ):
        self.plane, self.namespace, self.runtime = plane, namespace, runtime
        self.admit_all, self.interval = admit_all, interval
        self.running: dict[str, Running] = {}  # pod name -> what runs it
        self.errors: list[str] = []
        # Bound Pods whose start failed (no free address yet, a runtime error): each sync tries again, as a
        # kubelet retries a Pod it has accepted, instead of leaving it Pending for good.
        self._unstarted: set[str] = set()
        self._allowance = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{namespace}", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Kubelet:
        ensure_node(self.plane)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        with self._lock:
            for running in self.running.values():
                running.handle.stop()
                release_address(running.ip)
            self.running.clear()

    # --- what tests call -----------------------------------------------------------------------
    def admit(self, count: int = 1) -> None:
        """Let ``count`` more pending Pods start (with ``admit_all=False``)."""
        with self._lock:
            self._allowance += count

    def wait_running(self, count: int, timeout: float = 60.0) -> list[Running]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                running = [r for r in self.running.values() if r.alive]
            if len(running) >= count:
                return running
            time.sleep(0.1)
        raise AssertionError(
            f"{count} Pods not running in {self.namespace} within {timeout} s: {self.errors[-3:]}"
        )

    def kill(self, name: str) -> None:
        """Stop the Pod's process, then evict the Pod (phase Failed, deleted): its ReplicaSet makes a new one."""
        with self._lock:
            running = self.running.pop(name)
        running.handle.stop()
        release_address(running.ip)
        self._patch_status(name, {"phase": "Failed", "reason": "Killed", "message": "killed by the test",
                                  "conditions": self._conditions(False, running.started)})  # fmt: skip
        self.plane.request(
            "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}", {"gracePeriodSeconds": 0}
        )

    # --- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001 - kept for the test's timeout message
                self.errors.append(repr(exc))
            self._stop.wait(self.interval)

    def _list_pods(self) -> list[dict[str, Any]]:
        status, body = self.plane.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")
        if status != 200:
            raise RuntimeError(f"listing pods: {status}")
        return json.loads(body)["items"]

    def _sync(self) -> None:
        pods = {p["metadata"]["name"]: p for p in self._list_pods()}
        for name in [n for n in self.running if n not in pods]:
            with self._lock:
                gone = self.running.pop(name, None)
            if gone:
                gone.handle.stop()
                release_address(gone.ip)
        self._unstarted &= set(pods)
        for name, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp"):
                self._finish_deletion(name, pod)
            elif name in self.running:
                self._report(name, pod)
            elif name in self._unstarted or (not pod["spec"].get("nodeName") and self._may_start()):
                self._start(name, pod)

    def _may_start(self) -> bool:
        with self._lock:
            if self.admit_all:
                return True
            if self._allowance > 0:
                self._allowance -= 1
                return True
            return False

    def _start(self, name: str, pod: dict) -> None:
        if name not in self._unstarted:
            binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}}  # fmt: skip
            status, body = self.plane.request(
                "POST", f"/api/v1/namespaces/{self.namespace}/pods/{name}/binding", binding
            )
            if status != 201:
                raise RuntimeError(f"binding {name}: {status} {body[:200]!r}")
            self._unstarted.add(name)
        ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or ()]
        ip = next_address(ports)
        try:
            handle = self.runtime(pod, ip)
        except BaseException:
            release_address(ip)
            raise
        self._unstarted.discard(name)
        with self._lock:
            self.running[name] = Running(pod, ip, handle, _now())
        self._report(name)

    def _report(self, name: str, pod: dict | None = None) -> None:
        running = self.running.get(name)
        if running is None:
            return
        alive = running.handle.alive()
        containers_ready = alive and running.handle.ready()
        ready = containers_ready and _gates_open(pod or running.pod)
        if (ready, containers_ready, alive) == (running.ready, running.containers_ready, running.alive):
            return
        running.ready, running.containers_ready, running.alive = ready, containers_ready, alive
        containers = running.pod["spec"]["containers"]
        state = {"running": {"startedAt": running.started}} if alive else {
            "terminated": {"exitCode": 1, "reason": "Error", "finishedAt": _now()}}  # fmt: skip
        statuses = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": ready, "started": alive,
                     "restartCount": 0, "state": state} for c in containers]  # fmt: skip
        self._patch_status(name, {
            "phase": "Running", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": running.ip, "podIPs": [{"ip": running.ip}], "startTime": running.started,
            "conditions": self._conditions(ready, running.started, containers_ready), "containerStatuses": statuses,
        })  # fmt: skip

    def _conditions(self, ready: bool, started: str, containers_ready: bool | None = None) -> list[dict]:
        flag = "True" if ready else "False"
        containers = flag if containers_ready is None else ("True" if containers_ready else "False")
        return [{"type": "PodScheduled", "status": "True", "lastTransitionTime": started},
                {"type": "Initialized", "status": "True", "lastTransitionTime": started},
                {"type": "ContainersReady", "status": containers, "lastTransitionTime": _now()},
                {"type": "Ready", "status": flag, "lastTransitionTime": _now()}]  # fmt: skip

    def _patch_status(self, name: str, status: dict) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}/status"
        code, body = self.plane.request("PATCH", path, {"status": status}, content_type=STRATEGIC_MERGE_PATCH)
        if code not in (200, 404):
            raise RuntimeError(f"status of {name}: {code} {body[:200]!r}")

    def _finish_deletion(self, name: str, pod: dict) -> None:
        with self._lock:
            running = self.running.pop(name, None)
        if running:
            running.handle.stop()
            release_address(running.ip)
        uid = pod["metadata"]["uid"]
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        self.plane.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}", body)
