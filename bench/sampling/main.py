"""Sampling controls on the decode step: batch 64, the same step with none of them and with them on every row.

A model with random weights (Llama-3-8B shape in bf16 on CUDA; ``--shape tiny`` for a CPU check) decodes one
token for 64 sequences of context 512. For each case the whole runner step (inputs, forward or CUDA graph,
sampling, the host transfer) is timed, then the sampler alone on the step's logits, and the host time to
build the step's sampling metadata:

- ``greedy`` / ``random``: no control (temperature 0; temperature 0.8 with top-p 0.95);
- ``+ penalties``: presence 0.5, frequency 0.5, repetition 1.1 on every row, 256 output tokens each already
  counted;
- ``+ all``: the penalties, 8 logit-bias entries, min-p 0.05 and an active min_tokens on every row;
- ``+ grammar on half``: every other row under a grammar. With ``--tokenizer DIR`` (a Hugging Face tokenizer
  folder) and xgrammar installed, it is the server's own path: ``structured.Grammars`` compiles a JSON Schema
  (bench/structured's) for that tokenizer, each constrained row gets its matcher, advanced into the first
  string value (``{"name": "Al``, where a mask allows the most tokens), and every step fills the rows' masks
  through xgrammar. Without them a stand-in matcher copies a fixed bitmask row allowing a third of the
  vocabulary: that times only the engine's part (the host rows, one copy, the masked fill).

    python bench/run.py sampling --out DIR [--shape tiny --device cpu] [--batch 64] [--ctx 512]
                                 [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.engine.core.sequence import SamplingParams, Sequence
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.runner import ModelRunner
from loraplane.engine.model.sampler import sample
from loraplane.engine.model.weights import random_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared shapes
from shapes import LLAMA3_8B, TINY_LLAMA  # noqa: E402

OUTPUT_TOKENS = 256  # output tokens each penalised row already holds

PLAIN_RANDOM = dict(temperature=0.8, top_p=0.95)
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


class FixedRowMatcher:
    """A stand-in for a grammar library's matcher: fills its row from a fixed bitmask row, accepts anything."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].copy_(self.row)

    def accept_token(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


class FixedRowGrammar:
    def __init__(self, vocab: int) -> None:
        allowed = torch.arange((vocab + 31) // 32 * 32) % 3 == 0  # a third of the vocabulary
        words = (allowed.view(-1, 32).long() << torch.arange(32)).sum(dim=1)
        self.row = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def matcher(self, stop_token_ids) -> FixedRowMatcher:
        return FixedRowMatcher(self.row)


class SchemaGrammar:
    """The server's grammar for bench/structured's JSON Schema; each matcher starts inside its first string."""

    PREFIX = '{"name": "Al'

    def __init__(self, tokenizer_dir: str, vocab: int) -> None:
        from transformers import AutoTokenizer

        from loraplane.http.structured import Grammars, Spec

        schema = runpy.run_path(str(Path(__file__).resolve().parents[1] / "structured" / "main.py"))["SCHEMA"]
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.compiled = Grammars().compile(
            Spec("json_schema", schema, "response_format"), self.tokenizer, vocab
        )
        self.prefix = self.tokenizer.encode(self.PREFIX, add_special_tokens=False)

    def matcher(self, stop_token_ids):
        matcher = self.compiled.matcher(stop_token_ids)
        for token in self.prefix:
            if not matcher.accept_token(token):
                raise RuntimeError(f"the schema's grammar refused token {token} of {self.PREFIX!r}")
        return matcher


def cases(vocab: int, grammar=None) -> dict[str, dict]:
    grammar = grammar or FixedRowGrammar(vocab)
    bias = tuple((t, 2.0) for t in range(8, 8 * 9, 8))
    everything = dict(**PENALTIES, logit_bias=bias, min_p=0.05, min_tokens=OUTPUT_TOKENS + 64)
    return {
        "greedy": dict(temperature=0.0),
        "greedy + penalties": dict(temperature=0.0, **PENALTIES),
        "greedy + grammar on half": dict(temperature=0.0, grammar=grammar),
        "random": PLAIN_RANDOM,
        "random + penalties": dict(**PLAIN_RANDOM, **PENALTIES),
        "random + all": dict(**PLAIN_RANDOM, **everything),
        "random + grammar on half": dict(**PLAIN_RANDOM, grammar=grammar),
    }


def timed_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall ms of fn() to completion (a device sync after each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def print_profile(fn) -> None:
    """Where sample()'s time goes: host and GPU time by op, over ten calls after a warm-up."""
    fn()
    with torch.profiler.profile() as prof:
        for _ in range(10):
            fn()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def make_batch(runner: ModelRunner, fields: dict, batch: int, ctx: int, seed: int) -> ScheduledBatch:
    gen = torch.Generator().manual_seed(seed)
    per = -(-(ctx + 1) // runner.block_size)
    chunks = []
    for i in range(batch):
        prompt = torch.randint(0, runner.vocab_size, (ctx - OUTPUT_TOKENS,), generator=gen).tolist()
        row_fields = fields if i % 2 == 0 or "grammar" not in fields else {
            k: v for k, v in fields.items() if k != "grammar"}  # fmt: skip
        seq = Sequence(prompt, SamplingParams(max_tokens=1024, ignore_eos=True, **row_fields))
        if seq.sampling.grammar is not None:  # the engine makes each sequence's matcher (add_request)
            seq.matcher = seq.sampling.grammar.matcher(())
        for token in torch.randint(0, runner.vocab_size, (OUTPUT_TOKENS,), generator=gen).tolist():
            seq.append_token(token)
        seq.block_table = list(range(i * per, (i + 1) * per))
        seq.num_computed_tokens = ctx - 1
        chunks.append(ScheduledChunk(seq, ctx - 1, 1, True))
    return ScheduledBatch(chunks)


def build_runner(shape: str, device: torch.device, batch: int, ctx: int) -> tuple[ModelRunner, ModelConfig]:
    spec = LLAMA3_8B if shape == "llama3-8b" else TINY_LLAMA
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(spec, max_model_len=2 * ctx)
    folder = Path(tempfile.mkdtemp(prefix=f"{shape}-shape-"))
    (folder / "config.json").write_text(json.dumps(spec))  # no weights on disk: random, in memory
    blocks = batch * (-(-(ctx + 1) // 16)) + 16
    engine_cfg = EngineConfig(model=str(folder), device=device.type, dtype=str(dtype).removeprefix("torch."),
                              max_model_len=2 * ctx, max_num_seqs=max(batch, 8), num_kv_blocks=blocks,
                              cuda_graph_batch_sizes=(batch,))  # fmt: skip
    model = random_model(cfg, device, dtype)
    return ModelRunner(engine_cfg, model=model, model_config=cfg), cfg


@torch.inference_mode()
def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench sampling")
    parser.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--profile", metavar="CASE", help="print torch.profiler's table of sample() for CASE")
    parser.add_argument("--tokenizer", metavar="DIR", help="grammar rows through xgrammar for this tokenizer")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    runner, cfg = build_runner(args.shape, device, args.batch, args.ctx)
    for layer in runner.model.model.layers:  # random KV, never zeros
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    rows = []
    base: dict[str, float] = {}
    grammar = SchemaGrammar(args.tokenizer, cfg.vocab_size) if args.tokenizer else None
    for name, fields in cases(cfg.vocab_size, grammar).items():
        batch = make_batch(runner, fields, args.batch, args.ctx, seed=len(rows))
        seqs = [c.seq for c in batch.chunks]
        step_ms = timed_ms(lambda b=batch: runner.execute(b), device, args.iters)
        logits = runner.forward_logits(batch).clone()
        meta = runner.sampling.metadata(seqs)
        sample_ms = timed_ms(
            lambda x=logits, m=meta: sample(x, m, runner.sampling.default_generator), device, args.iters
        )
        meta_ms = timed_ms(lambda s=seqs: runner.sampling.metadata(s), device, args.iters)
        if args.profile == name:
            print_profile(lambda x=logits, m=meta: sample(x, m, runner.sampling.default_generator))
        plain = name.split(" + ")[0]
        base.setdefault(plain, step_ms)
        rows.append({"case": name, "batch": args.batch, "step_ms": step_ms, "sample_ms": sample_ms,
                     "metadata_ms": meta_ms, "step_vs_plain_pct": 100 * (step_ms / base[plain] - 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        runner.release([s.seq_id for s in seqs])
    return {
        "title": f"Sampling controls on the decode step (B={args.batch}, ctx={args.ctx}, {args.shape}, {device.type})",
        "columns": ["case", "batch", "step_ms", "sample_ms", "metadata_ms", "step_vs_plain_pct"],
        "rows": rows,
        "meta": {
            "shape": args.shape,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "vocab": cfg.vocab_size,
            "output_tokens_per_row": OUTPUT_TOKENS,
            "iters": args.iters,
            "cuda_graphs": runner.graphs is not None,
            "grammar": "xgrammar, the server's JSON Schema path"
            if grammar
            else "stand-in (a fixed mask row)",
        },  # fmt: skip
        "notes": [
            "step_ms: the whole runner step (median); sample_ms: sample() alone on the step's logits; "
            "metadata_ms: host time to build the step's per-row sampling tensors",
            "step_vs_plain_pct: the step against the same case without controls (greedy or random)",
        ],
    }
