"""The loader thread's CPU work per adapter, without a GPU: ``load_adapter_weights`` on Llama-3-8B-shaped PEFT
files (bf16, every module, ranks {8, 16, 32, 64}, ``lora_alpha`` 2r so every module has a scale to apply), read
from the page cache, on one CPU thread per load as the engine's loader workers run. The second and later
loads of a file take the known-layout path (one gather per factor), which is the one a busy server runs.
Reports the median read, stack (gather, scale, finiteness check) and hash times per rank, and the stack rate.

    PYTHONPATH=src python bench/churn/parse_cost.py [--loads 5] [--dir /tmp/parse-cost]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import LLAMA3_8B  # noqa: E402

from loraplane.engine.lora.weights import load_adapter_weights, module_shapes  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402

RANKS = (8, 16, 32, 64)
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, cfg: ModelConfig, rank: int) -> Path:
    """A PEFT folder of random bf16 factors for every module and layer."""
    folder.mkdir(parents=True, exist_ok=True)
    gen, tensors = torch.Generator().manual_seed(rank), {}
    for layer in range(cfg.num_layers):
        for m, (fan_in, fan_out) in module_shapes(cfg).items():
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PARENT)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench churn parse_cost")
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument(
        "--dir", default=None, help="where the adapter files go (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the loader workers on a GPU host
    cfg = ModelConfig.from_dict(LLAMA3_8B, max_model_len=2048)
    root = Path(args.dir or tempfile.mkdtemp(prefix="parse-cost-"))
    rows = []
    for rank in RANKS:
        folder = write_adapter(root / f"r{rank}", cfg, rank)
        load_adapter_weights(folder, cfg, max_rank=64, dtype=torch.bfloat16)  # learns the layout
        times = {"read": [], "stack": [], "hash": []}
        for _ in range(args.loads):
            w = load_adapter_weights(folder, cfg, max_rank=64, dtype=torch.bfloat16)
            w.digest()
            for k in times:
                times[k].append(w.timings[k] * 1e3)
        mb = w.nbytes / 1e6
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"rank": rank, "adapter_mb": round(mb, 1), **{f"{k}_ms": round(v, 1) for k, v in med.items()},
                     "stack_gbs": round(mb / med["stack"], 2)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows}


if __name__ == "__main__":
    main()
