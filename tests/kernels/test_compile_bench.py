"""The start-up compile benchmark (bench/compile) lists the engine's launch shapes and compiles them for a GPU
target on the CPU: it must keep working where no GPU is (it runs in a process of its own, because the
suite's kernels are Triton's interpreter, not JIT functions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compile_bench_lists_the_captured_decode_shapes_and_compiles_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "bench/run.py", "compile", "--only", "decode", "--limit", "1", "--threads", "1",
                    "--out", str(out)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)  # fmt: skip
    result = json.loads((out / "compile.json").read_text())
    # shrink and expand of qkv, o, gate_up and down: the shrinks of the pooled q,k,v and gate,up share one
    # shape (4,096 inputs, several pools), o's differs (one pool)
    assert result["meta"]["listed"] == 7 and result["meta"]["compiled"] == 1
    (row,) = result["rows"]
    assert row["shape"].startswith("captured ") and row["compile_s"] > 0 and row["cubin_kb"] > 0
    assert (out / "compile.md").read_text().startswith("## LoRA kernel compile cost")
