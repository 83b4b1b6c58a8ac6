"""The capture-policy sweep of the LoRA decode benchmark: each policy's graphs captured again and timed."""

from __future__ import annotations

import json

from loraplane.kernels.launch_config import set_capture_policy

# CapturePolicy fields tried for the captured (graph) LoRA launches; {} is the default (the decode-shaped
# kernels, kernels/triton_decode.py, 512 input columns a shrink program and 1024 output columns an expand
# program). {"decode": False}: the general kernels shaped by DECODE_TABLE; "decode_k": wider shrink blocks;
# "decode_dot": False takes tiles of several tokens a token at a time.
SWEEP = (
    {"decode": False},
    {},
    {"decode_k": 1024},
    {"decode_k": 256},
    {"decode_dot": False},
    {"pdl": True},
    {"decode_warps": 8},
)


def recapture(runner, sizes: tuple[int, ...]) -> None:
    """The LoRA graph families captured again (under the current capture policy) for ``sizes``."""
    runner.capture_lora_graphs(sizes)


def sweep_policies(runner, cases: dict, step_ms, base_decode, policies: tuple[dict, ...],
                   size: int) -> tuple[list[dict], dict]:  # fmt: skip
    """Each policy on the graph of ``size`` rows: ``step_ms(adapters)`` of each case's adapters; returns the
    rows and the fastest policy."""
    rows, best = [], (float("inf"), {})
    for policy in policies:
        try:
            set_capture_policy(**policy)
            recapture(runner, (size,))
            base_ms = base_decode()
            times = {name: step_ms(ads) for name, ads in cases.items()}
        except Exception as exc:  # a policy this device or Triton can't run: its row says why, the rest go on
            rows.append(
                {"case": f"sweep {policy}", "section": "sweep", "error": f"{type(exc).__name__}: {exc}"}
            )
            print(json.dumps(rows[-1]), flush=True)
            continue
        rows.append({"case": f"sweep {policy or 'default'}", "section": "sweep", "base_step_ms": base_ms,
                     **{f"{k}_ms": v for k, v in times.items()}, "sum_x_base": sum(times.values()) / base_ms})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        # Ranked by the summed step time, not by ratios to the base: the base step drifts by up to 8 % within
        # a run (clocks), while the policies are measured back to back on the same device.
        rows[-1]["sum_ms"] = sum(times.values())
        best = min(best, (rows[-1]["sum_ms"], policy), key=lambda b: b[0])
    return rows, best[1]
