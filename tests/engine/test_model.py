"""Engine logits against transformers at fp32 on CPU: prefill, chunked prefill + decode through the paged KV cache,
mixed batches, Llama-3 rope scaling, Qwen2 qkv bias, tied embeddings; unsupported configs refused by field."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk  # noqa: E402
from loraplane.engine.core.sequence import Sequence  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig, ModelConfigError  # noqa: E402
from loraplane.engine.model.runner import ModelRunner  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # [L, V]


def make_runner(model_dir, **kw) -> ModelRunner:
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, **kw
    )
    return ModelRunner(cfg)


class PagedSeq:
    """A sequence with a deliberately scattered block table, driven chunk by chunk like the scheduler does."""

    def __init__(self, tokens: list[int], free_blocks: list[int], block_size: int = 4) -> None:
        self.seq = Sequence(tokens)
        nblocks = -(-len(tokens) // block_size)
        self.seq.block_table = [free_blocks.pop() for _ in range(nblocks)]

    def chunk(self, n: int) -> ScheduledChunk:
        start = self.seq.num_computed_tokens
        self.seq.num_computed_tokens += n
        return ScheduledChunk(self.seq, start, n, sample=True)  # score every chunk's last position


def scattered_blocks(n: int = 128, seed: int = 0) -> list[int]:
    blocks = list(range(n))
    random.Random(seed).shuffle(blocks)
    return blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_logits_match_transformers(arch, make_hf_model):
    model_dir = make_hf_model(arch, tie_word_embeddings=arch == "qwen2")
    tokens = random.Random(1).choices(range(256), k=23)
    ref = hf_logits(model_dir, tokens)
    runner = make_runner(model_dir)
    ps = PagedSeq(tokens, scattered_blocks())
    # every position scored: one prefill chunk whose rows are all sampled, via the model directly
    batch = ScheduledBatch([ps.chunk(len(tokens))])
    inp = runner._prepare(batch)
    with torch.inference_mode():
        ours = runner.model(inp.input_ids, inp.positions, inp.meta, torch.arange(len(tokens)))
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill_then_decode_matches_transformers(arch, make_hf_model):
    model_dir = make_hf_model(arch, tie_word_embeddings=arch == "qwen2")
    tokens = random.Random(2).choices(range(256), k=40)
    ref = hf_logits(model_dir, tokens)
    runner = make_runner(model_dir)
    ps = PagedSeq(tokens, scattered_blocks())
    rows, scored = [], []
    for n in [13, 11] + [1] * 16:  # two prefill chunks, then decode steps one token at a time
        rows.append(runner.forward_logits(ScheduledBatch([ps.chunk(n)]))[0])
        scored.append(ps.seq.num_computed_tokens - 1)
    assert rel_err(torch.stack(rows), ref[scored]) < 1e-4


def test_mixed_batch_matches_transformers(make_hf_model):
    """One step holding a first prefill chunk, a continued chunk and two decode rows of other sequences."""
    model_dir = make_hf_model("llama", tie_word_embeddings=False)
    runner = make_runner(model_dir)
    rng, free = random.Random(3), scattered_blocks(seed=3)
    seqs = [PagedSeq(rng.choices(range(256), k=k), free) for k in (17, 30, 9, 12)]
    refs = [hf_logits(model_dir, s.seq.token_ids) for s in seqs]
    runner.forward_logits(ScheduledBatch([seqs[1].chunk(20), seqs[2].chunk(8), seqs[3].chunk(11)]))
    batch = ScheduledBatch([seqs[0].chunk(17), seqs[1].chunk(10), seqs[2].chunk(1), seqs[3].chunk(1)])
    ours = runner.forward_logits(batch)
    expected = torch.stack([refs[0][16], refs[1][29], refs[2][8], refs[3][11]])
    assert rel_err(ours, expected) < 1e-4


def test_llama3_rope_scaling_matches_transformers(make_hf_model):
    model_dir = make_hf_model("llama", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)
    cfg = ModelConfig.from_pretrained(model_dir)
    assert (
        cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3" and cfg.rope_theta == 500000.0
    )
    tokens = random.Random(4).choices(range(256), k=150)  # beyond original_max_position_embeddings
    ref = hf_logits(model_dir, tokens)
    runner = make_runner(model_dir)
    ps = PagedSeq(tokens, scattered_blocks())
    rows = [
        runner.forward_logits(ScheduledBatch([ps.chunk(n)]))[0] for n in (140, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    ]
    assert rel_err(torch.stack(rows), ref[139:]) < 1e-4


def test_tied_embeddings_share_one_tensor(tiny_qwen2_dir):
    runner = make_runner(tiny_qwen2_dir)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert runner.model_config.qkv_bias and runner.model.model.layers[0].self_attn.qkv_proj.bias is not None


def _config(tmp_path, **fields) -> str:
    base = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    return tmp_path


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_scaling.rope_type"),
        ({"model_type": "mistral", "sliding_window": 128}, "sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(tmp_path, fields, named):
    with pytest.raises(ModelConfigError, match=rf"\(field {named}\)"):
        ModelConfig.from_pretrained(_config(tmp_path, **fields))


def test_config_reads_both_rope_layouts(tmp_path):
    v5 = ModelConfig.from_dict(
        json.loads(
            _config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
            .joinpath("config.json")
            .read_text()
        )
    )
    v4 = ModelConfig.from_dict(
        json.loads(_config(tmp_path, rope_theta=1e5).joinpath("config.json").read_text())
    )
    assert v5.rope_theta == v4.rope_theta == 1e5 and v5.rope_scaling is None
    # a Mistral window that covers max_model_len is plain causal attention
    ok = ModelConfig.from_dict({**json.loads((tmp_path / "config.json").read_text()), "model_type": "mistral",
                                "sliding_window": 4096}, max_model_len=512)  # fmt: skip
    assert ok.model_type == "mistral"


def test_mistral_matches_transformers(make_hf_model):
    model_dir = make_hf_model("mistral", sliding_window=None)
    tokens = random.Random(5).choices(range(256), k=20)
    ref = hf_logits(model_dir, tokens)
    runner = make_runner(model_dir)
    ps = PagedSeq(tokens, scattered_blocks())
    rows = [runner.forward_logits(ScheduledBatch([ps.chunk(n)]))[0] for n in (15, 1, 1, 1, 1, 1)]
    assert rel_err(torch.stack(rows), ref[14:]) < 1e-4
