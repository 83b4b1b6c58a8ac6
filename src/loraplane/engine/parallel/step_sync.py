"""What rank 0 sends every worker each step: the runner's prepared inputs as two int64 tensors.

A fixed-size header (the op and every length), then one flat payload; both go by ``broadcast``, on the
device (NCCL) or the host (gloo). No pickling: the workers rebuild ``StepInputs`` from integers only.
Workers never see sequences or the scheduler; the block ids in the payload are rank 0's decisions.
"""

from __future__ import annotations

import torch

from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan
from loraplane.engine.model.step_inputs import StepInputs
from loraplane.engine.parallel.group import TPGroup

OP_STOP, OP_STEP, OP_COPY, OP_EVICT = 0, 1, 2, 3  # COPY / EVICT: adapter moves (lora_sync.py)
_HEADER = 10  # op, T, S, gather, spans, decode rows, table width, flags, chunks, adapter step kind
_LORA_ROW = 2  # per chunk of a step with adapters: its tokens and its adapter's slot (-1: none)
_DECODE_ONLY, _HAS_DECODE, _DECODE_ROWS = 1, 2, 4


def encode_step(inp: StepInputs, num_chunks: int, lora_kind: int = 0,
                lora_table: list[int] | tuple = ()) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """(header, payload on the inputs' device) for ``inp``; ``num_chunks`` lets workers take the same path;
    ``lora_kind``/``lora_table``: the step's adapter slots (lora_sync.step_slots)."""
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
    if lora_kind:
        parts.append(torch.tensor(lora_table, dtype=torch.int64).to(inp.input_ids.device))
    header = [OP_STEP, T, S, gather.numel(), len(meta.prefill), n_dec, width, flags, num_chunks, lora_kind]
    return header, torch.cat(parts)


def payload_size(header: list[int]) -> int:
    if header[0] != OP_STEP:
        return header[1]  # adapter moves: their integer description
    _, T, S, n_gather, n_spans, n_dec, width, flags, num_chunks, lora_kind = header
    size = 3 * T + S + n_gather + 4 * n_spans + (num_chunks * _LORA_ROW if lora_kind else 0)
    if flags & _HAS_DECODE:
        size += n_dec * width + n_dec + (n_dec if flags & _DECODE_ROWS else 0)
    return size


def decode_step(header: list[int], payload: torch.Tensor) -> tuple[StepInputs, int, list[int]]:
    """Inverse of ``encode_step``: (StepInputs, number of chunks, adapter slot table)."""
    _, T, S, n_gather, n_spans, n_dec, width, flags, num_chunks, lora_kind = header
    lora_size = num_chunks * _LORA_ROW if lora_kind else 0
    payload, lora = payload.split([payload.numel() - lora_size, lora_size])
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
    inp = StepInputs(ids, positions, meta, logits_indices, bool(flags & _DECODE_ONLY))
    return inp, num_chunks, lora.tolist()


def send(tp: TPGroup, header: list[int], payload: torch.Tensor | None = None) -> None:
    """Rank 0: the header, then (for a step) its payload."""
    tp.broadcast_(torch.tensor(header, dtype=torch.int64, device=tp.device))
    if payload is not None:
        tp.broadcast_(payload.to(tp.device).contiguous())


def send_op(tp: TPGroup, op: int, info: list[int], tensors: list[torch.Tensor]) -> None:
    """Rank 0: an adapter move: its integers, then its tensors (the receiver knows their shapes)."""
    send(tp, [op, len(info)] + [0] * (_HEADER - 2), torch.tensor(info, dtype=torch.int64))
    for t in tensors:
        tp.broadcast_(t.to(tp.device).contiguous())


def receive(tp: TPGroup) -> tuple[list[int], torch.Tensor | None]:
    """Workers: the header, then the payload (none for stop); an adapter move's tensors follow."""
    header_t = tp.broadcast_(torch.empty(_HEADER, dtype=torch.int64, device=tp.device))
    header = header_t.tolist()
    if header[0] == OP_STOP:
        return header, None
    payload = torch.empty(payload_size(header), dtype=torch.int64, device=tp.device)
    return header, tp.broadcast_(payload)


def stop_header() -> list[int]:
    return [OP_STOP] + [0] * (_HEADER - 1)
