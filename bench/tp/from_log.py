"""Rebuild a ``bench/run.py tp`` result from the ranks' progress lines, for a run whose ranks printed every row
but did not get to write the result file (for instance a rank that hung leaving its group afterwards).

The progress lines carry each row's step and comm times and the copy bandwidth; the per-GPU weight bytes
are counted again here from the shape (the sharded model built on the meta device, nothing allocated).

    python bench/tp/from_log.py LOG --section "70b bench" --shape llama3-70b --tp 2 --adapters 32 \\
        --out bench/tp/results --name tp-70b
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: run.py's markdown, the shapes
sys.path.insert(0, str(HERE))

from main import CTX, SHAPES, adapter_bytes, columns_and_notes  # noqa: E402
from run import markdown  # noqa: E402

from loraplane.engine.model.model_config import ModelConfig  # noqa: E402
from loraplane.engine.parallel.group import TPGroup  # noqa: E402
from loraplane.engine.parallel.layers import build_sharded_model  # noqa: E402

_ROW = re.compile(r"\[tp rank (\d+) [^\]]*\] B=(\d+) adapters=(\d+): step ([\d.]+) ms, comm ([\d.]+) ms")
_BW = re.compile(r"\[tp rank (\d+) [^\]]*\] copy bandwidth (\d+) GB/s")
_CHECK = re.compile(r"\[tp rank 0 [^\]]*\] graph replay vs eager at B=(\d+): (\{[^}]*\})")


def rebuild(text: str, shape: str, tp: int, adapters: int, rank: int = 0) -> dict:
    cfg = ModelConfig.from_dict(SHAPES[shape], max_model_len=CTX + 16)
    with torch.device("meta"):
        model = build_sharded_model(cfg, TPGroup(rank, tp, torch.device("meta")))
    weight_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if "embed" not in n)  # bf16
    kv_token = 2 * cfg.num_layers * (cfg.num_kv_heads // tp) * cfg.head_dim * 2
    bw = float(next(m.group(2) for m in _BW.finditer(text) if int(m.group(1)) == rank))
    rows, base_ms = [], {}
    for m in _ROW.finditer(text):
        if int(m.group(1)) != rank:
            continue
        B, n, step_ms, comm_ms = int(m.group(2)), int(m.group(3)), float(m.group(4)), float(m.group(5))
        floor = (weight_bytes + B * CTX * kv_token + n * adapter_bytes(cfg, tp)) / bw / 1e6 + comm_ms
        row = {"case": f"decode B={B} ctx={CTX}", "tp": tp, "batch": B, "adapters": n, "step_ms": step_ms,
               "comm_ms": comm_ms, "floor_ms": floor, "x_floor": step_ms / floor}  # fmt: skip
        if n:
            row["x_base"] = step_ms / base_ms[B]
        else:
            base_ms[B] = step_ms
        rows.append(row)
    meta = {"shape": shape, "tensor_parallel_size": tp, "adapters": f"{adapters} x rank 16",
            "dtype": "torch.bfloat16", "device": "NVIDIA H200", "per-GPU weight GB": weight_bytes / 1e9,
            "copy GB/s": bw, "rebuilt from": "the ranks' progress lines (see notes)"}  # fmt: skip
    check = _CHECK.search(text)
    if check:
        meta[f"graph replay vs eager logits, rel. norm error (B={check.group(1)})"] = check.group(2)
    return {"rows": rows, "meta": meta}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("--section", required=True, help="text of the '=== ... ' line that starts the run")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--adapters", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--note", action="append", default=[])
    args = p.parse_args()
    text = Path(args.log).read_text()
    start = text.index(args.section)
    end = text.find("\n=== ", start + len(args.section))
    out = rebuild(text[start : end if end > 0 else None], args.shape, args.tp, args.adapters)
    columns, notes = columns_and_notes(args.adapters, with_tp1=False)
    result = {"title": f"Tensor-parallel decode step: {args.shape}, TP={args.tp}, {args.adapters} adapters",
              "columns": [c for c in columns if c != "all_reduce_us"], "rows": out["rows"], "meta": out["meta"],
              "notes": notes + args.note}  # fmt: skip
    Path(args.out, f"{args.name}.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    Path(args.out, f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
