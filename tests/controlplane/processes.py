"""Run a Pod's container as a local process, as the kubelet stand-in's runtime: ``ProcessRuntime(plane, workdir)``.

The container's image is the loraplane image, whose entrypoint is the ``loraplane`` console script, so the
process is ``loraplane <container args>``. What a kubelet would provide is made locally:
- volumes: Secrets are written as files, emptyDir and hostPath are folders under the Pod's own directory, and
  every mount path in the args and env is rewritten to that folder;
- env: plain values, ``secretKeyRef``s and the downward API's ``fieldRef``s, expanded in the args as
  ``$(NAME)``; ``PYTHONPATH`` names the loraplane sources this process imports, so Pods run the code under
  test; ``KUBECONFIG`` points at a kubeconfig holding a TokenRequest token of the Pod's ServiceAccount (what
  the mounted token gives a pod in a cluster);
- networking: the Pod's own loopback address replaces 0.0.0.0 in the args, so every Pod can use the same ports;
- readiness: the container's readinessProbe (an httpGet) against that address, with its period, timeout and
  failure threshold.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import loraplane
from tests.reaping import reaped

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
LOCAL = Path(sys.executable).parent  # the test environment's console scripts (`loraplane`)
SOURCES = str(
    Path(loraplane.__file__).resolve().parents[1]
)  # Pods run the sources under test, as this process


@dataclass
class Probe:
    """A container's httpGet readinessProbe, run as a kubelet runs it: every ``period`` seconds with a
    ``timeout``; Ready after one success, not Ready after ``failures`` failures in a row (so one slow answer
    from a busy server does not take it out of its Service)."""

    url: str
    period: float = 10.0
    timeout: float = 1.0
    failures: int = 3
    last_run: float = float("-inf")
    failed_in_a_row: int = 0
    ready: bool = False

    def check(self) -> bool:
        if time.monotonic() - self.last_run < self.period:
            return self.ready
        self.last_run = time.monotonic()
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as answer:
                ok = 200 <= answer.status < 400
        except OSError:
            ok = False
        self.failed_in_a_row = 0 if ok else self.failed_in_a_row + 1
        if ok:
            self.ready = True
        elif self.failed_in_a_row >= self.failures:
            self.ready = False
        return self.ready


class ProcessContainer:
    def __init__(self, popen: subprocess.Popen, log: Path, probe: Probe | None):
        self.popen, self.log, self.probe = popen, log, probe

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self) -> bool:
        if not self.alive():
            return False
        return True if self.probe is None else self.probe.check()

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)


class ProcessRuntime:
    def __init__(self, plane, workdir: Path, extra_env: dict[str, str] | None = None):
        self.plane, self.workdir, self.extra_env = plane, workdir, dict(extra_env or {})
        self.started: list[ProcessContainer] = []

    def __call__(self, pod: dict, ip: str) -> ProcessContainer:
        meta, spec = pod["metadata"], pod["spec"]
        root = self.workdir / meta["namespace"] / meta["name"]
        root.mkdir(parents=True, exist_ok=True)
        volumes = {v["name"]: self._volume(v, root, meta["namespace"]) for v in spec.get("volumes") or ()}
        container = spec["containers"][0]
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts") or ()
                  if m["name"] in volumes}  # fmt: skip
        env = {"PATH": f"{LOCAL}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "TRITON_INTERPRET": "1", "PYTHONPATH": SOURCES}  # fmt: skip
        for item in container.get("env") or ():
            env[item["name"]] = self._env_value(item, pod, mounts)
        # As the kubelet: $(NAME) in args becomes the container's env value (unknown names stay as written).
        args = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in container.get("args") or ()]
        args = [self._local(a, mounts) for a in args]
        args = [a.replace("0.0.0.0", ip) for a in args]  # every Pod listens on its own address
        account = spec.get("serviceAccountName") or "default"
        env["KUBECONFIG"] = str(self.plane.service_account_kubeconfig(meta["namespace"], account))
        env.update(self.extra_env)
        log = root / "container.log"
        with log.open("ab") as handle:
            popen = subprocess.Popen(reaped([str(LOCAL / "loraplane"), *args]), stdout=handle,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root,
                                     start_new_session=True)  # fmt: skip
        started = ProcessContainer(popen, log, self._probe(container, ip))
        self.started.append(started)
        return started

    def stop_all(self) -> None:
        for container in self.started:
            container.stop()

    def _volume(self, volume: dict, root: Path, namespace: str) -> Path:
        folder = root / "volumes" / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        if "secret" in volume:
            secret = self.plane.get("v1", "Secret", volume["secret"]["secretName"], namespace)
            for key, value in (secret.get("data") or {}).items():
                path = folder / key
                path.write_bytes(base64.b64decode(value))
                path.chmod(0o400)
        return folder

    @staticmethod
    def _local(text: str, mounts: dict[str, Path]) -> str:
        """``--flag=/mount/path/x`` -> ``--flag=<pod dir>/volumes/<volume>/x`` (longest mount path first)."""
        for mount in sorted(mounts, key=len, reverse=True):
            for prefix in ("=", ""):
                head = f"{prefix}{mount}"
                at = text.find(head)
                if at != -1 and (at + len(head) == len(text) or text[at + len(head)] == "/"):
                    return text[: at + len(prefix)] + str(mounts[mount]) + text[at + len(head) :]
        return text

    def _env_value(self, item: dict, pod: dict, mounts: dict[str, Path]) -> str:
        if "value" in item:
            return self._local(item["value"], mounts)
        source = item["valueFrom"]
        if "fieldRef" in source:  # the downward API, for the fields our charts use
            section, _, field = source["fieldRef"]["fieldPath"].partition(".")
            return str(pod[section][field])
        ref = source["secretKeyRef"]
        secret = self.plane.get("v1", "Secret", ref["name"], pod["metadata"]["namespace"])
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    @staticmethod
    def _probe(container: dict, ip: str) -> Probe | None:
        spec = container.get("readinessProbe") or {}
        probe = spec.get("httpGet")
        if probe is None:
            return None
        port = probe["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container.get("ports") or () if p.get("name") == port)
        return Probe(f"http://{ip}:{port}{probe['path']}", period=spec.get("periodSeconds", 10),
                     timeout=spec.get("timeoutSeconds", 1), failures=spec.get("failureThreshold", 3))  # fmt: skip


def container_log_tail(container: ProcessContainer, size: int = 3000) -> str:
    return container.log.read_text(errors="replace")[-size:] if container.log.exists() else ""
