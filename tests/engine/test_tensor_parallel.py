"""Tensor parallelism on CPU: gloo, 2 processes (the driver is this test process, one spawned worker).

TP=2 must give the single-process engine's logits within fp32 rounding (tests/numerics.py) and the same greedy tokens, on tiny
Llama (GQA, untied head) and Qwen2 (qkv bias, tied head, a vocabulary that does not split evenly).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.weights import load_model
from loraplane.engine.parallel.group import TPGroup, shard_config
from loraplane.engine.parallel.layers import VocabShard
from loraplane.engine.parallel.loader import load_sharded_model
from loraplane.engine.parallel.step_sync import decode_step, encode_step, payload_size
from tests.engine.conftest import TINY_LOGIT_TERMS
from tests.engine.tp_watch import stacks_after
from tests.numerics import assert_close_sums

pytestmark = pytest.mark.timeout(300)

CPU = torch.device("cpu")


def engine_config(model_dir, tp: int) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=96,
                        max_model_len=128, max_num_batched_tokens=64, enable_lora=False,
                        tensor_parallel_size=tp)  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engines(request, make_hf_model):
    """(TP=1 engine, TP=2 engine) on the same folder; the worker is always stopped."""
    if request.param == "llama":
        model_dir = make_hf_model("llama", tie_word_embeddings=False)
    else:  # 255 rows: the vocabulary shards are 128 + 127, the last one padded
        model_dir = make_hf_model("qwen2", tie_word_embeddings=True, vocab_size=255)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker inherits it: two processes on two cores
    single = LLMEngine(engine_config(model_dir, 1))
    parallel = LLMEngine(engine_config(model_dir, 2))
    try:
        yield single, parallel
    finally:
        parallel.runner.tp_driver.close()
        torch.set_num_threads(threads)
    assert not any(w.is_alive() for w in parallel.runner.tp_driver.workers)
    assert not torch.distributed.is_initialized()


def mixed_step(vocab: int, block_size: int = 4) -> SimpleNamespace:
    """A fresh prefill, a continued chunk over cached context, and a one-token chunk, in one step."""
    gen = torch.Generator().manual_seed(1)
    seqs = [
        SimpleNamespace(
            seq_id=i,
            token_ids=torch.randint(0, vocab, (n,), generator=gen).tolist(),
            block_table=list(range(8 * i, 8 * i + 8)),
        )  # fmt: skip
        for i, n in enumerate((11, 23, 9))
    ]
    first = [SimpleNamespace(seq=s, start=0, num_tokens=len(s.token_ids) - k, sample=True)
             for s, k in zip(seqs, (0, 7, 1), strict=True)]  # fmt: skip
    then = [
        SimpleNamespace(seq=seqs[1], start=16, num_tokens=7, sample=True),
        SimpleNamespace(seq=seqs[2], start=8, num_tokens=1, sample=True),
    ]
    return SimpleNamespace(chunks=first[:1]), SimpleNamespace(chunks=first[1:]), SimpleNamespace(chunks=then)


def test_logits_equal_single_process(engines):
    single, parallel = engines
    for batch in mixed_step(single.runner.vocab_size):
        want = single.runner.forward_logits(batch)
        got = parallel.runner.forward_logits(batch)
        assert got.shape == want.shape == (len(batch.chunks), single.runner.vocab_size)
        assert_close_sums(got, want, TINY_LOGIT_TERMS)  # the shards sum in another order
    # each rank holds half of the KV heads in the same number of blocks
    layer = parallel.runner.model.model.layers[0].self_attn
    assert layer.k_cache.shape[2] * 2 == single.runner.model.model.layers[0].self_attn.k_cache.shape[2]
    assert parallel.runner.num_kv_blocks == single.runner.num_kv_blocks


def test_greedy_tokens_identical(engines):
    single, parallel = engines
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, single.runner.vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = single.generate(prompts, greedy)
    assert parallel.generate(prompts, greedy) == want
    assert len(set(map(tuple, want))) == len(prompts)  # the prompts lead to different continuations


def test_each_rank_reads_its_slices(tiny_llama_dir):
    """Rank 1 of 2 without a group (loading issues no collective): its q/k/v rows and o_proj columns."""
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    full = load_model(tiny_llama_dir, cfg, CPU, torch.float32)
    shard = load_sharded_model(tiny_llama_dir, cfg, TPGroup(1, 2, CPU), CPU, torch.float32)
    d, q, kv = cfg.head_dim, cfg.q_size // 2, cfg.kv_size // 2
    qkv_full = full.model.layers[1].self_attn.qkv_proj.weight  # rows [q | k | v]
    want = torch.cat([qkv_full[q : 2 * q], qkv_full[2 * q + kv : 2 * q + 2 * kv], qkv_full[-kv:]])
    assert torch.equal(shard.model.layers[1].self_attn.qkv_proj.weight, want)
    o_full = full.model.layers[1].self_attn.o_proj.weight
    assert torch.equal(shard.model.layers[1].self_attn.o_proj.weight, o_full[:, q:])
    f = cfg.intermediate_size // 2
    gate_up = full.model.layers[0].mlp.gate_up_proj.weight
    want = torch.cat([gate_up[f : 2 * f], gate_up[3 * f :]])
    assert torch.equal(shard.model.layers[0].mlp.gate_up_proj.weight, want)
    assert torch.equal(shard.model.embed_tokens.weight, full.model.embed_tokens.weight[128:])
    assert d * shard.config.num_heads == q


def test_vocab_shards_cover_the_vocabulary_once():
    shards = [VocabShard.of(255, TPGroup(r, 4, CPU)) for r in range(4)]
    assert [(s.start, s.rows, s.padded) for s in shards] == [
        (0, 64, 64),
        (64, 64, 64),
        (128, 64, 64),
        (192, 63, 64),
    ]


def test_indivisible_heads_are_refused_by_name(tiny_llama_dir):
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)  # 4 heads, 2 KV heads
    with pytest.raises(
        ValueError, match="tensor_parallel_size: 4 does not divide the model's num_key_value_heads"
    ):
        shard_config(cfg, 4)
    with pytest.raises(ValueError, match="EngineConfig.tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=0)


def test_step_inputs_survive_the_wire():
    from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan
    from loraplane.engine.model.runner import StepInputs

    meta = AttentionMetadata(
        slot_mapping=torch.arange(5), prefill=[PrefillSpan(0, 3, 3, -1), PrefillSpan(3, 1, 6, 0)],
        gather_slots=torch.arange(6), decode_rows=torch.tensor([4]),
        block_tables=torch.tensor([[3, 5]], dtype=torch.int32), seq_lens=torch.tensor([7], dtype=torch.int32),
    )  # fmt: skip
    inp = StepInputs(torch.arange(5) + 10, torch.arange(5) + 20, meta, torch.tensor([2, 3, 4]), False)
    table = [5, 0, 1, -1, 1, 3]  # per chunk: tokens, adapter slot
    header, payload = encode_step(inp, 3, 2, table)
    assert payload_size(header) == payload.numel()
    out, chunks, got_table = decode_step(header, payload)
    assert chunks == 3 and got_table == table and header[-1] == 2
    assert out.decode_only is False and out.meta.prefill == meta.prefill
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(out, name), getattr(inp, name))
    for name in ("slot_mapping", "gather_slots", "decode_rows", "block_tables", "seq_lens"):
        assert torch.equal(getattr(out.meta, name), getattr(meta, name))
    assert out.meta.block_tables.dtype == torch.int32


DRIVER = """
import sys, time, torch
torch.set_num_threads(1)
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", num_kv_blocks=16,
                                max_model_len=64, enable_lora=False, tensor_parallel_size=2))
print(*[w.pid for w in engine.runner.tp_driver.workers], flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(") ")[-1][0] != "Z"


def test_workers_die_with_a_killed_driver(tiny_llama_dir):
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DRIVER), str(tiny_llama_dir)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 1 and _alive(pids[0])
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        deadline = time.monotonic() + 30
        while _alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pids[0]), "the worker outlived its driver"
    finally:
        driver.kill()
        driver.wait(30)


# ------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_nccl_greedy_tokens_identical(arch, make_hf_model):
    """NCCL over 2 GPUs with CUDA graphs capturing the collectives: the same greedy tokens as one GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model_dir = make_hf_model(arch, tie_word_embeddings=arch == "qwen2")

    def config(tp: int) -> EngineConfig:
        return EngineConfig(model=str(model_dir), device="cuda", dtype="float32", block_size=16,
                            num_kv_blocks=64, max_model_len=128, max_num_seqs=8, enable_lora=False,
                            tensor_parallel_size=tp)  # fmt: skip

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with stacks_after(120):
        want = LLMEngine(config(1)).generate(prompts, greedy)
        parallel = LLMEngine(config(2))
        try:
            assert parallel.runner.graphs is not None  # decode steps replay graphs holding the all-reduces
            assert parallel.generate(prompts, greedy) == want
        finally:
            parallel.runner.tp_driver.close()
        assert not torch.distributed.is_initialized()  # the group was left (its graphs went first)
