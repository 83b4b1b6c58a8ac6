"""What the HTTP side adds to a request: engine-direct vs OpenAI API, base vs adapter, on the CPU.

A tiny random Llama (the HTTP tests' model) keeps the engine's share small, so the HTTP share shows.
Sequential requests of one output token (prompt "hello world"), keep-alive connection, after a warm-up.
The server is a real ``loraplane serve`` process (a server thread inside the client's process measures the
two sharing one interpreter, about 45 ms per request here, not the server).

    nice -n 10 .venv/bin/python bench/http/overhead.py [--n 200] [--out bench/http/results/http-overhead]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": round(pick(0.5) * 1e3, 3), "p90_ms": round(pick(0.9) * 1e3, 3),
            "mean_ms": round(statistics.fmean(ordered) * 1e3, 3)}  # fmt: skip


@contextlib.contextmanager
def serve_process(model_dir: Path, adapter_dir: Path):
    from tests.s3_servers import free_port

    port = free_port()
    argv = [sys.executable, "-m", "loraplane.cli", "serve", "--model", str(model_dir), "--device", "cpu",
            "--max-model-len", "128", "--num-kv-blocks", "32", "--port", str(port), "--served-model-name", "tiny",
            "--adapter", f"a={adapter_dir}", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v1/models").json()["data"][-1]["id"] == "a":
                    break
            except (httpx.HTTPError, KeyError, IndexError):
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("loraplane serve did not come up")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--out", default="bench/http/results/http-overhead")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from loraplane.engine.core.async_engine import AsyncEngine
    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.core.sequence import SamplingParams
    from loraplane.serve.main import load_tokenizer
    from tests.adapter_factory import make_peft_folder
    from tests.engine.conftest import build_tiny_hf_model
    from tests.http.conftest import build_chat_tokenizer

    work = Path(tempfile.mkdtemp(prefix="http-bench-"))
    tokenizer = build_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    build_tiny_hf_model(work, "llama", vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
                        pad_token_id=None)  # fmt: skip
    tokenizer.save_pretrained(work)
    tokenizer = load_tokenizer(str(work))
    config = EngineConfig(model=str(work), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
    engine = AsyncEngine.from_config(config, tokenizer)
    base_config = json.loads((work / "config.json").read_text())
    adapter_dir = make_peft_folder(work / "adapter", base_config=base_config, rank=8)
    prompt = tokenizer.encode("hello world")
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def setup_and_direct(adapter: str | None) -> list[float]:
        if adapter is not None and engine.resolve("a") is None:
            await engine.load_adapter("a", "v1", adapter_dir, "sha256:" + "0" * 64)
            await engine.warm_adapter("a", "v1")
            await engine.set_alias("a", "v1")
        times = []
        for i in range(args.n + 10):
            start = time.perf_counter()
            async for _ in engine.add_request(prompt, sampling, adapter=adapter):
                pass
            if i >= 10:
                times.append(time.perf_counter() - start)
        return times

    results = {}
    try:
        results["engine direct, base"] = percentiles(asyncio.run(setup_and_direct(None)))
        results["engine direct, adapter"] = percentiles(asyncio.run(setup_and_direct("a@v1")))
        with serve_process(work, adapter_dir) as url, httpx.Client(base_url=url, timeout=30) as client:
            for label, model in (("OpenAI API, base", "tiny"), ("OpenAI API, adapter", "a")):
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                times = []
                for i in range(args.n + 10):
                    start = time.perf_counter()
                    assert client.post("/v1/completions", json=body).status_code == 200
                    if i >= 10:
                        times.append(time.perf_counter() - start)
                results[label] = percentiles(times)
    finally:
        engine.close()
    for kind in ("base", "adapter"):
        results[f"HTTP overhead, {kind} (p50)"] = {
            "ms": round(
                results[f"OpenAI API, {kind}"]["p50_ms"] - results[f"engine direct, {kind}"]["p50_ms"], 3
            )
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"n": args.n, "results": results}, indent=2))
    lines = ["| path | p50 ms | p90 ms | mean ms |", "|---|---|---|---|"]
    for label, r in results.items():
        if "p50_ms" in r:
            lines.append(f"| {label} | {r['p50_ms']} | {r['p90_ms']} | {r['mean_ms']} |")
        else:
            lines.append(f"| {label} | {r['ms']} | | |")
    out.with_suffix(".md").write_text(
        f"One-token completions, tiny random Llama on the CPU, n={args.n} sequential, keep-alive.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
