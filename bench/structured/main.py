"""Grammar libraries' mask fill per decode step: xgrammar (the server's) against llguidance, on the CPU.

Structured output costs the engine thread one bitmask fill per constrained row and step, before sampling. For
B rows under one JSON Schema (and under any JSON object), every row follows a valid instance token by token
(SmolLM2's 49k vocabulary); each step fills all B rows' masks. Reported: the median and worst step after the
first, and the first step. llguidance is measured only where it is installed (it is no dependency).

    python bench/run.py structured --out DIR [--batch 64] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "hello world"]}


def xgrammar_rows(tokenizer, vocab: int, batch: int, schema: dict | None):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    text = json.dumps(schema if schema is not None else {"type": "object"})
    compiled = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=schema is not None)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)

    def fill():
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(token: int):
        assert all(m.accept_token(token) for m in matchers)

    return fill, accept


def llguidance_rows(tokenizer, vocab: int, batch: int, schema: dict | None):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema if schema is not None else {"type": "object"},
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    bitmask = lt.allocate_token_bitmask(batch, vocab)
    executor = llguidance.LLExecutor()

    def fill():
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(token: int):
        assert all(m.consume_token(token) for m in matchers)

    return fill, accept


def measure(make, tokenizer, vocab: int, batch: int, schema: dict | None) -> dict:
    fill, accept = make(tokenizer, vocab, batch, schema)
    tokens = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)
    times = []
    for token in tokens:
        start = time.perf_counter()
        fill()
        times.append((time.perf_counter() - start) * 1e3)
        accept(token)
    rest = times[1:]
    return {
        "first_ms": times[0],
        "median_ms": statistics.median(rest),
        "max_ms": max(rest),
        "steps": len(tokens),
    }


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench structured")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--model-dir", help="a tokenizer folder (default: the converted demo model)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    folder = args.model_dir
    if folder is None:
        from loraplane.engine.model.demo_model import ensure_demo_model

        folder = str(ensure_demo_model(None))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = len(tokenizer)
    libraries = {"xgrammar": xgrammar_rows, "llguidance": llguidance_rows}
    rows = []
    for name, make in libraries.items():
        if importlib.util.find_spec(name) is None:
            continue
        for grammar, schema in (("json_schema", SCHEMA), ("json_object", None)):
            row = {"library": name, "grammar": grammar, "batch": args.batch}
            row.update(measure(make, tokenizer, vocab, args.batch, schema))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "title": f"Grammar mask fill per step, {args.batch} rows (CPU)",
        "columns": ["library", "grammar", "batch", "median_ms", "max_ms", "first_ms", "steps"],
        "rows": rows,
        "meta": {"tokenizer": folder, "vocab": vocab},
        "notes": ["median_ms / max_ms: one step's fill of every row's mask, after the first step"],
    }
