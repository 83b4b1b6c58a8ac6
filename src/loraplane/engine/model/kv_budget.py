"""How many KV blocks fit: the device memory left after the weights, the adapter pools and one profiled
forward at the largest step size, less a reserve for what the profile does not see.

Functions over the ``ModelRunner`` that is being built (its config, model, layout and device).
"""

from __future__ import annotations

import torch

from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan

_GRAPH_RESERVE_BYTES = 1 << 30  # graphs, sampler temporaries, cuBLAS/Triton workspaces outside the profile


def free_device_memory(runner) -> int:
    """Free device bytes before the weights load (0 off CUDA); notes what is allocated already, so that the
    profile counts only what the runner adds."""
    if runner.device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    runner._allocated_before = torch.cuda.memory_allocated()
    return torch.cuda.mem_get_info()[0]


def num_split_kv_blocks(runner, free_before: int) -> int:
    """KV blocks of the split memory mode: the config's count, the CPU cap, or what the profile leaves."""
    if runner.config.num_kv_blocks is not None:
        return runner.config.num_kv_blocks
    if runner.device.type != "cuda":  # no more than every sequence at full length can hold: a tiny model's
        # 1 GiB default would be mostly never-touched blocks (about 1 GB of a test server's RSS)
        enough = runner.config.max_num_seqs * runner.max_blocks_per_seq
        return max(1, min(runner.config.cpu_kv_cache_bytes // runner.kv_block_bytes, enough))
    profile_forward(runner)
    used = torch.cuda.max_memory_allocated() - runner._allocated_before  # weights + peak activations
    budget = int(free_before * runner.config.gpu_memory_utilization) - used - graph_reserve_bytes(runner)
    if budget < runner.kv_block_bytes * runner.max_blocks_per_seq:
        raise ValueError(
            f"EngineConfig.gpu_memory_utilization: {runner.config.gpu_memory_utilization} leaves "
            f"{budget / 2**30:.2f} GiB for KV, less than one sequence of max_model_len={runner.max_model_len}"
        )
    return budget // runner.kv_block_bytes


def graph_reserve_bytes(runner) -> int:
    """What graphs and workspaces take outside the profile: a fixed reserve, plus each extra LoRA
    family's logits buffers (fp32, every bucket)."""
    cfg = runner.config
    if cfg.enforce_eager or not cfg.enable_lora or runner.tp is not None:
        return _GRAPH_RESERVE_BYTES
    rows = sum(s for s in cfg.cuda_graph_batch_sizes if s <= cfg.max_num_seqs)
    families = len({frozenset(s) for s in cfg.lora_graph_module_sets})
    return _GRAPH_RESERVE_BYTES + families * rows * runner.vocab_size * 4


@torch.inference_mode()
def profile_forward(runner) -> None:
    """One forward at the largest step size (empty cache: no KV writes) to measure peak activations."""
    T = min(runner.config.max_num_batched_tokens, runner.config.max_num_seqs * runner.max_model_len)
    spans, row = [], 0
    while row < T:
        n = min(runner.max_model_len, T - row)
        spans.append(PrefillSpan(row, n, n, -1))
        row += n
    ids = torch.randint(0, runner.vocab_size, (T,), device=runner.device)
    positions = torch.cat([torch.arange(s.q_len, device=runner.device) for s in spans])
    meta = AttentionMetadata(slot_mapping=torch.full((T,), -1, device=runner.device), prefill=spans)
    rows = torch.arange(min(T, runner.config.max_num_seqs), device=runner.device)
    runner.model(ids, positions, meta, rows)
    torch.cuda.synchronize()
