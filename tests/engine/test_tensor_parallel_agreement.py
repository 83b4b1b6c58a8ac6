"""One set of random weights, two layouts: the TP=2 shard group against the whole model, rank by rank in
their own processes. On CPU (fp32, tiny shapes) within fp32 rounding (tests/numerics.py); on 2 GPUs (bf16,
a Llama-3-8B shape) within bf16 rounding."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.numerics import sum_bound

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
_LLAMA = dict(model_type="llama", max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
              tie_word_embeddings=False, torch_dtype="bfloat16")  # fmt: skip
TINY_QWEN2 = dict(_LLAMA, model_type="qwen2", vocab_size=255, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
LLAMA3_8B = dict(_LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8)  # fmt: skip


def run_ranks(argv: list[str], tmp_path: Path, deadline_s: float) -> tuple[list[int | None], list[str]]:
    """Both ranks, each logging to its own file; the first to fail (or the deadline) stops the other at once.
    Returns the exit codes (None: stopped while still running) and each rank's log tail."""
    # by path, not -m: the repository root on sys.path would shadow the installed loraplane package
    script = str(Path(__file__).with_name("tp_agreement.py"))
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("wb") as sink:
            procs.append(subprocess.Popen([sys.executable, script, str(r), "2", *argv], cwd=REPO,
                                          stdout=sink, stderr=subprocess.STDOUT))  # fmt: skip
    deadline = time.monotonic() + deadline_s
    try:
        codes = [p.poll() for p in procs]
        while None in codes and not any(codes) and time.monotonic() < deadline:
            time.sleep(0.2)  # any(codes): a rank exited non-zero
            codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return codes, [log.read_text(errors="replace")[-3000:] for log in logs]


def agreement(shape: dict, device: str, tmp_path: Path, watchdog_s: int = 240) -> dict:
    """Run both ranks and return rank 0's comparison. A rank killed by a signal (not a failed check: that
    exits 1) is run once more, with a warning that carries its log, so one crash of the process runtime on
    a loaded host is reported without hiding a crash that repeats."""
    for attempt in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        out = tmp_path / f"errors{attempt}.json"
        argv = [init, json.dumps(shape), device, str(out), str(watchdog_s)]
        codes, logs = run_ranks(argv, tmp_path, watchdog_s + 30)
        report = "\n".join(
            f"--- rank {r} (exit {c}):\n{t}" for r, (c, t) in enumerate(zip(codes, logs, strict=True))
        )
        if codes == [0, 0]:
            return json.loads(out.read_text())
        if attempt == 0 and any(c is not None and c < 0 for c in codes):
            warnings.warn(f"a TP rank died by a signal; running the pair once more\n{report}", stacklevel=2)
            continue
        raise AssertionError(f"rank exit codes {codes} (None: still running, stopped)\n{report}")
    raise AssertionError("unreachable")


def test_cpu_fp32_shard_group_equals_the_whole_model(tmp_path):
    errors = agreement(TINY_QWEN2, "cpu", tmp_path)
    # the shards sum in another order: fp32 rounding over the chain of reductions behind a logit
    hidden, layers = TINY_QWEN2["hidden_size"], TINY_QWEN2["num_hidden_layers"]
    bound = sum_bound(errors["max_want"], layers * (4 * hidden + TINY_QWEN2["intermediate_size"]) + hidden)
    assert errors["max_abs"] <= bound and errors["greedy_equal"], (bound, errors)


@pytest.mark.gpu
def test_gpu_bf16_8b_shape_agrees_with_tp1(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    errors = agreement(LLAMA3_8B, "cuda", tmp_path)
    # bf16 through 32 random layers: the shards sum in another order, and the rounding compounds (4.2e-2
    # measured on two H200s; the same step's CUDA graph against eager differs by 3e-2 on one GPU). A wrong
    # shard or a missing all-reduce gives an error of order 1 and other greedy tokens.
    assert errors["max_rel_norm"] < 8e-2 and errors["greedy_equal"], errors
