"""The soak's plot: requests and errors per 10 s, RSS of every process, and threads/fds, over time, with the
faults and version bumps marked."""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, samples: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(12, 10), sharex=True)
    load = report["load"]
    width = load["bucket_s"] / 60

    def minutes(buckets: dict[str, int]) -> tuple[list[float], list[int]]:
        keys = sorted(int(k) for k in buckets)
        return [k * width for k in keys], [buckets[str(k)] for k in keys]

    x, y = minutes(load["requests_per_bucket"])
    top.bar(x, y, width=width, align="edge", color="#4c78a8", label="requests started")
    x, y = minutes(load["first_failures_per_bucket"])
    top.bar(x, y, width=width, align="edge", color="#f58518", label="first attempts failed (retried)")
    top.set_ylabel(f"per {load['bucket_s']:.0f} s")
    top.set_title(f"loraplane soak: {report['plan']['minutes']} min, {report['verdict']}; "
                  f"{load['counts']['answers']} answers, {load['counts']['failed']} failed after retry, "
                  f"{load['counts']['wrong_version']} wrong versions")  # fmt: skip

    series: dict[str, list[dict]] = {}
    for s in samples:
        series.setdefault(s["pod"], []).append(s)
    for pod, points in sorted(series.items()):
        style = "-" if points[0]["kind"] == "server" else "--"
        ts = [p["t"] / 60 for p in points]
        (line,) = mid.plot(ts, [p["rss"] / 2**20 for p in points], style, label=pod, linewidth=1)
        low.plot(ts, [p["fds"] for p in points], style, linewidth=1, color=line.get_color())
        low.plot(ts, [p["threads"] for p in points], ":", linewidth=1, color=line.get_color())
    mid.set_ylabel("RSS (MiB)")
    low.set_ylabel("fds (solid/dashed), threads (dotted)")
    low.set_xlabel("minutes since the load started")

    for event in report["faults"]:
        color = "red" if event["kind"] == "kill_pod" else "purple"
        for axis in (top, mid, low):
            axis.axvline(event["t"] / 60, color=color, alpha=0.6, linewidth=1)
    for event in report["bumps"]:
        top.axvline(event["t"] / 60, color="grey", alpha=0.25, linewidth=0.8, linestyle=":")
    top.plot([], [], color="red", label="server Pod killed")
    top.plot([], [], color="purple", label="operator killed")
    top.plot([], [], color="grey", linestyle=":", label="version bump")
    top.legend(loc="upper right", fontsize=8)
    mid.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
