"""Plots of a ``bench/run.py churn`` result: the TTFT CDF of the S-LoRA requests by the tier their adapter was
on when they arrived (else TTFT by tier, idle and loaded, against the floors), and throughput against alpha
for the base-only engine, the LoRA engine and, given its result, the LoRA server (``server.py``).

python bench/churn/plot.py DIR/churn.json DIR/churn-ttft.png DIR/churn-throughput.png [DIR/churn-server.json]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter  # noqa: E402

TIERS = ("gpu", "host", "disk")


def ttft_cdf_plot(result: dict, dst: str) -> bool:
    """One panel per alpha: the empirical CDF of TTFT per tier; False when the rows have no per-tier TTFTs."""
    rows = [r for r in result["rows"] if r.get("section") == "slora" and r.get("ttft_by_tier_ms")]
    if not rows:
        return False
    fig, axes = plt.subplots(1, len(rows), figsize=(4.6 * len(rows), 3.6), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        for tier in ("base", *TIERS):
            ms = sorted(row["ttft_by_tier_ms"].get(tier, []))
            if ms:
                ax.step(
                    ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", label=f"{tier} ({len(ms)})"
                )
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("time to first token (ms)")
        ax.set_title(
            f"S-LoRA trace, alpha={row['alpha']}" if row["alpha"] is not None else "base-only engine"
        )
        ax.legend(fontsize=8, title="adapter tier at arrival", title_fontsize=8)
    axes[0][0].set_ylabel("fraction of requests")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    return True


def ttft_plot(result: dict, dst: str) -> None:
    if ttft_cdf_plot(result, dst):
        return
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


def throughput_plot(result: dict, dst: str, server: dict | None = None) -> None:
    engine = result["summary"]["engine"]
    if not engine and server is None:
        print("no S-LoRA rows of the LoRA engine or the server: no throughput plot")
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    values = []
    if engine:
        alphas = sorted(float(k.split("=")[1]) for k in engine)
        base = [engine[f"alpha={a}"]["base_tok_s"] for a in alphas]
        ours = [engine[f"alpha={a}"]["tok_s"] for a in alphas]
        ax.plot(alphas, base, "k--o", label="base-only engine")
        ax.plot(alphas, ours, "o-", label="LoRA engine (AsyncEngine)")
        values += base + ours
    if server is not None:
        rows = {r["alpha"]: r["tok_s"] for r in server["rows"]}
        alphas = sorted(a for a in rows if a is not None)
        ax.plot(alphas, [rows[None]] * len(alphas), "k:s", label="base-only server")
        ax.plot(alphas, [rows[a] for a in alphas], "s-", label="LoRA server (loraplane serve, HTTP)")
        values += [rows[None]] + [rows[a] for a in alphas]
    ax.set_xlabel("alpha (adapter popularity; 1 = uniform over the adapters)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(0, max(values) * 1.15)
    ax.set_title("S-LoRA workload, 1,000 adapters, disk loads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main(src: str, ttft_dst: str, throughput_dst: str, server_src: str | None = None) -> None:
    result = json.load(open(src))
    ttft_plot(result, ttft_dst)
    throughput_plot(result, throughput_dst, json.load(open(server_src)) if server_src else None)


if __name__ == "__main__":
    main(*sys.argv[1:5])
