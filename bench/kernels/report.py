"""What the kernel benchmark reports: one printed line per case, the summary notes and the time-vs-floor plot."""

from __future__ import annotations

from pathlib import Path


def case_line(r: dict) -> str:
    """One case as one printed line (the run prints as it goes; the table comes at the end)."""
    b = f"{r['bmm_us']:.1f}" if r.get("bmm_us") else "-"
    lo = f"{r['loop_us']:.1f}" if r.get("loop_us") else "-"
    return (
        f"{r['shape']:8s} {r['rank']:8s} {r['phase']:7s} T={r['T']:5d} n={r['n']:3d} res={r['resident']:3d} "
        f"{r['us']:8.1f}us floor {r['floor_us']:7.1f} x{r['x_floor']:5.2f} ok={r['ok']!s:5s} "
        f"base {r['base_us']:7.1f} l/b {r['lora/base']:.2f} bmm {b} loop {lo} err {r['err']:.1e}"
    )


def summarize(rows: list[dict]) -> list[str]:
    notes = []
    main = [r for r in rows if r["phase"] in ("decode", "prefill")]
    miss = [r for r in main if not r["ok"]]
    notes.append(f"floor target met in {len(main) - len(miss)}/{len(main)} cases")
    for r in miss:
        notes.append(
            f"MISS {r['shape']} {r['rank']} {r['phase']} T={r['T']} n={r['n']}: {r['us']:.1f} us > {r['target_us']:.1f}"
        )
    for name in ("q_proj", "gate_up"):
        for r in main:
            if (r["shape"], r["rank"], r["phase"], r["T"], r["n"]) == (name, "r16", "decode", 64, 64):
                notes.append(f"LoRA/base {name} T=64 n=64 r16: {r['lora/base']:.2f} (target <= 0.3)")
    key = {(r["shape"], r["phase"], r["T"], r["n"]): r for r in main if r["rank"] == "r64"}
    worst = None
    for r in main:
        if r["rank"] != "mix8/64" or (r["shape"], r["phase"], r["T"], r["n"]) not in key:
            continue
        r64 = key[(r["shape"], r["phase"], r["T"], r["n"])]
        share = r["active_rank_sum"] / r64["active_rank_sum"]
        ratio = r["us"] / (share * r64["us"])
        r["mix_vs_share"] = ratio
        if worst is None or ratio > worst[0]:
            worst = (ratio, r)
    mixes = [r["mix_vs_share"] for r in main if "mix_vs_share" in r]
    if mixes:
        ok = sum(m <= 1.1 for m in mixes)
        notes.append(f"mix8/64 within rank-weighted share of r64 +10%: {ok}/{len(mixes)} cases (worst x{worst[0]:.2f}: "
                     f"{worst[1]['shape']} {worst[1]['phase']} T={worst[1]['T']} n={worst[1]['n']})")  # fmt: skip
    idle = [r for r in rows if r["phase"].startswith("decode/res")]
    for i in range(0, len(idle) - 1, 2):
        notes.append(
            f"idle residents {idle[i]['shape']}: {idle[i]['us']:.1f} us with 8 resident, "
            f"{idle[i + 1]['us']:.1f} us with 128 (T=64, 8 active)"
        )
    return notes


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 6))
    main = [r for r in rows if r["phase"] in ("decode", "prefill")]
    for key, label, marker in (
        ("us", "loraplane (Triton)", "o"),
        ("bmm_us", "gathered bmm", "x"),
        ("loop_us", "per-adapter loop", "+"),
    ):
        pts = [(r["floor_us"], r[key]) for r in main if r.get(key)]
        if pts:
            ax.scatter(*zip(*pts, strict=True), label=label, marker=marker, s=18)
    lo = min(r["floor_us"] for r in main)
    hi = max(r["floor_us"] for r in main)
    xs = [lo, hi]
    ax.plot(xs, xs, "k-", lw=0.8, label="floor")
    ax.plot(xs, [2 * v for v in xs], "k--", lw=0.8, label="2x floor")
    ax.axhline(8.0, color="gray", ls=":", lw=0.8, label="8 us")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("floor (us): bytes / measured copy bandwidth")
    ax.set_ylabel("time (us)")
    ax.set_title("multi-LoRA shrink+expand, Llama-3-8B shapes, H200 bf16")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
