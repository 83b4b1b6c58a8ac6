"""One step's inputs: the scheduled chunks flattened into one token batch, every index tensor built once
(token ids, positions, KV slots, block tables, context lengths, rows to score) and shared by the layers
through ``AttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64 rows whose next token is sampled
    decode_only: bool


def prepare_step(batch, block_size: int, max_model_len: int, device: torch.device) -> StepInputs:
    """Flatten a step's chunks into one token batch and build every index tensor once."""
    bs, cuda = block_size, device.type == "cuda"
    ids: list[int] = []
    slots: list[int] = []
    positions: list[int] = []
    spans: list[PrefillSpan] = []
    gather: list[int] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    sample_rows: list[int] = []
    for chunk in batch.chunks:
        seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
        end, row, table = start + n, len(ids), seq.block_table
        if end > max_model_len:
            raise ValueError(f"sequence {seq.seq_id}: {end} tokens exceed max_model_len={max_model_len}")
        ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if n == 1 and cuda:
            dec_rows.append(row)
            dec_tables.append(table[: -(-end // bs)])
            dec_lens.append(end)
        elif start == 0:
            spans.append(PrefillSpan(row, n, n, -1))
        else:
            spans.append(PrefillSpan(row, n, end, len(gather)))
            gather.extend(table[p // bs] * bs + p % bs for p in range(end))
        if chunk.sample:
            sample_rows.append(row + n - 1)
    T = len(ids)
    pad, Tp, S = [0] * (T % 2), T + T % 2, len(sample_rows)
    # int64; positions and slots start 16-byte aligned for any T (Triton specialises pointer alignment)
    flat = torch.tensor(ids + pad + positions + pad + slots + sample_rows + gather + dec_rows)
    flat = flat.to(device, non_blocking=True)
    cuts = (Tp + T, 2 * Tp, 2 * Tp + T, 2 * Tp + T + S, 2 * Tp + T + S + len(gather))
    meta = AttentionMetadata(slot_mapping=flat[cuts[1] : cuts[2]], prefill=spans)
    if gather:
        meta.gather_slots = flat[cuts[3] : cuts[4]]
    decode_only = len(dec_rows) == len(batch.chunks)
    if dec_rows:
        width = max(len(t) for t in dec_tables)
        padded = [t + [0] * (width - len(t)) for t in dec_tables]
        meta.block_tables = torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True)
        meta.seq_lens = torch.tensor(dec_lens, dtype=torch.int32).to(device, non_blocking=True)
        meta.decode_rows = None if decode_only else flat[cuts[4] :]
    return StepInputs(flat[:T], flat[Tp : cuts[0]], meta, flat[cuts[2] : cuts[3]], decode_only)
