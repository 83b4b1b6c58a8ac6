"""Load a Hugging Face folder's safetensors weights straight onto the run device (never pickle).

Single ``model.safetensors`` or shards listed by ``model.safetensors.index.json``. Tensors are matched to
``CausalLM`` parameters by name (q/k/v and gate/up land in row ranges of the packed projections); a missing or
unexpected tensor is an error naming it. Parameters are allocated once on the device and filled in place, so
no host copy of the weights is ever made.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loraplane.artifacts.base_hash import compute_base_hash
from loraplane.engine.model.model import PACKED_MODULES, CausalLM, packed_output_sizes
from loraplane.engine.model.model_config import ModelConfig

# Buffers some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightsError(ValueError):
    """The folder's safetensors do not match the model described by config.json."""


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: unreadable index ({exc}); expected a 'weight_map' object") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index}: shards listed but absent: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise WeightsError(f"{model_dir}: only pickle weights (*.bin/*.pt) found; safetensors required")
        raise WeightsError(f"{model_dir}: no *.safetensors weights")
    return found


def hf_layout(model: CausalLM) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (our parameter name, first row, row count). Packed members own a row range."""
    cfg, sizes = model.config, packed_output_sizes(model.config)
    layout = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in PACKED_MODULES:
            first = 0
            for member, rows in zip(PACKED_MODULES[leaf], sizes[leaf], strict=True):
                layout[f"{parent}.{member}.{kind}"] = (name, first, rows)
                first += rows
        else:
            layout[name] = (name, 0, p.shape[0])
    if cfg.tie_word_embeddings:
        layout.pop("lm_head.weight", None)
    return layout


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (views into the packed tensors, no copies)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {hf: params[ours][first : first + rows] for hf, (ours, first, rows) in hf_layout(model).items()}


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Build CausalLM(cfg) and fill it from the folder's safetensors on ``device`` in ``dtype``."""
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)  # uninitialised, filled below
    params = dict(model.named_parameters(remove_duplicate=False))
    layout = hf_layout(model)
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # some tied checkpoints still store it; the embedding is the truth
                if name not in layout:
                    raise WeightsError(f"{path.name}: unexpected tensor {name} for {cfg.model_type}")
                ours, first, rows = layout[name]
                target = params[ours].data[first : first + rows]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise WeightsError(
                        f"tensor {name}: shape {tuple(tensor.shape)} does not match config {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                loaded.add(name)
    return finish_loading(model, layout, loaded, model_dir)


def finish_loading(model: CausalLM, layout: dict, loaded: set[str], where) -> CausalLM:
    """Refuse a checkpoint that left any tensor of ``layout`` unset, then tie and freeze the model."""
    missing = sorted(set(layout) - loaded)
    if missing:
        raise WeightsError(f"{where}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.tie_weights()
    return model.eval().requires_grad_(False)


def base_hash(model_dir: str | Path) -> str:
    """The documented base-model identity (see loraplane.artifacts.base_hash)."""
    return compute_base_hash(Path(model_dir))


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A model with random weights built directly on ``device`` (benchmarks: speed does not depend on values)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    return fill_random(model, cfg, torch.Generator(device=device).manual_seed(seed))


def fill_random(model: CausalLM, cfg: ModelConfig, gen: torch.Generator) -> CausalLM:
    """Random weights in place: matrices N(0, 1/hidden), norms 1, the rest N(0, 0.02); eval, no grad."""
    std = cfg.hidden_size**-0.5
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.data.normal_(0.0, std, generator=gen)
        elif name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    return model.eval().requires_grad_(False)
