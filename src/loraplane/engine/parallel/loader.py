"""Sharded weight loading: each rank reads only its slices of the safetensors files, straight onto its device.

The checkpoint is the ordinary Hugging Face one (no pre-sharding step). ``safe_open(...).get_slice`` reads the
rank's rows (column-parallel q/k/v, gate/up and their biases; the vocabulary rows of the embedding and LM
head) or columns (row-parallel o_proj, down_proj) without materialising the rest.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from loraplane.engine.model.model import CausalLM
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.weights import (
    _IGNORED_SUFFIXES,
    WeightsError,
    fill_random,
    finish_loading,
    hf_layout,
    hf_state_dict,
    safetensors_files,
)
from loraplane.engine.parallel.group import TPGroup
from loraplane.engine.parallel.layers import (
    ROW_PARALLEL,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    build_sharded_model,
    shard_rows,
)

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _source_slice(name: str, shards: dict[str, tuple[int, int]]) -> tuple[int, slice] | None:
    """(dim, range) of the HF tensor ``name`` this rank reads; None: the whole tensor (replicated)."""
    if name in _VOCAB:
        first, count = shards["vocab"]
        return 0, slice(first, first + count)
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _COLUMN_PARALLEL:
        first, count = shards[leaf]
        return 0, slice(first, first + count)
    if leaf in ROW_PARALLEL.values() and kind == "weight":
        first, count = shards[leaf]
        return 1, slice(first, first + count)
    return None


def _materialise(cfg: ModelConfig, tp: TPGroup, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = build_sharded_model(cfg, tp).to(dtype)
    model = model.to_empty(device=device)
    for module in model.modules():  # pad rows of the vocabulary shards stay zero
        if isinstance(module, VocabParallelEmbedding | VocabParallelLMHead):
            module.weight.data.zero_()
    return model


def _fill(model: CausalLM, cfg: ModelConfig, tp: TPGroup, sources, where: str) -> CausalLM:
    """Copy rank ``tp.rank``'s slice of every (HF name, sliceable tensor, origin) in ``sources`` into ``model``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    layout, shards = hf_layout(model), shard_rows(cfg, tp)
    vocab_rows = shards["vocab"][1]
    loaded: set[str] = set()
    for name, source, origin in sources:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name not in layout:
            raise WeightsError(f"{origin}: unexpected tensor {name} for {cfg.model_type}")
        ours, first, rows = layout[name]
        rows = vocab_rows if name in _VOCAB else rows
        target = params[ours].data[first : first + rows]
        part = _source_slice(name, shards)
        if part is None:
            tensor = source[:]
        elif part[0] == 0:
            tensor = source[part[1]]
        else:
            tensor = source[:, part[1]]
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightsError(
                f"tensor {name}: rank {tp.rank}'s slice has shape {tuple(tensor.shape)}, "
                f"the config gives {tuple(target.shape)} (tensor_parallel_size={tp.size})"
            )
        target.copy_(tensor)
        loaded.add(name)
    return finish_loading(model, layout, loaded, where)


def load_sharded_model(model_dir: str | Path, cfg: ModelConfig, tp: TPGroup, device: torch.device,
                       dtype: torch.dtype) -> CausalLM:  # fmt: skip
    """Rank ``tp.rank``'s CausalLM, filled from the folder's safetensors (``cfg``: the whole model's config)."""

    def sources():
        for path in safetensors_files(Path(model_dir)):
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_slice(name), path.name

    return _fill(_materialise(cfg, tp, device, dtype), cfg, tp, sources(), str(model_dir))


def shard_model(full: CausalLM, tp: TPGroup) -> CausalLM:
    """Rank ``tp.rank``'s shard of a whole in-memory model (tests and benchmarks: one set of weights, two
    layouts), on the whole model's device and dtype."""
    p = next(full.parameters())
    sources = ((name, t, "model") for name, t in hf_state_dict(full).items())
    return _fill(_materialise(full.config, tp, p.device, p.dtype), full.config, tp, sources, "model")


def random_sharded_model(cfg: ModelConfig, tp: TPGroup, device: torch.device, dtype: torch.dtype,
                         seed: int = 0) -> CausalLM:  # fmt: skip
    """Rank ``tp.rank``'s shard with random weights (benchmarks: speed does not depend on values)."""
    model = _materialise(cfg, tp, device, dtype)
    return fill_random(model, cfg, torch.Generator(device=device).manual_seed(seed + tp.rank))
