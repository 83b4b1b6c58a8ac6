"""Decode steps replayed from CUDA graphs captured per batch-size bucket.

A decode step of B sequences is padded to the smallest captured bucket >= B: padding rows get slot -1
(no KV write) and context length 0 (the decode kernel writes zeros), so they cost a few idle programs.
All graphs share one memory pool and one set of static input buffers, captured largest first.

With adapters the runner keeps several families of such graphs and ``graph_family`` picks one per
step: 'base' (captured without any LoRA launch: no token has an adapter), 'merged' (the base kernels on
the merged weights, engine/lora/merge.py: every token has the merged adapter) and 'lora' (LoRA launches
over fixed metadata buffers). The 'lora' family is captured once with every module's launches (it serves
any step) and once more per configured module set (``EngineConfig.lora_graph_module_sets``) with only
those modules' launches; ``lora_module_family`` picks the smallest one that covers the modules the
step's adapters have, so a step of q,v-only adapters launches nothing for o, gate, up and down.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Sequence

import torch

from loraplane.engine.model.attention import AttentionMetadata
from loraplane.engine.model.lora_warmup import compile_ahead
from loraplane.engine.model.model import CausalLM


class DecodeInputs:
    """Static decode inputs of up to ``n`` rows, padding until written (slot -1: no KV write; context 0)."""

    def __init__(self, n: int, max_blocks_per_seq: int, device: torch.device) -> None:
        # [n] each; block tables [n, max blocks per sequence]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)

    def forward(self, model: CausalLM, bs: int) -> torch.Tensor:
        """``model`` over the first ``bs`` rows: fp32 logits [bs, V]."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
        )
        return model(self.input_ids[:bs], self.positions[:bs], meta)


class DecodeGraphs(DecodeInputs):
    def __init__(self, model: CausalLM, batch_sizes: tuple[int, ...], max_blocks_per_seq: int,
                 device: torch.device, pool=None) -> None:  # fmt: skip
        """``pool``: a graph memory pool shared with another family (families never replay at once, so
        their temporaries may overlap); None: a pool of its own."""
        self.batch_sizes = tuple(sorted(batch_sizes))
        super().__init__(self.batch_sizes[-1], max_blocks_per_seq, device)  # the inputs, max bucket rows
        self.model = model
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [bucket, V] fp32 static outputs
        self.replays = 0  # steps served (which family served how many steps: benchmarks, tests)
        self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _run_model(self, bs: int) -> torch.Tensor:
        return self.forward(self.model, bs)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = self.pool
        for bs in reversed(self.batch_sizes):
            self._run_model(bs)  # warm-up: compiles the Triton kernels and sets up cuBLAS outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._run_model(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def bucket(self, batch_size: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Inputs for B <= max_batch_size rows (host or device tensors); block_tables [B, W]. Returns [B, V]."""
        B, W = block_tables.shape
        bs = self.bucket(B)
        self.input_ids[:B].copy_(input_ids, non_blocking=True)
        self.positions[:B].copy_(positions, non_blocking=True)
        self.slot_mapping[:B].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:B].copy_(seq_lens, non_blocking=True)
        self.block_tables[:B, :W].copy_(block_tables, non_blocking=True)
        if bs > B:  # padding rows: no KV write, empty context
            self.slot_mapping[B:bs].fill_(-1)
            self.seq_lens[B:bs].zero_()
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits[bs][:B]


def graph_family(adapters: Sequence[str | None], merged: bool, captured: Collection[str]) -> str:
    """The family of graphs that replays a decode step whose rows carry ``adapters`` (key or None):
    'merged' when the step runs on merged weights, 'base' when no row has an adapter, else 'lora'. A
    family that was not ``captured`` falls back to 'lora', whose LoRA launches serve any step."""
    if merged:
        family = "merged"
    elif all(a is None for a in adapters):
        family = "base"
    else:
        family = "lora"
    return family if family in captured else "lora"


def lora_module_family(used: Collection[str], families: Collection[frozenset[str]]) -> frozenset[str] | None:
    """The captured module set with the fewest modules that holds every module in ``used`` (the modules
    the step's adapters have); None when none does (the all-module graphs then serve the step)."""
    fits = [f for f in families if f.issuperset(used)]
    return min(fits, key=lambda f: (len(f), sorted(f)), default=None)


def capture_lora_families(model: CausalLM, sizes: tuple[int, ...], max_blocks_per_seq: int,
                          device: torch.device, state, graph_metas: Callable, module_sets,
                          compile_first: bool = True) -> tuple:  # fmt: skip
    """The LoRA decode graphs: (the all-module family, {module set: its family}), all in one memory pool.

    ``state``: the LoRAStepState the wrapped layers read while they are captured; ``graph_metas(modules)``:
    the fixed metadata per module (None: no launch) for a module set, or for every module given None;
    ``module_sets``: EngineConfig.lora_graph_module_sets (sets equal to all modules are skipped);
    ``compile_first``: compile every family's LoRA launches side by side before capturing
    (``lora_warmup.compile_ahead``; not under tensor parallel, whose workers capture in step)."""

    def family(modules: frozenset[str] | None, pool) -> DecodeGraphs:
        state.metas = graph_metas(modules)
        try:
            return DecodeGraphs(model, sizes, max_blocks_per_seq, device, pool=pool)
        finally:
            state.metas = dict.fromkeys(state.pools)

    every = frozenset(state.pools)
    sets = sorted(
        {frozenset(s) & every for s in module_sets} - {every, frozenset()}, key=lambda s: (len(s), sorted(s))
    )
    if compile_first:
        compile_ahead(lambda: _decode_forwards(model, sizes, max_blocks_per_seq, device, state, graph_metas,
                                               [None, *sets]))  # fmt: skip
    full = family(None, None)
    return full, {s: family(s, full.pool) for s in sets}


@torch.inference_mode()
def _decode_forwards(model: CausalLM, sizes: tuple[int, ...], max_blocks_per_seq: int, device: torch.device, state,
                     graph_metas: Callable, families: list) -> None:  # fmt: skip
    """The decode forwards a capture of each family runs: every bucket of padding rows (no KV written) over
    the family's fixed metadata. Every bucket, because some strides the launches pass (the shrink output's,
    from the bucket's rows) are specialized arguments; the queue keeps each shape once."""
    inputs = DecodeInputs(max(sizes), max_blocks_per_seq, device)
    for modules in families:
        state.metas = graph_metas(modules)
        try:
            for bs in sizes:
                inputs.forward(model, bs)
        finally:
            state.metas = dict.fromkeys(state.pools)
