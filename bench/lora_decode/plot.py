"""Plot the decode step against distinct adapters beside the byte floor, from a ``bench/run.py lora_decode`` result.

python bench/lora_decode/plot.py bench/lora_decode/results/lora-decode.json bench/lora_decode/results/lora-decode.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = json.load(open(src))["rows"]
    curve = sorted(
        (r["distinct"], r)
        for r in rows
        if r.get("section") == "decode"
        and "distinct r16" in r["case"]
        or r["case"].endswith("r16 all modules, unmerged")
    )
    merged = next(r for r in rows if r["case"].startswith("1 adapter r16 all modules, merged"))
    n = [d for d, _ in curve]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(n, [r["step_ms"] for _, r in curve], "o-", label="LoRA decode step, r16 all modules (unmerged)")
    ax.plot(n, [r["floor_ms"] for _, r in curve], "k--", label="floor: base step + adapter bytes / bandwidth")
    ax.plot(
        n,
        [r["target_ms"] for _, r in curve],
        ":",
        color="gray",
        label="target: base + 1.3 x bytes/bw + 0.2 ms",
    )
    ax.plot(n, [r["base_step_ms"] for _, r in curve], "s", color="gray", ms=4, label="base step (same run)")
    ax.plot([1], [merged["step_ms"]], "*", ms=12, color="C2", label="1 adapter, merged")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distinct adapters in the batch (B = 64)")
    ax.set_ylabel("decode step, ms (CUDA graph)")
    ax.set_ylim(0, max(r["step_ms"] for _, r in curve) * 1.15)
    ax.set_title("Llama-3-8B shape, H200, bf16, context 512")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
