"""Plot decode tokens/s against distinct adapters per batch from a ``bench/run.py lora`` result.

python bench/lora/plot.py bench/lora/results/lora.json bench/lora/results/lora-flat.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = json.load(open(src))["rows"]
    base = next(r for r in rows if r["case"].startswith("base-only engine decode"))
    pts = sorted(
        (r["distinct"], r["tok_s"]) for r in rows if r.get("section") == "decode" and "r16" in r["case"]
    )
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="LoRA engine, r16 all-module adapters")
    ax.axhline(base["tok_s"], color="gray", ls="--", label="base-only engine")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(-0.3, 90)
    ax.set_xlabel("distinct adapters in the batch (B=64; 0 = base-only requests)")
    ax.set_ylabel("decode tokens/s (CUDA graph)")
    ax.set_ylim(0, base["tok_s"] * 1.1)
    ax.set_title("Llama-3-8B shape, H200, bf16, context 512")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
