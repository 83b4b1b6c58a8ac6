"""One step's sampling inputs: per-row tensors built once from the sampled sequences' SamplingParams.

A request's settings become rows of small tensors (temperatures, top-k, top-p, min-p, the (row, token) pairs
of its logit bias and of its min_tokens ban, its penalties), so the sampler processes the whole batch with a
few launches whatever each row asks for. The penalties need each request's prompt and output token counts:
those live on the device in ``PenaltyState`` rows, filled once when a request first samples and bumped by
one scatter per step with the sampled tokens, so no step rebuilds them from token lists.
"""

from __future__ import annotations

from itertools import chain, repeat

import torch

from loraplane.engine.model.sampler import GrammarRows, PenaltyRows, SamplingMetadata


class PenaltyState:
    """Per-request rows on the device: prompt_mask [R, V] bool (token in the prompt), counts [R, V] int32
    (occurrences in the output). Only requests with a penalty hold a row; rows are reused after release."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.slot_of: dict[int, int] = {}  # seq_id -> row
        self.free: list[int] = []

    def slots(self, seqs: list) -> list[int]:
        new = [seq for seq in seqs if seq.seq_id not in self.slot_of]
        if new:
            self._admit(new)
        return [self.slot_of[seq.seq_id] for seq in seqs]

    def _admit(self, seqs: list) -> None:
        short = len(seqs) - len(self.free)
        if short > 0:  # grow by doubling: a handful of reallocations over a server's life
            old = self.counts.shape[0]
            grow = max(short, old, 8)
            self.prompt_mask = torch.cat(
                [self.prompt_mask, self.prompt_mask.new_zeros(grow, self.vocab_size)]
            )
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
            self.free.extend(range(old + grow - 1, old - 1, -1))
        slots = [self.free.pop() for _ in seqs]
        self.slot_of.update((seq.seq_id, slot) for seq, slot in zip(seqs, slots, strict=True))
        index = torch.tensor(slots, device=self.device)
        self.prompt_mask[index] = False
        self.counts[index] = 0
        # A request preempted and recomputed keeps its row; a new one may already hold output tokens (none
        # today, but the counts must describe seq.output_token_ids whatever happened before).
        prompt_rows = list(
            chain.from_iterable(repeat(s, seq.num_prompt_tokens) for s, seq in zip(slots, seqs, strict=True))
        )
        prompt_ids = list(chain.from_iterable(seq.prompt_token_ids for seq in seqs))
        self.prompt_mask[_tensor(prompt_rows, self.device), _tensor(prompt_ids, self.device)] = True
        out_rows = list(
            chain.from_iterable(repeat(s, seq.num_output_tokens) for s, seq in zip(slots, seqs, strict=True))
        )
        if out_rows:
            out_ids = _tensor(list(chain.from_iterable(seq.output_token_ids for seq in seqs)), self.device)
            ones = torch.ones(len(out_rows), dtype=torch.int32, device=self.device)
            self.counts.index_put_((_tensor(out_rows, self.device), out_ids), ones, accumulate=True)

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            slot = self.slot_of.pop(seq_id, None)
            if slot is not None:
                self.free.append(slot)


def _tensor(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class SamplingBatch:
    """What sampling keeps between steps (seeded generators, penalty rows) and builds per step (metadata)."""

    def __init__(
        self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device, seed: int
    ) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.penalties = PenaltyState(vocab_size, device)
        self.bitmask_words = (vocab_size + 31) // 32
        self._bitmask = torch.empty(0, self.bitmask_words, dtype=torch.int32)  # host rows, reused per step

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
        self.penalties.release(seq_ids)

    def metadata(self, seqs: list) -> SamplingMetadata:
        """SamplingMetadata for the sampled sequences of one step, in row order."""
        params = [seq.sampling for seq in seqs]
        random = [p.temperature > 0 for p in params]
        all_greedy = not any(random)
        dev = torch.device("cpu") if all_greedy else self.device
        any_min_p = any(p.min_p > 0 for p, r in zip(params, random, strict=True) if r)
        return SamplingMetadata(
            temperatures=_tensor([float(p.temperature) for p in params], dev, torch.float32),
            top_ks=_tensor([p.top_k for p in params], dev),
            top_ps=_tensor([float(p.top_p) for p in params], dev, torch.float32),
            all_greedy=all_greedy,
            any_top_k=any(p.top_k > 0 for p, r in zip(params, random, strict=True) if r),
            any_top_p=any(p.top_p < 1.0 for p, r in zip(params, random, strict=True) if r),
            generators=self._generators(seqs),
            num_logprobs=[p.logprobs for p in params],
            min_ps=_tensor([float(p.min_p) for p in params], dev, torch.float32) if any_min_p else None,
            bias=self._bias(params),
            banned=self._banned(seqs),
            penalties=self._penalties(seqs),
            grammar=self._grammar(seqs),
        )

    def _generators(self, seqs: list) -> list[torch.Generator | None]:
        gens: list[torch.Generator | None] = []
        for seq in seqs:
            p = seq.sampling
            if p.seed is None or p.temperature == 0:
                gens.append(None)
                continue
            if seq.seq_id not in self.generators:
                self.generators[seq.seq_id] = torch.Generator(device=self.device).manual_seed(p.seed)
            gens.append(self.generators[seq.seq_id])
        return gens

    def _bias(self, params: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows [N], token ids [N], biases [N]) over every row's logit_bias, or None when no row has one."""
        if not any(p.logit_bias for p in params):
            return None
        rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
        pairs = [pair for p in params for pair in p.logit_bias]
        return (_tensor(rows, self.device), _tensor([t for t, _ in pairs], self.device),
                _tensor([float(b) for _, b in pairs], self.device, torch.float32))  # fmt: skip

    def _stop_ids(self, sampling) -> tuple[int, ...]:
        eos = () if sampling.ignore_eos else self.eos_token_ids
        return tuple(sampling.stop_token_ids) + eos

    def _banned(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) of the stop tokens of rows still short of min_tokens, or None."""
        short = [
            (row, seq) for row, seq in enumerate(seqs) if seq.num_output_tokens < seq.sampling.min_tokens
        ]
        if not short:
            return None
        rows, cols = [], []
        for row, seq in short:
            ids = self._stop_ids(seq.sampling)
            rows.extend(repeat(row, len(ids)))
            cols.extend(ids)
        if not rows:
            return None
        return _tensor(rows, self.device), _tensor(cols, self.device)

    def _penalties(self, seqs: list) -> PenaltyRows | None:
        rows = [row for row, seq in enumerate(seqs) if seq.sampling.penalized]
        if not rows:
            return None
        chosen = [seqs[row] for row in rows]
        slots = self.penalties.slots(chosen)
        table = [[row, slot, s.sampling.presence_penalty, s.sampling.frequency_penalty, s.sampling.repetition_penalty]
                 for row, slot, s in zip(rows, slots, chosen, strict=True)]  # fmt: skip
        packed = _tensor(table, self.device, torch.float32)  # [P, 5]: one transfer a step
        index = packed[:, :2].to(torch.int64)  # [P, 2] (row, slot), exact below 2**24
        return PenaltyRows(
            table=packed,
            rows=index[:, 0],
            slots=index[:, 1],
            prompt_mask=self.penalties.prompt_mask,
            counts=self.penalties.counts,
        )

    def _grammar(self, seqs: list) -> GrammarRows | None:
        """The constrained rows and their allowed-token bitmask [C, ceil(V / 32)] (each matcher fills its row on
        the host, one copy takes them to the device), or None when no row has a grammar."""
        rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):  # grows to the largest constrained batch seen, then stays
            pin = self.device.type == "cuda"
            self._bitmask = torch.empty(
                max(len(rows), 8), self.bitmask_words, dtype=torch.int32, pin_memory=pin
            )
        # The previous step's copy from this buffer is done: its tokens reached the host (sample's tolist).
        bitmask = self._bitmask[: len(rows)]
        bitmask.fill_(-1)
        for index, row in enumerate(rows):
            seqs[row].matcher.fill_next_token_bitmask(bitmask, index)
        return GrammarRows(
            rows=_tensor(rows, self.device), bitmask=bitmask.to(self.device, non_blocking=True)
        )
