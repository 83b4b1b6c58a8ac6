"""The folders ``loraplane serve`` is started on in the churn benchmark through the server: a model folder
(config, safetensors weights, tokenizer) and one PEFT folder per adapter.

- quick: a tiny random Llama with the HTTP tests' byte-level BPE tokenizer (CPU, float32, ranks 8 and 16).
- gpu: the Llama-3-8B shape with random bf16 weights (built on the GPU, written as safetensors shards) and a
  word-level tokenizer over the whole 128,256-token vocabulary ("t0" ... "t128255"), so every token a random
  model samples decodes to text and streams as its own chunk (a byte-level BPE of a few hundred tokens would
  decode most sampled ids to nothing); ranks 8 to 64, as the engine benchmark's trace.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch

RANKS = {"quick": (8, 16), "gpu": (8, 16, 32, 64)}
SHARD_BYTES = 4 << 30


def build(work: Path, mode: str, n_adapters: int, used: set[int]) -> tuple[dict[str, Path], int]:
    """Writes the model folder into ``work``; returns the adapter folders (every adapter registered; those
    no trace uses share one folder) and one rank-row's bytes over every module and layer."""
    from workload import write_adapter_files

    from loraplane.engine.lora.weights import module_shapes
    from loraplane.engine.model.model_config import ModelConfig

    if mode == "quick":
        _tiny_model(work)
        device, dtype = torch.device("cpu"), torch.float32
    else:
        _llama3_8b_model(work)
        device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = ModelConfig.from_pretrained(str(work))
    b = types.SimpleNamespace(cfg=cfg, device=device, dtype=dtype, quick=mode == "quick")
    ranks = RANKS[mode]
    names = {f"s{i}": ranks[i % len(ranks)] for i in sorted(used)}
    folders = write_adapter_files(b, work / "adapters", names, drop=False, link=True)
    template = folders[f"s{min(used)}"]
    folders = {f"s{i}": folders.get(f"s{i}", template) for i in range(n_adapters)}
    row = sum(cfg.num_layers * (i + o) * dtype.itemsize for i, o in module_shapes(cfg).values())
    return folders, row


def _tiny_model(work: Path) -> None:
    from tests.engine.conftest import build_tiny_hf_model
    from tests.http.conftest import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    build_tiny_hf_model(work, "llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<eos>"),
                        bos_token_id=None, pad_token_id=None)  # fmt: skip
    tokenizer.save_pretrained(work)


def _llama3_8b_model(work: Path) -> None:
    from safetensors.torch import save_file
    from shapes import LLAMA3_8B

    from loraplane.engine.model.model_config import ModelConfig
    from loraplane.engine.model.weights import hf_state_dict, random_model

    raw = {**LLAMA3_8B}
    (work / "config.json").write_text(json.dumps(raw))
    model = random_model(ModelConfig.from_dict(raw, max_model_len=2048), torch.device("cuda"), torch.bfloat16)
    _write_shards(hf_state_dict(model), work, save_file)
    del model
    torch.cuda.empty_cache()  # the servers started next need the GPU's memory
    _word_tokenizer(raw["vocab_size"], raw["eos_token_id"]).save_pretrained(work)


def _write_shards(tensors: dict[str, torch.Tensor], work: Path, save_file) -> None:
    shard, size, n = {}, 0, 0
    for name, t in tensors.items():
        shard[name] = t.contiguous().cpu()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            save_file(shard, str(work / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
            shard, size, n = {}, 0, n + 1
    if shard:
        save_file(shard, str(work / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})


def _word_tokenizer(vocab_size: int, eos: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"t{eos}", unk_token="t0")
