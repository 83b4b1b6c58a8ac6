"""The churn trace through the real server: ``loraplane serve`` in its own process with local adapters registered
on the disk tier (``--adapter NAME=DIR``), the S-LoRA trace sent over the OpenAI API (streaming completions,
async httpx, each request at its arrival time), against a base-only server on the same trace, while a probe
reads ``/health/live`` every 20 ms (the worst answer time is what a kubelet would see under churn).

    python bench/churn/server.py --out DIR --quick     # tiny random model on the CPU (checks the path)
    python bench/churn/server.py --out DIR --gpu       # Llama-3-8B shape, random bf16 weights, one GPU

    python bench/churn/server.py --out DIR --quick --admin-s3   # adapters through the admin API from S3
    python bench/churn/server.py --out DIR --quick --admin-s3 --admin-warm lazy   # registered, pulled on demand

``--gpu`` writes the model folder (about 16 GB of safetensors) and needs fastapi, uvicorn and pydantic
(bench/churn/device_server.sh installs them from carried wheels). By default adapters come from local
folders (``--adapter NAME=DIR``). ``--admin-s3`` loads them the way a pod does instead: signed artifacts in
moto's S3 server, pulled, verified and loaded by the admin API (server_admin.py; moto and flask needed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE), str(HERE.parent)]
from server_build import RANKS, build  # noqa: E402

_spec = importlib.util.spec_from_file_location("lora_bench", HERE.parent / "lora" / "main.py")
lora_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_bench)  # the S-LoRA trace generator of the multi-LoRA benchmark

PROBE_S = 0.02
GIB = 1 << 30
SERVER_ARGS = {  # besides the pool and host-tier sizes
    "quick": ["--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "1024", "--max-rank", "16"],
    "gpu": ["--device", "cuda", "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "128",
            "--max-rank", "64"],
}  # fmt: skip


@contextlib.contextmanager
def serve(model_dir: Path, mode: str, adapters: dict[str, Path], pool_bytes: int, host_bytes: int,
          extra: list[str] = (), env: dict[str, str] | None = None, argv_out: list | None = None):  # fmt: skip
    """A ``loraplane serve`` process (``extra`` flags and ``env`` added); yields its URL once /v1/models
    lists every adapter given as a folder."""
    from tests.s3_servers import free_port

    port = free_port()
    argv = [sys.executable, "-m", "loraplane.cli", "serve", "--model", str(model_dir), *SERVER_ARGS[mode],
            "--port", str(port), "--served-model-name", "base", "--log-level", "warning",
            "--gpu-adapter-bytes", str(pool_bytes), "--host-adapter-bytes", str(host_bytes), *extra]  # fmt: skip
    for name, folder in adapters.items():
        argv += ["--adapter", f"{name}={folder}"]
    if argv_out is not None:
        argv_out.extend(argv[1:])
    log = model_dir / f"server-{port}.log"  # its stderr (a pipe nobody reads would fill and block it)
    process = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                               stdout=subprocess.DEVNULL, stderr=log.open("wb"))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        deadline = started + 600
        while True:
            try:
                if len(httpx.get(f"{url}/v1/models").json()["data"]) == 1 + len(adapters):
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if process.poll() is not None:
                raise RuntimeError(f"loraplane serve exited: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("loraplane serve did not list its adapters within 600 s")
            time.sleep(0.2)
        print(json.dumps({"server_ready_s": round(time.monotonic() - started, 1), "adapters": len(adapters)}),
              flush=True)  # fmt: skip
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


async def one(client: httpx.AsyncClient, t0: float, at: float, model: str, prompt: list[int], n: int) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start, first, chunks = time.perf_counter(), None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"failed": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:  # a failure after the 200 comes in band
                        return {"failed": f"in-band error: {chunk['error'].get('message', chunk)!s:.200}"}
                    first = first or time.perf_counter()
                    chunks += 1
    except httpx.HTTPError as exc:
        return {"failed": repr(exc)}
    return {"ttft": (first or time.perf_counter()) - start, "end": time.perf_counter(), "tokens": n}


async def run_trace(url: str, trace, models: list[str]) -> dict:
    arrivals, prompts, lens_out = trace
    live: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            while not stop.is_set():
                start = time.perf_counter()
                (await c.get("/health/live")).raise_for_status()
                live.append(time.perf_counter() - start)
                await asyncio.sleep(PROBE_S)

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        prober = asyncio.create_task(probe())
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(client, t0, float(arrivals[i]), models[i], prompts[i],
                                          int(lens_out[i])) for i in range(len(prompts))))  # fmt: skip
        stop.set()
        await prober
    ok = [d for d in done if "failed" not in d]
    span = max(d["end"] for d in ok) - (t0 + float(arrivals[0])) if ok else float("nan")
    ttft = np.array([d["ttft"] for d in ok] or [float("nan")]) * 1e3
    return {"tok_s": sum(d["tokens"] for d in ok) / span, "seconds": span, "failed": len(done) - len(ok),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "health_live_max_ms": max(live) * 1e3 if live else None, "health_live_probes": len(live),
            "errors": sorted({d["failed"] for d in done if "failed" in d})[:3]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench churn server")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    which.add_argument("--gpu", action="store_true", help="Llama-3-8B shape on one GPU")
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=None, help="default: 24 (quick), 100 (gpu)")
    parser.add_argument("--rate", type=float, default=None, help="requests/s; default: 8 (quick), 16 (gpu)")
    parser.add_argument("--adapters", type=int, default=None, help="default: 40 (quick), 1000 (gpu)")
    parser.add_argument("--alphas", type=float, nargs="*", default=[1.0, 0.1])
    parser.add_argument(
        "--pool-gib", type=float, default=8.0, help="GPU adapter pool (gpu; below the working set)"
    )
    parser.add_argument("--host-gib", type=float, default=4.0, help="host tier (gpu; below the working set)")
    parser.add_argument("--dir", default=None, help="where the model and adapter folders are written")
    parser.add_argument(
        "--admin-s3",
        action="store_true",
        help="load the adapters through the admin API from signed S3 artifacts (moto's server)",
    )
    parser.add_argument("--admin-adapters", choices=("used", "all"), default=None,
                        help="with --admin-s3: push and register only the adapters the trace uses, or all "
                        "(S3 keeps each distinct file once); default: all (quick), used (gpu)")  # fmt: skip
    parser.add_argument("--admin-warm", choices=("host", "disk", "lazy"), default=None,
                        help="with --admin-s3: pull, load and warm every adapter at registration (host, the "
                        "default); pull each onto the node's disk, loaded by its first request (disk); or "
                        "register each from its manifest and pull it at its first request (lazy)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.admin_adapters is not None and not args.admin_s3:
        parser.error("--admin-adapters: only with --admin-s3")
    if args.admin_warm is not None and not args.admin_s3:
        parser.error("--admin-warm: only with --admin-s3")
    args.admin_warm = args.admin_warm or "host"
    mode = "quick" if args.quick else "gpu"
    gpu = mode == "gpu"
    args.requests = args.requests or (100 if gpu else 24)
    args.rate = args.rate or (16.0 if gpu else 8.0)
    args.adapters = args.adapters or (1000 if gpu else 40)
    args.admin_adapters = args.admin_adapters or ("used" if gpu else "all")
    trace = lora_bench.make_trace(args.requests, args.rate, max_len=512 if gpu else 40)
    assign = {a: lora_bench.make_assignment(args.adapters, args.requests, a) for a in args.alphas}
    used = {i for idx in assign.values() for i in idx}
    work = Path(tempfile.mkdtemp(prefix="churn-server-", dir=args.dir))
    built = time.perf_counter()
    folders, row = build(work, mode, args.adapters, used)
    print(json.dumps({"model_and_adapters_written_s": round(time.perf_counter() - built, 1)}), flush=True)
    vocab = json.loads((work / "config.json").read_text())["vocab_size"]
    trace = (trace[0], [[t % (vocab - 1) + 1 for t in p] for p in trace[1]], trace[2])
    ranks = RANKS[mode]
    working = sum(row * ranks[i % len(ranks)] for i in used)
    if gpu:
        pool, host = int(args.pool_gib * GIB), int(args.host_gib * GIB)
    else:
        pool, host = max(16 * row, working // 3), max(16 * row, working // 2)  # both below the working set
    rows = []
    with serve(work, mode, {}, pool, host) as url:
        rows.append({"case": f"server base ({args.requests} req, {args.rate}/s)", "alpha": None,
                     **asyncio.run(run_trace(url, trace, ["base"] * args.requests))})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    admin: dict = {}
    rows += lora_rows(args, work, mode, folders, used, (pool, host), trace, assign, admin)
    base = rows[0]
    summary = {f"alpha={r['alpha']}": {"throughput_vs_base": r["tok_s"] / base["tok_s"],
                                       "ttft_p50_vs_base": r["ttft_p50_ms"] / base["ttft_p50_ms"],
                                       "ttft_p99_vs_base": r["ttft_p99_ms"] / base["ttft_p99_ms"]}
               for r in rows[1:]}  # fmt: skip
    summary["health_live_max_ms"] = max(r["health_live_max_ms"] or 0.0 for r in rows)
    if "admin" in admin:  # registration time, and what S3 stores against one copy of the files per artifact
        summary.update(
            {k: admin["admin"][k] for k in ("admin_register_s", "s3_bytes", "s3_bytes_one_copy_per_artifact")}
        )
    title = "Llama-3-8B shape, random bf16 weights, one GPU" if gpu else "tiny random Llama, CPU, --quick"
    title += "; adapters through the admin API from S3" if args.admin_s3 else ""
    stem = "churn-server-admin" if args.admin_s3 else "churn-server"
    result = {"title": f"Adapter churn through loraplane serve ({title})",
              "columns": ["case", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "failed", "health_live_max_ms", "distinct"],
              "rows": rows, "summary": summary,
              "meta": {"working_set_gb": working / 1e9, "gpu_adapter_bytes": pool, "host_adapter_bytes": host,
                       "device": torch_device(), **admin}}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    from run import markdown

    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def lora_rows(args, work: Path, mode: str, folders: dict[str, Path], used: set[int], budgets: tuple[int, int],
              trace, assign: dict, admin: dict) -> list[dict]:  # fmt: skip
    """The trace at each alpha on one LoRA server: adapters from local folders, or (``--admin-s3``) pulled
    from S3 through the admin API after the server started (``admin`` gets the registration's figures)."""
    rows, argv = [], []
    with contextlib.ExitStack() as stack:
        if args.admin_s3:
            from server_admin import register, s3_adapters

            chosen = (
                folders if args.admin_adapters == "all" else {f"s{i}": folders[f"s{i}"] for i in sorted(used)}
            )
            setup = stack.enter_context(s3_adapters(work, chosen))
            url = stack.enter_context(serve(work, mode, {}, *budgets, setup.argv, setup.env, argv))
            admin["admin"] = asyncio.run(register(setup, warm=args.admin_warm))
            print(json.dumps(admin["admin"]), flush=True)
            listed = len(httpx.get(f"{url}/v1/models").json()["data"]) - 1
            if listed != len(chosen):
                raise RuntimeError(f"/v1/models lists {listed} adapters after registering {len(chosen)}")
            how = f"{len(chosen)} adapters loaded through the admin API from S3"
            how += {"lazy": ", pulled at their first request", "disk": ", pulled to disk, loaded at their first request"}.get(args.admin_warm, "")  # fmt: skip
        else:
            url = stack.enter_context(serve(work, mode, folders, *budgets, argv_out=argv))
            how = f"{len(folders)} adapters on the disk tier"
        admin["server_argv"] = argv
        for alpha in args.alphas:
            models = [f"s{i}" for i in assign[alpha]]
            rows.append({"case": f"server LoRA alpha={alpha} ({args.requests} req, {how})", "alpha": alpha,
                         "distinct": len(set(models)), **asyncio.run(run_trace(url, trace, models))})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def torch_device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
