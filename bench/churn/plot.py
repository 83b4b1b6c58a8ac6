"""Plots of a ``bench/run.py churn`` result: TTFT by tier (idle and loaded, against the floors) and throughput
against alpha for the base-only and the LoRA engine.

python bench/churn/plot.py bench/churn/results/churn.json bench/churn/results/churn-ttft.png bench/churn/results/churn-throughput.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TIERS = ("gpu", "host", "disk")


def ttft_plot(result: dict, dst: str) -> None:
    summary = result["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, state in zip(axes, ("idle", "loaded"), strict=True):
        measured = summary["ttft_ms"].get(state, {})
        floor = summary["ttft_floor_ms"].get(state, {})
        xs = range(len(TIERS))
        ax.bar([x - 0.2 for x in xs], [measured.get(t, 0) for t in TIERS], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [floor.get(t, 0) for t in TIERS], 0.4, label="floor", color="gray")
        ax.axhline(summary["base_ttft_ms"].get(state, 0), color="k", ls="--", lw=0.8, label="base TTFT")
        ax.set_xticks(list(xs), TIERS)
        ax.set_title(f"TTFT by adapter tier, {state} engine")
        ax.set_yscale("log")
    axes[0].set_ylabel("time to first token (ms)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def throughput_plot(result: dict, dst: str) -> None:
    engine = result["summary"]["engine"]
    if not engine:
        print("no S-LoRA rows of the LoRA engine: no throughput plot")
        return
    alphas = sorted(float(k.split("=")[1]) for k in engine)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    base = [engine[f"alpha={a}"]["base_tok_s"] for a in alphas]
    ours = [engine[f"alpha={a}"]["tok_s"] for a in alphas]
    ax.plot(alphas, base, "k--o", label="base-only engine")
    ax.plot(alphas, ours, "o-", label="LoRA engine (AsyncEngine)")
    ax.set_xlabel("alpha (adapter popularity; 1 = uniform over the adapters)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(0, max(base + ours) * 1.15)
    ax.set_title("S-LoRA workload, 1,000 adapters, disk loads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main(src: str, ttft_dst: str, throughput_dst: str) -> None:
    result = json.load(open(src))
    ttft_plot(result, ttft_dst)
    throughput_plot(result, throughput_dst)


if __name__ == "__main__":
    main(*sys.argv[1:4])
