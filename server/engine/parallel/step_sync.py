"""What rank 0 sends every worker each step: the runner's prepared inputs as two int64 tensors.

A fixed-size header (the op and every length), then one flat payload; both go by ``broadcast``, on the
device (NCCL) or the host (gloo). No pickling: the workers rebuild ``StepInputs`` from integers only.
Workers never see sequences or the scheduler; the block ids in the payload are rank 0's decisions.
"""

from __future__ import annotations

import torch

from ..attention import AttentionMetadata, PrefillSpan
from ..model_runner import StepInputs
from .group import TPGroup

OP_STOP, OP_STEP = 0, 1
_HEADER = 10  # op, T, S, gather, spans, decode rows, table width, flags, chunks, spare
_DECODE_ONLY, _HAS_DECODE, _DECODE_ROWS = 1, 2, 4


def encode_step(inp: StepInputs, num_chunks: int) -> tuple[list[int], torch.Tensor]:
    """(header, payload on the inputs' device) for ``inp``; ``num_chunks`` lets workers take the same path."""
    meta = inp.meta
    T, S = inp.input_ids.numel(), inp.logits_indices.numel()
    gather = meta.gather_slots if meta.gather_slots is not None else inp.input_ids.new_empty(0)
    spans = [v for s in meta.prefill for v in (s.q_start, s.q_len, s.ctx_len, s.gather_start)]
    parts = [inp.input_ids, inp.positions, meta.slot_mapping, inp.logits_indices, gather]
    parts.append(torch.tensor(spans, dtype=torch.int64).to(inp.input_ids.device))
    flags, n_dec, width = _DECODE_ONLY * inp.decode_only, 0, 0
    if meta.block_tables is not None:
        n_dec, width = meta.block_tables.shape
        flags |= _HAS_DECODE
        parts += [meta.block_tables.flatten().long(), meta.seq_lens.long()]
        if meta.decode_rows is not None:
            flags |= _DECODE_ROWS
            parts.append(meta.decode_rows)
    header = [OP_STEP, T, S, gather.numel(), len(meta.prefill), n_dec, width, flags, num_chunks, 0]
    return header, torch.cat(parts)


def payload_size(header: list[int]) -> int:
    _, T, S, n_gather, n_spans, n_dec, width, flags, _, _ = header
    size = 3 * T + S + n_gather + 4 * n_spans
    if flags & _HAS_DECODE:
        size += n_dec * width + n_dec + (n_dec if flags & _DECODE_ROWS else 0)
    return size


def decode_step(header: list[int], payload: torch.Tensor) -> tuple[StepInputs, int]:
    """Inverse of ``encode_step``: (StepInputs, number of chunks)."""
    _, T, S, n_gather, n_spans, n_dec, width, flags, num_chunks, _ = header
    cuts = [T, T, T, S, n_gather, 4 * n_spans]
    if flags & _HAS_DECODE:
        cuts += [n_dec * width, n_dec] + ([n_dec] if flags & _DECODE_ROWS else [])
    pieces = payload.split(cuts)
    ids, positions, slots, logits_indices, gather, spans = pieces[:6]
    flat_spans = spans.tolist()
    meta = AttentionMetadata(
        slot_mapping=slots,
        prefill=[PrefillSpan(*flat_spans[i : i + 4]) for i in range(0, len(flat_spans), 4)],
        gather_slots=gather if n_gather else None,
    )
    if flags & _HAS_DECODE:
        meta.block_tables = pieces[6].view(n_dec, width).int()
        meta.seq_lens = pieces[7].int()
        meta.decode_rows = pieces[8] if flags & _DECODE_ROWS else None
    return StepInputs(ids, positions, meta, logits_indices, bool(flags & _DECODE_ONLY)), num_chunks


def send(tp: TPGroup, header: list[int], payload: torch.Tensor | None = None) -> None:
    """Rank 0: the header, then (for a step) its payload."""
    tp.broadcast_(torch.tensor(header, dtype=torch.int64, device=tp.device))
    if payload is not None:
        tp.broadcast_(payload.to(tp.device).contiguous())


def receive(tp: TPGroup) -> tuple[list[int], torch.Tensor | None]:
    """Workers: the header, then the payload when the op is a step."""
    header_t = tp.broadcast_(torch.empty(_HEADER, dtype=torch.int64, device=tp.device))
    header = header_t.tolist()
    if header[0] != OP_STEP:
        return header, None
    payload = torch.empty(payload_size(header), dtype=torch.int64, device=tp.device)
    return header, tp.broadcast_(payload)


def stop_header() -> list[int]:
    return [OP_STOP] + [0] * (_HEADER - 1)
