"""Shared engine fixtures: tiny random HF model folders, an offline byte-level BPE tokenizer, a torch-free runner.

Model folders are built from transformers configs (no downloads) once per session; transformers and torch are
imported lazily so torch-free tests never pay for them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraplane.engine.core.scheduler import ScheduledBatch

TINY_DIMS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Wider than the default 0.02 so greedy top-2 logits stay well apart (ties would make fp32 comparisons flaky).
    initializer_range=0.2,
)
# The chain of reductions behind one logit of a tiny model, for tests.numerics.sum_atol. Per layer: q/k/v, o
# and gate/up over the hidden size, the attention over a head and the positions (another hidden size's worth
# at test lengths), down over the intermediate size; then the head over the hidden size.
_LAYER_TERMS = 4 * TINY_DIMS["hidden_size"] + TINY_DIMS["intermediate_size"]
TINY_LOGIT_TERMS = TINY_DIMS["num_hidden_layers"] * _LAYER_TERMS + TINY_DIMS["hidden_size"]


def build_tiny_hf_model(out_dir: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random fp32 `arch` ('llama' | 'qwen2' | 'mistral') model as an HF folder (config.json + safetensors)."""
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    config = config_cls(**{**TINY_DIMS, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="session")
def make_hf_model(tmp_path_factory):
    """Factory: make_hf_model(arch, **config_overrides) -> folder, cached per argument set for the session."""
    cache: dict[str, Path] = {}

    def make(arch: str, seed: int = 0, **overrides) -> Path:
        key = f"{arch}-{seed}-{sorted(overrides.items())}"
        if key not in cache:
            name = f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
            cache[key] = build_tiny_hf_model(tmp_path_factory.mktemp(name), arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_hf_model) -> Path:
    return make_hf_model("llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(make_hf_model) -> Path:
    # Qwen2 carries qkv bias; tied embeddings exercise the other lm_head path.
    return make_hf_model("qwen2", tie_word_embeddings=True)


TOKENIZER_CORPUS = [
    "héllo 世界 🙂",
    "The capital of France is Paris.",
    "Stop here. Then continue with more words, 世界 and héllo again.",
    "naïve café déjà vu — 東京 🙂🙃",
    "hello world, hello tokens",
]


@pytest.fixture(scope="session")
def byte_bpe_tokenizer():
    """A byte-level BPE trained offline on a few sentences with multi-byte characters, as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TOKENIZER_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@dataclass(slots=True)
class FakeSampledToken:  # same fields as model_runner.SampledToken
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


class FakeRunner:
    """Torch-free ModelRunner stand-in that really pages: it writes each chunk's KV into slots through the block
    table and 'samples' a token from what it reads back from the slots of positions [0, start + n).

    A slot's "KV" is a digest of what real keys and values depend on: the adapter's cache salt and every token
    up to that position. So any wrong block table, a slot shared by two live sequences, a recompute that
    skipped tokens, a stale num_computed_tokens or a prefix-cache hit under another adapter changes the sampled
    tokens, and reference() (the same function over the true token list) tells the output apart from the right
    one.
    """

    # The Runner protocol's facts and optional capabilities (tests set ``residency`` to drive adapters).
    device, dtype = "cpu", "float32"
    memory = None
    residency = None
    lora = None

    def __init__(
        self,
        num_kv_blocks: int = 64,
        block_size: int = 4,
        vocab_size: int = 97,
        max_model_len: int = 256,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.base_hash = "0" * 64
        self.slots: dict[int, bytes] = {}  # slot -> KV digest
        self.batches: list[ScheduledBatch] = []
        self.released: list[int] = []
        self.fail_on_step: int | None = None  # make execute() raise on this call (error propagation tests)

    @staticmethod
    def next_token(tokens: list[int], vocab_size: int) -> int:
        digest = hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % vocab_size

    def reference(self, prompt: list[int], num_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(num_tokens):
            tokens.append(self.next_token(tokens, self.vocab_size))
        return tokens[len(prompt) :]

    @staticmethod
    def kv_chain(salt: str, tokens: list[int]) -> list[bytes]:
        """The "KV" of each position: a digest of the salt and the tokens up to it."""
        chain, state = [], salt.encode()
        for token in tokens:
            state = hashlib.blake2b(state + token.to_bytes(8, "little"), digest_size=8).digest()
            chain.append(state)
        return chain

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, batch: ScheduledBatch):
        if self.fail_on_step is not None and len(self.batches) == self.fail_on_step:
            raise RuntimeError("CUDA error: fake runner failure (a device fault)")
        self.batches.append(batch)
        self.release(batch.freed_seq_ids)
        sampled = []
        for chunk in batch.chunks:
            seq = chunk.seq
            assert chunk.start == seq.num_computed_tokens
            end = chunk.start + chunk.num_tokens
            assert len(seq.block_table) * self.block_size >= end, "block table does not cover the chunk"
            chain = self.kv_chain(seq.cache_salt, seq.token_ids[:end])
            for pos in range(chunk.start, end):
                self.slots[self._slot(seq.block_table, pos)] = chain[pos]
            if chunk.sample:
                seen = [
                    token if self.slots.get(self._slot(seq.block_table, pos)) == chain[pos] else -1
                    for pos, token in enumerate(seq.token_ids[:end])
                ]
                token = self.next_token(seen, self.vocab_size)
                logprob = -float(token % 7) if seq.sampling.logprobs is not None else None
                top = (
                    {token: logprob, (token + 1) % self.vocab_size: logprob - 1.0}
                    if logprob is not None
                    else None
                )
                sampled.append(FakeSampledToken(token, logprob, top))
        return sampled

    def release(self, seq_ids) -> None:
        self.released.extend(seq_ids)

    def warm_adapter(self, key: str) -> float:
        raise AssertionError("the engine warms adapters only on a runner with lora")


@pytest.fixture
def fake_runner_cls():
    return FakeRunner


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (CI has two cores, shared with the test's own engine threads)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
