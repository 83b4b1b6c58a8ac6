"""The only owner of the device: loads the model, holds the paged KV cache, runs one scheduled step.

Per step the runner flattens the scheduled chunks into one token batch (``step_inputs.prepare_step``);
decode-only steps replay a CUDA graph when one fits. The KV cache is sized by ``kv_budget``.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from loraplane.engine.lora.layers import LoRAStepState, wrap_model
from loraplane.engine.lora.manager import AdapterTiers
from loraplane.engine.lora.merge import AdapterMerger, MergePolicy
from loraplane.engine.lora.residency import NullResidency
from loraplane.engine.memory.layout import memory_layout
from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan, paged_decode
from loraplane.engine.model.cuda_graphs import (
    DecodeGraphs,
    capture_lora_families,
    graph_family,
    lora_module_family,
)
from loraplane.engine.model.kv_budget import free_device_memory, num_split_kv_blocks
from loraplane.engine.model.lora_warmup import warm_lora_kernels
from loraplane.engine.model.model import CausalLM
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.sampler import sample
from loraplane.engine.model.sampling_batch import SamplingBatch
from loraplane.engine.model.step_inputs import StepInputs, prepare_step
from loraplane.engine.model.weights import base_hash, load_model

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the sampled token, when requested
    top_logprobs: dict[int, float] | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("EngineConfig.device: 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _eos_ids(model_dir: Path, cfg: ModelConfig) -> tuple[int, ...]:
    ids = list(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for t in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if t not in ids:
                ids.append(int(t))
    return tuple(ids)


class ModelRunner:
    def __init__(
        self, config, *, model: CausalLM | None = None, model_config: ModelConfig | None = None, tp=None
    ) -> None:
        """``model``/``model_config``: an already built model (benchmarks with random weights); else load.
        ``tp``: this rank's parallel.TPGroup (None: one process); the model and KV cache are then its shard."""
        self.config = config
        self.tp = tp  # TP hook: see parallel/launch.py
        self.tp_driver = None  # TP hook: rank 0 sends each step to the workers once serving
        self.device = tp.device if tp is not None else resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        cfg = model_config or ModelConfig.from_pretrained(config.model, config.max_model_len)
        full_cfg = cfg
        self.full_model_config = cfg  # TP hook: adapters are parsed and checked whole, then sharded
        if tp is not None:  # TP hook: this rank's heads and MLP columns; the vocabulary stays whole
            from loraplane.engine.parallel.group import shard_config

            cfg = shard_config(cfg, tp.size)
        self.model_config = cfg
        self.max_model_len = config.max_model_len or cfg.default_max_model_len()
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        self.block_size = config.block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = _eos_ids(Path(config.model), cfg)
        free_before = free_device_memory(self)
        if model is None and tp is not None:  # TP hook: each rank reads only its slices
            from loraplane.engine.parallel.loader import load_sharded_model

            self.model = load_sharded_model(config.model, full_cfg, tp, self.device, self.dtype)
            self.base_hash = base_hash(config.model) if tp.is_driver else "worker"  # rank 0 reports it
        elif model is None:
            self.model = load_model(config.model, cfg, self.device, self.dtype)
            self.base_hash = base_hash(config.model)
        else:
            self.model, self.base_hash = model, "in-memory"
        self.model.init_rope(self.max_model_len, self.device)
        self.layout = memory_layout(config, cfg, self.block_size, self.dtype, self.device)
        self._init_lora(self.layout.pools_before_kv())  # before KV sizing: the split's pools come first
        self.merger = self._new_merger()  # before KV sizing too: its merged weights come out of KV's share
        self.num_kv_blocks = self.layout.kv_blocks(num_split_kv_blocks(self, free_before))
        if tp is not None:  # TP hook: one block table for all ranks, so the same number of blocks
            self.num_kv_blocks = tp.min_int(self.num_kv_blocks)
        self._allocate_kv_cache()
        if self.merger is not None:
            self.merger.bind(self.lora, self.lora_state)
        self.sampling = SamplingBatch(self.vocab_size, self.eos_token_ids, self.device, config.seed)
        self.graphs: DecodeGraphs | None = None
        self.base_graphs: DecodeGraphs | None = None
        self.merged_graphs: DecodeGraphs | None = None
        self.module_graphs: dict[frozenset[str], DecodeGraphs] | None = None  # LoRA graphs of module sets
        if self.device.type == "cuda":
            self._compile_step_kernels()
        if self.device.type == "cuda" and not config.enforce_eager:
            sizes = tuple(s for s in config.cuda_graph_batch_sizes if s <= config.max_num_seqs)
            if sizes:
                self._capture_graphs(sizes)
        if (
            self.device.type == "cuda"
            and self.lora is not None
            and config.lora_kernel_warmup
            and self.tp is None
        ):
            self._warm_lora_kernels()

    # ------------------------------------------------------------------------------------ adapters
    def _init_lora(self, pools) -> None:
        """The adapter tiers over ``pools`` (one per PEFT module; None: none yet), the LoRA wrappers and the
        residency."""
        self.lora: AdapterTiers | None = None
        self.lora_state: LoRAStepState | None = None
        self.residency = NullResidency()
        if pools is not None:
            self._attach_lora(pools)

    def _new_merger(self) -> AdapterMerger | None:
        """The dominant adapter's merged weights (lora_merge), one copy of every projection weight."""
        cfg = self.config
        if not (cfg.lora_merge and cfg.enable_lora) or self.tp is not None:
            return None
        return AdapterMerger(self.model, MergePolicy(cfg.lora_merge_after_steps, cfg.lora_merge_stay_share))

    def _attach_lora(self, pools, gpu_tier=None) -> None:
        cfg = self.config
        graph_bs = 0
        if self.device.type == "cuda" and not cfg.enforce_eager:
            graph_bs = max((s for s in cfg.cuda_graph_batch_sizes if s <= cfg.max_num_seqs), default=0)
        self.lora = AdapterTiers(self.full_model_config, pools, max_rank=cfg.max_lora_rank,
                                   host_bytes=cfg.lora_host_bytes, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_num_seqs=cfg.max_num_seqs,
                                   graph_batch_size=graph_bs, gpu_tier=gpu_tier)  # fmt: skip
        self.lora_state = LoRAStepState(pools)
        wrap_model(self.model, self.lora_state)
        self.residency = self.lora

    def _capture_graphs(self, sizes: tuple[int, ...]) -> None:
        """Decode graphs; with adapters, several families: base-only steps replay graphs without LoRA
        launches, merged steps the base kernels on the merged weights, steps with adapters graphs holding
        the LoRA launches of the modules they use (cuda_graphs.py)."""
        self.base_graphs: DecodeGraphs | None = None
        if self.lora is None:
            self.graphs = DecodeGraphs(self.model, sizes, self.max_blocks_per_seq, self.device)
            return
        self.base_graphs = DecodeGraphs(self.model, sizes, self.max_blocks_per_seq, self.device)
        if self.merger is not None:  # the base kernels on the merged weights: steps of the merged adapter
            self.lora_state.merged = True
            try:
                self.merged_graphs = DecodeGraphs(self.model, sizes, self.max_blocks_per_seq, self.device)
            finally:
                self.lora_state.merged = False
        self.capture_lora_graphs(sizes)

    def capture_lora_graphs(self, sizes: tuple[int, ...]) -> None:
        """The graphs of steps with adapters (under the current capture policy): the all-module family and
        one per configured module set; none of the latter under tensor parallel (the workers replay the
        all-module family)."""
        self.graphs = self.module_graphs = None
        gc.collect()  # the graphs of an earlier capture give their memory back first
        torch.cuda.empty_cache()
        sets = [] if self.tp is not None else self.config.lora_graph_module_sets
        self.graphs, self.module_graphs = capture_lora_families(
            self.model,
            sizes,
            self.max_blocks_per_seq,
            self.device,
            self.lora_state,
            self.lora.graph_metas,
            sets,
            compile_first=self.tp is None,
        )

    def _lora_graphs(self) -> DecodeGraphs:
        """The LoRA family for the step just prepared: the smallest captured module set that covers the
        modules its adapters have, else the all-module graphs."""
        if self.module_graphs:
            modules = lora_module_family(self.lora.step_modules, self.module_graphs)
            if modules is not None:
                return self.module_graphs[modules]
        return self.graphs

    def _set_lora_step(self, batch, kind: str) -> None:
        if self.lora is not None:
            chunks = [(getattr(c.seq, "adapter", None), c.num_tokens) for c in batch.chunks]
            self.lora_state.metas = self.lora.prepare_step(chunks, kind)

    def _tp_send(self, inp: StepInputs, batch, kind: str | None) -> None:
        """TP hook: the workers run the same step (after prepare_step: its adapter moves went first)."""
        if self.tp_driver is not None:
            self.tp_driver.send_step(inp, batch, kind, self.lora)

    @torch.inference_mode()
    def warm_adapter(self, key: str, num_tokens: int = 8) -> float:
        """Make ``key`` GPU-resident and run one real forward through it (no KV written); returns seconds.
        Raises AdapterError('WarmFailed') when the logits are not finite."""
        from loraplane.engine.api import AdapterError

        start = time.perf_counter()
        ids = torch.arange(1, num_tokens + 1, device=self.device) % self.vocab_size  # [n]
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(slot_mapping=torch.full((num_tokens,), -1, device=self.device),
                                 prefill=[PrefillSpan(0, num_tokens, num_tokens, -1)])  # fmt: skip
        batch = SimpleNamespace(
            chunks=[SimpleNamespace(seq=SimpleNamespace(adapter=key), num_tokens=num_tokens)]
        )
        self._set_lora_step(batch, "prefill")
        rows = torch.arange(num_tokens, device=self.device)
        self._tp_send(StepInputs(ids, positions, meta, rows, False), batch, "prefill")
        logits = self.model(ids, positions, meta, rows)
        if not bool(torch.isfinite(logits).all()):
            raise AdapterError("WarmFailed", f"adapter {key!r}: a forward through it gave non-finite logits")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    # ------------------------------------------------------------------------------------ KV cache
    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def kv_block_bytes(self) -> int:
        return self.layout.kv_block_bytes

    def _allocate_kv_cache(self) -> None:
        """The KV cache, the memory arbiter that hands out its blocks, and the pools built with it."""
        placed = self.layout.allocate(self.num_kv_blocks)
        self.memory = placed.memory
        for layer, (k_cache, v_cache) in zip(self.model.model.layers, placed.kv_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache
        if placed.pools is not None:
            self._attach_lora(placed.pools, placed.gpu_tier)

    @torch.inference_mode()
    def _compile_step_kernels(self) -> None:
        """Run each step shape once so that Triton compiles its kernels now, not inside the first requests:
        a mixed step (fresh prefill, continued chunk, decode row with a 3-block table) and the decode kernel
        at every split count. It writes KV only into blocks no sequence owns yet."""
        bs = self.block_size
        if self.num_kv_blocks < 9:
            return
        seqs = [SimpleNamespace(token_ids=[1] * (2 * bs + 1), block_table=[3 * i, 3 * i + 1, 3 * i + 2])
                for i in range(3)]  # fmt: skip
        chunks = [
            SimpleNamespace(seq=seqs[0], start=0, num_tokens=2 * bs + 1, sample=True),
            SimpleNamespace(seq=seqs[1], start=bs, num_tokens=bs + 1, sample=True),
            SimpleNamespace(seq=seqs[2], start=2 * bs, num_tokens=1, sample=True),
        ]
        self.forward_logits(SimpleNamespace(chunks=chunks))
        layer = self.model.model.layers[0].self_attn
        cfg = self.model_config
        q = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        tables = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=self.device)
        lens = torch.tensor([2 * bs + 1], dtype=torch.int32, device=self.device)
        for splits in (1, 2, 4, 8, 16):
            paged_decode(q, layer.k_cache, layer.v_cache, tables, lens, 1.0, num_splits=splits)
        torch.cuda.synchronize()

    def _warm_lora_kernels(self) -> None:
        """Compile the eager LoRA launches (lora_warmup.py): prefill and mixed steps always; decode steps
        too when some decode batch is not served by a captured graph."""
        eager_decode = self.graphs is None or self.graphs.max_batch_size < self.config.max_num_seqs
        kinds = ("prefill", "decode") if eager_decode else ("prefill",)
        warm_lora_kernels(self, kinds)

    # --------------------------------------------------------------------------------------- inputs
    def _prepare(self, batch) -> StepInputs:
        return prepare_step(batch, self.block_size, self.max_model_len, self.device)

    # ---------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def forward_logits(self, batch) -> torch.Tensor:
        """Run the model on one scheduled step; fp32 logits [S, V] of the chunks that sample."""
        inp = self._prepare(batch)
        meta = inp.meta
        adapters = [getattr(c.seq, "adapter", None) for c in batch.chunks]
        merged = self.merger is not None and self.merger.begin_step(
            [(a, c.num_tokens) for a, c in zip(adapters, batch.chunks, strict=True)]
        )
        if inp.decode_only and self.graphs is not None and len(batch.chunks) <= self.graphs.max_batch_size:
            families = {"base": self.base_graphs, "merged": self.merged_graphs}
            family = graph_family(adapters, merged, [k for k, g in families.items() if g is not None])
            if family == "lora":
                self._set_lora_step(batch, "graph")
                self._tp_send(inp, batch, "graph")
                graphs = self._lora_graphs()
            else:  # no LoRA launch in the step
                self.lora.poll()  # loads for waiting requests keep moving
                self._tp_send(inp, batch, None)
                graphs = families[family]
            logits = graphs.run(
                inp.input_ids, inp.positions, meta.slot_mapping, meta.seq_lens, meta.block_tables
            )
            # a 1-token chunk that does not end its prompt scores nothing
            return logits if inp.logits_indices.numel() == logits.shape[0] else logits[inp.logits_indices]
        kind = "decode" if inp.decode_only else "prefill"
        if merged:  # the adapter is inside the merged weights: no LoRA metadata, no launch
            self.lora.poll()
            self.lora_state.metas = dict.fromkeys(self.lora_state.pools)
        else:
            self._set_lora_step(batch, kind)
        self._tp_send(inp, batch, kind)
        if self.lora_state is None:
            return self.model(inp.input_ids, inp.positions, meta, inp.logits_indices)
        self.lora_state.merged = merged
        try:
            return self.model(inp.input_ids, inp.positions, meta, inp.logits_indices)
        finally:
            self.lora_state.merged = False

    @torch.inference_mode()
    def execute(self, batch) -> list[SampledToken]:
        """One SampledToken per chunk with sample=True, in chunk order."""
        if batch.freed_seq_ids:
            self.release(batch.freed_seq_ids)
        if not batch.chunks:
            return []
        logits = self.forward_logits(batch)
        if logits.shape[0] == 0:
            return []
        meta = self.sampling.metadata([c.seq for c in batch.chunks if c.sample])
        out = sample(logits, meta, self.sampling.default_generator)
        return [
            SampledToken(t, lp, top)
            for t, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)
        ]

    @property
    def generators(self) -> dict[int, torch.Generator]:
        return self.sampling.generators

    def release(self, seq_ids) -> None:
        self.sampling.release(seq_ids)
