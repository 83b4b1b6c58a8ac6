"""The churn benchmark's report: the engine-vs-base and TTFT-vs-floor summary, the table's columns, the notes.

``b`` is the run's ``Bench`` (main.py): its adapter sizes and where the adapter files were written.
"""

from __future__ import annotations

import torch


def summarize(rows: list[dict], floors: dict, b) -> dict:
    base = {
        r["alpha"]: r for r in rows if r["section"] == "slora" and r["case"].startswith("S-LoRA trace base")
    }
    base_row = base.get(None)
    peft = {r["alpha"]: r for r in rows if r.get("peft")}
    engine = {}
    for r in rows:
        if r.get("peft"):
            continue
        if r["section"] == "slora" and r["alpha"] is not None and base_row:
            if (
                r["alpha"] in peft
            ):  # the same trace's first requests, served one at a time by transformers + PEFT
                engine.setdefault(f"alpha={r['alpha']}", {})["throughput_vs_peft"] = (
                    r["tok_s"] / peft[r["alpha"]]["tok_s"]
                )
            engine.setdefault(f"alpha={r['alpha']}", {}).update({
                "throughput_vs_base": r["tok_s"] / base_row["tok_s"],
                "ttft_p50_vs_base": r["ttft_p50_ms"] / base_row["ttft_p50_ms"],
                "ttft_p99_vs_base": r["ttft_p99_ms"] / base_row["ttft_p99_ms"],
                "tok_s": r["tok_s"], "base_tok_s": base_row["tok_s"], "failed": r["failed"],
            })  # fmt: skip
    ttft = {r["state"]: {} for r in rows if r["section"] == "ttft"}
    for r in rows:
        if r["section"] == "ttft" and r["case"].startswith("LoRA"):
            ttft[r["state"]][r["tier"]] = r["ttft_ms"]
    base_ttft = {
        r["state"]: r["ttft_ms"] for r in rows if r["section"] == "ttft" and r["case"].startswith("base")
    }
    nbytes = b.adapter_bytes(16)
    step = floors.get("decode_step_ms", 0.0)
    floor = {}
    for state, bt in base_ttft.items():
        extra = step if state == "loaded" else 0.0
        floor[state] = {"gpu": bt, "host": bt + nbytes / floors["pcie_gbs"] / 1e6 + extra,
                        "disk": bt + nbytes / floors["disk_gbs"] / 1e6 + nbytes / floors["pcie_gbs"] / 1e6 + extra}  # fmt: skip
    return {"engine": engine, "ttft_ms": ttft, "ttft_floor_ms": floor, "base_ttft_ms": base_ttft,
            "adapter_bytes": nbytes, "floors": floors}  # fmt: skip


def report(rows: list[dict], floors: dict, b) -> dict:
    summary = summarize(rows, floors, b)
    return {
        "title": "Adapter churn: Llama-3-8B-shaped, random bf16 weights and adapters, one GPU",
        "columns": [
            "case",
            "ttft_ms",
            "tok_s",
            "vs_no_loads",
            "loads",
            "step_ms_p50",
            "step_ms_max",
            "own_ms_p50",
            "own_ms_p99",
            "in_steps_s",
            "outside_steps_s",
            "triton_compiles",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "failed",
            "disk_loads",
            "max_loads_in_flight",
            "load_read_ms_p50",
            "load_hash_ms_p50",
            "load_stack_ms_p50",
            "working_set_gb",
        ],  # fmt: skip
        "rows": rows,
        "summary": summary,
        "meta": {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (--quick)",
            "torch": torch.__version__,
            "disk read GB/s (O_DIRECT)": round(floors["disk_gbs"], 2),
            "page cache read GB/s": round(floors["page_cache_gbs"], 2),
            "host-to-device GB/s (pinned)": round(floors["pcie_gbs"], 2),
            "page cache dropped between cold reads": floors["page_cache_dropped"],
            "adapter files": str(b.tmp),
            "capture policy (LoRA decode graphs)": floors.get("capture_policy"),
        },
        "notes": [
            "Every request goes through AsyncEngine (the serving loop of `loraplane serve`), driven by an asyncio "
            "client that submits each request at its arrival time and reads its stream.",
            "step_ms_*: gaps between consecutive step ends (idle waits included); own_ms_*: the engine's step() "
            "itself; in_steps_s / outside_steps_s: the window's time inside steps and outside them (waiting for "
            "arrivals or loads, or the loop's own work); slowest_steps (JSON): the five longest steps' contents.",
            "TTFT floor: base TTFT + bytes / disk GB/s (disk tier) + bytes / host-to-device GB/s (disk and host "
            "tiers) + one decode step (the base trace's median inter-token time) when loaded.",
            "TTFT, disk tier: the file is read past the page cache (dropped after the files were written when "
            "the machine allows it, else the engine reads with O_DIRECT). S-LoRA trace: every adapter is "
            "registered on the disk tier and loads from its own folder, whose weights file is a hard link to "
            "one file per rank, so the page cache serves those reads; the GPU pool and the host tier are "
            "smaller than the working set, so every load is a full read, hash, parse and copy.",
            "transformers + PEFT (the S-LoRA paper's baseline): the same model config with its own random "
            "weights, serving the trace's first requests one at a time, each loading its adapter from the same "
            "folder, generating greedily and dropping it; the summary's throughput_vs_peft divides the "
            "engine's tokens/s over the whole trace by that anchor's.",
        ],
    }
