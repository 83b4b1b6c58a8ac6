"""`python -m e2e.soak.scale --adapters 2000 --out DIR`: thousands of adapters on one LoRABase, on the soak's
stack (real control plane, chart, operator Pod, two real server Pods with the tiny Llama, moto S3).

Phases, each measured alone: (1) N LoRAAdapters applied at once, until all are Ready; (2) an idle minute
(what the operator does when nothing changes); (3) a new version of ``--bump`` of them applied at once, until
those serve it; (4) all deleted at once, until none is left. Per phase: wall time, the operator's API requests
by verb and resource (the apiserver's audit log, as the operator's ServiceAccount), the admin calls each server
Pod received (its access log), the operator's CPU seconds and RSS. At the end of (1) and (3) the Pods'
`GET /admin/adapters` and the CR statuses must agree. Writes ``scale-<N>.json`` and ``scale-<N>.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

from e2e.soak.monitor import pods_truth
from e2e.soak.world import BASE, operator_pods, proc_sample, running_processes, started_stack, wait_base
from e2e.stack import ADAPTERS, RELEASE, condition
from loraplane.artifacts.pack import pack_folder, push_folder, sign_folder
from tests.adapter_factory import make_peft_folder

API = "loraplane.dev/v1alpha1"
MERGE_PATCH = "application/merge-patch+json"


def publish_many(stack, names: list[str], version: str, seed: int, workers: int = 4) -> dict[str, str]:
    """Signed artifacts name@version in S3, each with weights of its own; name -> URI."""
    config = json.loads((stack.model_dir / "config.json").read_text())
    client = stack.s3.client()

    def one(i_name: tuple[int, str]) -> tuple[str, str]:
        i, name = i_name
        folder = stack.workdir / "scale" / f"{name}-{version}"
        make_peft_folder(folder, base_config=config, rank=4, seed=seed + i, scale=0.5)
        pack_folder(folder, name=name, version=version, base_hash=stack.base_hash)
        sign_folder(folder, stack.keys.private_pem)
        uri = push_folder(folder, f"s3://{ADAPTERS}/{name}/{version}/", s3_client=client)["uri"]
        shutil.rmtree(folder)
        return name, uri

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, enumerate(names)))


def manifest(stack, name: str, uri: str, version: str) -> dict:
    return {"apiVersion": API, "kind": "LoRAAdapter", "metadata": {"name": name, "namespace": stack.namespace},
            "spec": {"baseRef": {"name": BASE}, "source": {"uri": uri}, "version": version}}  # fmt: skip


def create_all(stack, docs: list[dict], workers: int = 8) -> None:
    """POST every LoRAAdapter at once (``workers`` in flight), as a user's `kubectl apply` of new objects."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(stack.plane.create, docs))


def patch_all(stack, specs: dict[str, dict], workers: int = 8) -> None:
    """A merge patch of each named LoRAAdapter's spec, all at once."""

    def one(item: tuple[str, dict]) -> None:
        path = stack.plane.path(API, "LoRAAdapter", item[0], stack.namespace)
        status, body = stack.plane.request("PATCH", path, {"spec": item[1]}, content_type=MERGE_PATCH)
        if status != 200:
            raise RuntimeError(f"patching {item[0]}: {status} {body[:200]!r}")

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, specs.items()))


def ready_count(stack, wanted: dict[str, str]) -> tuple[int, list[str]]:
    items = stack.plane.list(API, "LoRAAdapter", stack.namespace)
    ready, stuck = 0, []
    for item in items:
        name, status = item["metadata"]["name"], item.get("status") or {}
        if name not in wanted:
            continue
        ok = (condition(item, "Ready").get("status") == "True" and status.get("servingVersion") == wanted[name]
              and status.get("observedGeneration") == item["metadata"]["generation"])  # fmt: skip
        ready += ok
        if not ok:
            stuck.append(f"{name}: {condition(item, 'Ready').get('reason')}")
    return ready, stuck


class OperatorProbe:
    """The operator's RSS and CPU, sampled every 2 s; and the CPU seconds of every process of the stack (the
    operator, each server Pod, etcd, kube-apiserver, kube-controller-manager) at each phase's start and end,
    so a phase says where the machine's time went."""

    def __init__(self, stack):
        self.stack, self.samples, self.stop = stack, [], threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(2.0):
            for pod, pid in running_processes(self.stack).items():
                if pod.startswith(f"{RELEASE}-loraplane") and (s := proc_sample(pid)):
                    self.samples.append({"t": time.monotonic(), **s})

    def between(self, t0: float, t1: float) -> dict:
        inside = [s for s in self.samples if t0 <= s["t"] <= t1]
        if len(inside) < 2:
            return {}
        return {"cpu_s": round(inside[-1]["cpu_s"] - inside[0]["cpu_s"], 1),
                "rss_max_mb": round(max(s["rss"] for s in inside) / 2**20, 1),
                "rss_end_mb": round(inside[-1]["rss"] / 2**20, 1)}  # fmt: skip

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far by process: the control plane's by name, Pods by role ("operator", "server <pod>")."""
        pids = {p.name: p.popen.pid for p in self.stack.plane.processes}
        for pod, pid in running_processes(self.stack).items():
            pids["operator" if pod.startswith(f"{RELEASE}-loraplane") else f"server {pod}"] = pid
        return {name: s["cpu_s"] for name, pid in pids.items() if (s := proc_sample(pid))}


def cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before.get(name, 0.0), 1) for name in sorted(after)}


def access_offsets(stack) -> dict[str, int]:
    return {c.log.parent.name: c.log.stat().st_size for c in stack.runtime.started
            if c.log.exists() and c.log.parent.name.startswith(f"{BASE}-")}  # fmt: skip


def admin_calls_since(stack, offsets: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per server Pod: admin calls received since ``offsets``, as 'METHOD path-shape' -> count."""
    calls = {}
    for c in stack.runtime.started:
        pod = c.log.parent.name
        if pod not in offsets or not c.log.exists():
            continue
        counter: Counter[str] = Counter()
        with c.log.open("rb") as handle:
            handle.seek(offsets[pod])
            for line in handle:
                if b'"loraplane.http.access"' not in line or b"/admin/" not in line:
                    continue
                entry = json.loads(line)
                path = entry["path"]
                shape = "/admin/adapters" if path == "/admin/adapters" else "/admin/adapters/{name}" + (
                    "/alias" if path.endswith("/alias") else "")  # fmt: skip
                counter[f"{entry['method']} {shape}"] += 1
        calls[pod] = dict(sorted(counter.items()))
    return calls


def api_requests_since(stack, offset: int) -> dict[str, int]:
    user = f"system:serviceaccount:{stack.namespace}:{RELEASE}-loraplane"
    counter: Counter[str] = Counter()
    for event in stack.plane.audit(user, since=offset):
        ref = event.get("objectRef") or {}
        resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        counter[f"{event['verb']} {resource}"] += 1
    return dict(sorted(counter.items()))


def agreement(stack, wanted: dict[str, str]) -> list[str]:
    """Disagreements between each ready Pod's /admin/adapters and the CR statuses (empty when they agree)."""
    truth = pods_truth(stack.ready_pods(BASE))
    items = {i["metadata"]["name"]: i for i in stack.plane.list(API, "LoRAAdapter", stack.namespace)}
    wrong = []
    for name, version in wanted.items():
        status = (items.get(name) or {}).get("status") or {}
        for pod, served in truth.items():
            if served.get(name) != version or status.get("servingVersion") != version:
                wrong.append(
                    f"{name} on {pod}: pod {served.get(name)}, status {status.get('servingVersion')}"
                )
        if {p["name"] for p in status.get("pods") or ()} != set(truth):
            wrong.append(f"{name}: status.pods {[p['name'] for p in status.get('pods') or ()]}")
    extra = {n for served in truth.values() for n in served} - set(wanted)
    return wrong + [f"loaded but not wanted: {sorted(extra)[:10]}"] * bool(extra)


class Phase:
    """One measured phase: wall time, API requests, admin calls, operator CPU/RSS."""

    def __init__(self, stack, probe: OperatorProbe, name: str):
        self.stack, self.probe, self.name = stack, probe, name
        self.t0, self.audit0, self.access0 = (
            time.monotonic(),
            stack.plane.audit_offset(),
            access_offsets(stack),
        )
        self.cpu0 = probe.cpu()

    def done(self, **extra) -> dict:
        t1 = time.monotonic()
        api = api_requests_since(self.stack, self.audit0)
        return {"phase": self.name, "wall_s": round(t1 - self.t0, 1), "api_requests": api,
                "api_total": sum(api.values()), "admin_calls": admin_calls_since(self.stack, self.access0),
                "operator": self.probe.between(self.t0, t1),
                "cpu_s": cpu_between(self.cpu0, self.probe.cpu()), **extra}  # fmt: skip


def wait_ready(stack, wanted: dict[str, str], bound: float, curve: list) -> dict:
    """Poll until every wanted adapter is Ready on its version; the time, and what is stuck at the bound."""
    t0 = time.monotonic()
    while True:
        try:
            ready, stuck = ready_count(stack, wanted)
        except OSError:  # a list of thousands of objects on a loaded apiserver can outlast the read timeout
            if time.monotonic() - t0 > bound:
                raise
            time.sleep(5)
            continue
        curve.append((round(time.monotonic() - t0, 1), ready))
        if ready == len(wanted) or time.monotonic() - t0 > bound:
            return {"all_ready_s": round(time.monotonic() - t0, 1) if not stuck else None, "ready": ready,
                    "stuck": stuck[:20], "stuck_count": len(stuck)}  # fmt: skip
        time.sleep(5)


def measure(stack, count: int, bump: int, bound: float, idle_s: float, result: dict, save, log) -> None:
    """Run the phases, appending each to ``result["phases"]`` and calling ``save()`` after each."""
    wait_base(stack, 2, timeout=900)
    names = [f"s{i:04d}" for i in range(count)]
    log(f"publishing {count} signed adapters")
    t = time.monotonic()
    uris = publish_many(stack, names, "v1", seed=0)
    bumped = names[:: max(1, count // bump)][:bump]
    uris2 = publish_many(stack, bumped, "v2", seed=100_000)
    result.update(publish_s=round(time.monotonic() - t, 1), bumped=len(bumped))
    log(f"published {count} + {len(bumped)} in {result['publish_s']} s")
    probe = OperatorProbe(stack)
    phases, curves = result["phases"], result["curves"]

    phase = Phase(stack, probe, f"create {count}")
    create_all(stack, [manifest(stack, n, uris[n], "v1") for n in names])
    applied_s = round(time.monotonic() - phase.t0, 1)
    wanted = dict.fromkeys(names, "v1")
    ready = wait_ready(stack, wanted, bound, curves.setdefault("create", []))
    phases.append(phase.done(applied_s=applied_s, **ready, disagreements=agreement(stack, wanted)[:20]))
    save()
    log(f"create: {phases[-1]['wall_s']} s, ready {ready['ready']}/{count}")

    phase = Phase(stack, probe, f"idle {idle_s:.0f} s")
    time.sleep(idle_s)
    phases.append(phase.done())
    save()

    phase = Phase(stack, probe, f"bump {len(bumped)}")
    patch_all(stack, {n: manifest(stack, n, uris2[n], "v2")["spec"] for n in bumped})
    wanted.update(dict.fromkeys(bumped, "v2"))
    ready = wait_ready(stack, {n: "v2" for n in bumped}, bound, curves.setdefault("bump", []))
    phases.append(phase.done(**ready, disagreements=agreement(stack, wanted)[:20]))
    save()
    log(f"bump: {phases[-1]['wall_s']} s")

    phase = Phase(stack, probe, f"delete {count}")
    status, body = stack.plane.request("DELETE", stack.plane.path(API, "LoRAAdapter", "", stack.namespace))
    assert status == 200, f"deleting every LoRAAdapter: {status} {body[:300]!r}"
    t0, left = time.monotonic(), count
    while left and time.monotonic() - t0 < bound:
        time.sleep(5)
        left = len(stack.plane.list(API, "LoRAAdapter", stack.namespace))
        curves.setdefault("delete", []).append((round(time.monotonic() - t0, 1), left))
    loaded = {n for served in pods_truth(stack.ready_pods(BASE)).values() for n in served}
    phases.append(phase.done(left=left, still_loaded_on_pods=len(loaded)))
    log(f"delete: {phases[-1]['wall_s']} s, {left} left")
    probe.stop.set()
    result["operator_pods"] = [p["metadata"]["name"] for p in operator_pods(stack)]


def markdown(result: dict) -> str:
    lines = [f"# Scale: {result['adapters']} LoRAAdapters on one LoRABase (2 replicas, tiny Llama on CPU)", "",
             f"Command: `{result['command']}`; {result['when']}; machine: {result['machine']}.", "",
             "| phase | wall s | ready / left | operator API requests | per adapter | admin calls per Pod | "
             "operator CPU s | operator RSS max MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for p in result["phases"]:
        per = p["api_total"] / result["adapters"]
        pods = "; ".join(f"{sum(c.values())} ({', '.join(f'{k}: {v}' for k, v in c.items())})"
                         for c in p["admin_calls"].values())  # fmt: skip
        state = p.get("ready", p.get("left", ""))
        lines.append(f"| {p['phase']} | {p['wall_s']} | {state} | {p['api_total']}: "
                     f"{', '.join(f'{k} {v}' for k, v in p['api_requests'].items())} | {per:.2f} | {pods} | "
                     f"{p['operator'].get('cpu_s')} | {p['operator'].get('rss_max_mb')} |")  # fmt: skip
    lines += ["", "CPU seconds by process in each phase (the machine's 2 cores give at most 2 per second of wall time):",
              "", "| phase | " + " | ".join(names := sorted({n for p in result["phases"] for n in p.get("cpu_s", {})}))
              + " |", "| --- |" + " --- |" * len(names)]  # fmt: skip
    for p in result["phases"]:
        lines.append(
            f"| {p['phase']} | " + " | ".join(str(p.get("cpu_s", {}).get(n, "")) for n in names) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.soak.scale", description=__doc__)
    parser.add_argument("--adapters", type=int, default=2000)
    parser.add_argument("--bump", type=int, default=200)
    parser.add_argument("--bound", type=float, default=1200.0, help="give up waiting after this (s)")
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every process of the stack is stopped

    def log(line: str) -> None:
        print(time.strftime("%H:%M:%S"), line, flush=True)

    command = "python -m e2e.soak.scale " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"adapters": args.adapters, "bound_s": args.bound, "command": command,
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{os.cpu_count()} CPU cores shared with other jobs, no GPU", "phases": [], "curves": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / f"scale-{args.adapters}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"scale-{args.adapters}.md").write_text(markdown(result))

    try:
        with tempfile.TemporaryDirectory(prefix="loraplane-scale-") as scratch:
            with started_stack(args.workdir or Path(scratch)) as stack:
                measure(stack, args.adapters, args.bump, args.bound, args.idle, result, save, log)
    except BaseException as exc:  # the phases measured so far are kept, with what stopped the rest
        result["error"] = "".join(traceback.format_exception(exc))[-3000:]
        raise
    finally:
        save()
        log(markdown(result))
    create = result["phases"][0]
    return 0 if create["all_ready_s"] is not None and create["all_ready_s"] <= 600 else 1


if __name__ == "__main__":
    sys.exit(main())
