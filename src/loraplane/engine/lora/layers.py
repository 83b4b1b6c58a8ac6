"""LoRA wrappers around the model's packed projections, the pools they read and the step state they share.

The model files know nothing of LoRA: ``wrap_model`` swaps each packed projection for a ``LoRALinear`` that
keeps the original as ``base_layer``. Every projection runs its base GEMM for all tokens, then, for each
PEFT module packed in it (q, k, v in ``qkv_proj``; gate, up in ``gate_up_proj``), one ``lora_apply`` into
that module's column range of the output (q, k, v and gate, up: one ``lora_apply_many`` for the
projection, one launch pair on the GPU).

Memory follows what each adapter has: there is one ``LoRAPool`` per PEFT module (q_proj ... down_proj),
each with its own page table and rank-1 pages, so an adapter costs pages only in the modules it targets,
at its own rank in each. A step's batch metadata is built once per module pool (``LoRAStepState``) and
read by every layer; a module no token of the step uses has no metadata and costs no kernel launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplane.engine.lora.weights import TARGET_MODULES, module_shapes
from loraplane.engine.model.model import packed_output_sizes
from loraplane.engine.model.model_config import ModelConfig
from loraplane.kernels import (
    LoRABatchMeta,
    LoRAPool,
    ModuleSpec,
    covers_every_row,
    lora_apply,
    lora_apply_many,
)

# Which PEFT modules each wrapped projection packs, in column order.
PROJECTIONS = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}
PAGE_RANK = 1  # rank-rows per page: any rank costs exactly its rows


class LoRAStepState:
    """What every LoRALinear reads in one step: the pools and each module's batch metadata (or None)."""

    def __init__(self, pools: dict[str, LoRAPool]) -> None:
        self.pools = pools
        self.metas: dict[str, LoRABatchMeta | None] = dict.fromkeys(pools)
        # The step runs on the merged weights (merge.py): every token has the merged adapter, no LoRA op.
        self.merged = False
        # Eager steps whose every token has an adapter write the delta first and let the base GEMM add
        # itself on top (LoRALinear._delta_first): the expand then never reads y. A switch for benchmarks.
        self.delta_first = True
        # The warm-up's: store wherever the projection allows, rows without an adapter aside (ops zero
        # those), so that the storing launches compile before serving.
        self.force_store = False


class LoRALinear(nn.Module):
    """y = base_layer(x); then y[:, cols(m)] += x @ A_m^T @ B_m^T per token's adapter, for each packed m."""

    def __init__(self, base_layer: nn.Linear, layer: int, slices: tuple[tuple[str, int, int], ...],
                 state: LoRAStepState) -> None:  # fmt: skip
        super().__init__()
        self.base_layer = base_layer
        self.layer = layer
        self.slices = slices  # (PEFT module, first column, end column) inside the packed output
        self.state = state
        self.merged_weight: torch.Tensor | None = None  # [out, in] W + the merged adapter's delta (merge.py)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state.merged and self.merged_weight is not None:  # the adapter is inside the weights
            return F.linear(x, self.merged_weight, self.base_layer.bias)
        metas, pools = self.state.metas, self.state.pools
        live = [(module, c0, c1) for module, c0, c1 in self.slices if metas[module] is not None]
        if not live:
            return self.base_layer(x)
        store = self._delta_first(x, live)
        if store:
            y, base = x.new_empty((x.shape[0], self.base_layer.out_features)), None  # [T, out_total]
        else:
            y, base = self._base_output(x, metas[live[0][0]].capture)
        if len(live) > 1 and all(metas[m] is metas[live[0][0]] for m, _, _ in live):
            # One shrink and one expand launch for q, k, v (gate, up): they share x and the step's metadata.
            targets = [(pools[m], m, c0) for m, c0, _ in live]
            lora_apply_many(y, x, targets, self.layer, metas[live[0][0]], base=base, store=store)
        else:
            for module, c0, c1 in live:  # metas[module] None: no token of this step has this module
                lora_apply(y[:, c0:c1], x, pools[module], self.layer, module, metas[module], base=base,
                           store=store)  # fmt: skip
                base = None
        if store:  # y = x @ W^T + delta in one GEMM whose epilogue reads the delta (beta = 1)
            y.addmm_(x, self.base_layer.weight.t())
        return y

    def _delta_first(self, x: torch.Tensor, live) -> bool:
        """Whether this eager step can write the delta into an empty y and let the base GEMM add itself on
        top: every column of the projection belongs to a live module, every row has an adapter with each
        of them, and the base is a plain bias-free nn.Linear. A prefill's expand then writes y once where
        it would read and write it (gate_up at T = 2,048: 117 MB a layer not read), and the read moves into
        the compute-bound GEMM's epilogue. Captured decode keeps the shrink-beside-GEMM form."""
        state, base_layer = self.state, self.base_layer
        meta = state.metas[live[0][0]]
        if not state.delta_first or meta.capture or len(live) != len(self.slices) or x.dim() != 2:
            return False
        if type(base_layer) is not nn.Linear or base_layer.bias is not None:
            return False
        return state.force_store or all(
            covers_every_row(state.metas[m], state.pools[m], x.shape[0]) for m, _, _ in live
        )

    def _base_output(self, x: torch.Tensor, captured: bool):
        """(y, None) with y the base output; or, in a captured (decode graph) step on a plain nn.Linear, an
        empty y and the GEMM that fills it, for the kernels to run beside the shrink (kernels/overlap.py)."""
        base_layer = self.base_layer
        if not (captured and x.is_cuda and x.dim() == 2 and type(base_layer) is nn.Linear):
            return base_layer(x), None  # [T, out_total]
        y = x.new_empty((x.shape[0], base_layer.out_features))  # [T, out_total]
        w, b = base_layer.weight, base_layer.bias
        if b is None:
            return y, lambda: torch.mm(x, w.t(), out=y)
        return y, lambda: torch.addmm(b, x, w.t(), out=y)


def wrap_model(model: nn.Module, state: LoRAStepState) -> None:
    """Replace every packed projection of ``model`` (a CausalLM) by a LoRALinear around it, in place."""
    sizes = packed_output_sizes(model.config)
    for i, layer in enumerate(model.model.layers):
        for (parent_name, proj), members in PROJECTIONS.items():
            parent = getattr(layer, parent_name)
            base = getattr(parent, proj)
            if isinstance(base, LoRALinear):
                continue
            widths = sizes.get(proj, (base.out_features,))
            starts = [sum(widths[:j]) for j in range(len(widths) + 1)]
            slices = tuple((m, starts[j], starts[j + 1]) for j, m in enumerate(members))
            setattr(parent, proj, LoRALinear(base, i, slices, state))


def pool_row_bytes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one rank-row costs in each module's pool (A row + B^T row, every layer)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return {m: cfg.num_layers * (i + o) * elem for m, (i, o) in module_shapes(cfg).items()}


def build_pools(cfg: ModelConfig, rows: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, LoRAPool]:  # fmt: skip
    """One pool of ``rows`` rank-rows per PEFT module; up to ``rows`` adapters each (rank-1 pages)."""
    if rows < max_rank:
        raise ValueError(
            f"EngineConfig: the adapter pools hold {rows} rank-rows, below max_lora_rank {max_rank}"
        )
    pools = {}
    for m, (fan_in, fan_out) in module_shapes(cfg).items():
        spec = {m: ModuleSpec(fan_in, (fan_out,))}
        page = LoRAPool.page_bytes_for(spec, cfg.num_layers, PAGE_RANK, dtype)
        pools[m] = LoRAPool(spec, cfg.num_layers, rows * page, page_rank=PAGE_RANK, max_rank=max_rank,
                            max_adapters=min(rows, 4096), dtype=dtype, device=device)  # fmt: skip
    assert tuple(pools) == TARGET_MODULES
    return pools
