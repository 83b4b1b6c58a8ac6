"""The soak's world: the e2e stack (control plane, moto S3, `helm install`, the kubelet stand-in running every
Pod as a real process), one LoRABase, and signed adapters; plus what the runner reads from it (pods, the
operator's Pod, processes, host caches).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from e2e.stack import POD_START, RELEASE, Stack, build_stack, condition, wait_for
from loraplane.artifacts.base_hash import compute_base_hash
from tests.controlplane.cluster import REPO_ROOT, ControlPlane, free_port
from tests.controlplane.fixtures import create_namespace
from tests.controlplane.kubelet import Kubelet
from tests.controlplane.processes import ProcessRuntime
from tests.engine.conftest import build_tiny_hf_model
from tests.http.conftest import build_chat_tokenizer
from tests.s3_servers import moto_server

BASE = "demo"
CANARY = "canary"  # the liveness canary: an adapter no client calls, whose spec changes trivially


def tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama with its chat tokenizer (what the e2e scenarios serve)."""
    tokenizer = build_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    build_tiny_hf_model(folder, "llama", vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
                        pad_token_id=None)  # fmt: skip
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def started_stack(
    workdir: Path, plane: ControlPlane | None = None, model_dir: Path | None = None, env: dict | None = None
) -> Iterator[Stack]:
    """S3 + chart (in a namespace of its own) + kubelet on ``plane`` (default: a control plane of its own);
    every process it started is stopped on the way out. ``env``: more environment for every Pod's process."""
    own = plane is None
    plane = ControlPlane.start(workdir / "cluster") if own else plane
    try:
        namespace = create_namespace(plane, "soak")
        model_dir = model_dir or tiny_model(workdir / "tiny-llama")
        with moto_server() as s3:
            stack = build_stack(
                plane, namespace, workdir / "stack", s3, model_dir, compute_base_hash(model_dir)
            )
            try:
                # The operator's metrics listen on every address (a Pod has its own network); here all Pods
                # share the host's, so the port must be one no other process holds.
                stack.install_chart("--set", f"metrics.port={free_port()}")
                plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
                # Pods run this checkout's sources, whatever the environment's editable install points at.
                pod_env = {"PYTHONPATH": str(REPO_ROOT / "src"), **(env or {})}
                stack.runtime = ProcessRuntime(plane, stack.workdir / "pods", extra_env=pod_env)
                stack.kubelet = Kubelet(plane, namespace, stack.runtime).__enter__()
                yield stack
            finally:
                stack.stop()
    finally:
        if own:
            plane.stop()


def adapter_names(count: int) -> list[str]:
    return [f"ad{i:02d}" for i in range(count)]


def publish(stack: Stack, name: str, version: str, seed: int) -> dict:
    """A signed artifact of name@version pushed to S3; its LoRAAdapter manifest."""
    label = f"{name}-{version}"
    stack.add_adapter(label, name, version, seed=seed)
    return stack.adapter_manifest(name, label, version, base=BASE)


def operator_pods(stack: Stack) -> list[dict]:
    return [p for p in stack.plane.list("v1", "Pod", stack.namespace)
            if p["metadata"]["name"].startswith(f"{RELEASE}-loraplane")]  # fmt: skip


def is_ready(pod: dict) -> bool:
    return condition(pod, "Ready").get("status") == "True" and not pod["metadata"].get("deletionTimestamp")


def wait_operator_ready(stack: Stack, timeout: float = 120) -> None:
    wait_for(
        lambda: any(is_ready(p) for p in operator_pods(stack)), timeout, f"the operator Ready\n{stack.logs()}"
    )


def base_manifest(stack: Stack, replicas: int) -> dict:
    """The e2e LoRABase, with adapter pools sized for the tiny model: the defaults (4 GiB "GPU" pool, 16 GiB
    host) would be allocated in RAM by a CPU engine, 6 GB per Pod on a machine that runs several."""
    manifest = stack.base_manifest(BASE, replicas=replicas)
    manifest["spec"]["engine"].update({"gpuAdapterBytes": "128Mi", "hostAdapterBytes": "256Mi"})
    return manifest


def wait_base(stack: Stack, replicas: int, timeout: float = POD_START) -> list[dict]:
    stack.apply(base_manifest(stack, replicas))
    return wait_for(lambda: len(stack.ready_pods(BASE)) == replicas and stack.ready_pods(BASE), timeout,
                    f"{replicas} server Pods Ready\n{stack.logs()}")  # fmt: skip


def base_model_name(pod: dict) -> str:
    """The base's `model` name, as the pod lists it on /v1/models (the card without a parent)."""
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/v1/models", timeout=10) as answer:
        cards = json.load(answer)["data"]
    return next(c["id"] for c in cards if not c.get("parent"))


def adapters_converged(stack: Stack, expected: dict[str, str]) -> list[str]:
    """What keeps the adapters from having converged (empty when converged): each named adapter Ready on
    every desired pod, serving ``expected[name]``, with observedGeneration current."""
    lagging = []
    for item in stack.plane.list("loraplane.dev/v1alpha1", "LoRAAdapter", stack.namespace):
        name, status = item["metadata"]["name"], item.get("status") or {}
        if name not in expected:
            continue
        ok = (condition(item, "Ready").get("status") == "True"
              and status.get("servingVersion") == expected[name]
              and status.get("observedGeneration") == item["metadata"]["generation"]
              and status.get("readyPods") == status.get("desiredPods"))  # fmt: skip
        if not ok:
            lagging.append(f"{name}: {condition(item, 'Ready').get('reason')} {status.get('servingVersion')}")
    return lagging


# --- processes and host caches -------------------------------------------------------------------------
def running_processes(stack: Stack) -> dict[str, int]:
    """Pod name -> pid of its container process, for every Pod the kubelet stand-in runs now."""
    with stack.kubelet._lock:  # the stand-in's own map of what runs
        running = dict(stack.kubelet.running)
    return {name: r.handle.popen.pid for name, r in running.items() if r.handle.alive()}


def proc_sample(pid: int) -> dict | None:
    """RSS (bytes), threads, open fds and CPU seconds of one process, from /proc; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "rss": int(fields["VmRSS"].split()[0]) * 1024,
        "threads": int(fields["Threads"]),
        "fds": fds,
        "cpu_s": (int(stat[11]) + int(stat[12])) / ticks,  # utime + stime
    }


def host_cache_dirs(stack: Stack) -> dict[str, Path]:
    """Pod name -> its host cache folder (the `host-cache` volume), for the server Pods running now."""
    root = stack.workdir / "pods" / stack.namespace
    return {p["metadata"]["name"]: root / p["metadata"]["name"] / "volumes" / "host-cache"
            for p in stack.ready_pods(BASE)}  # fmt: skip


def cache_litter(folder: Path) -> dict[str, list[str]]:
    """Orphan blobs (linked by no adapter folder: link count 1) and `.part` files under one host cache."""
    orphans = [p.name for p in (folder / "blobs").glob("*") if p.is_file() and p.stat().st_nlink == 1]
    parts = [str(p.relative_to(folder)) for p in folder.rglob("*.part")]
    return {"orphan_blobs": orphans, "part_files": parts}


def monotonic_now(origin: float) -> float:
    return round(time.monotonic() - origin, 2)
