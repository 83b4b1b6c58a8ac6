"""bench/churn/trace_floor.py: the S-LoRA trace through the engine's scheduler on a simulated clock. The
figures it reports rest on these: every token is produced, the pool never holds more than its bytes, and
each adapter loads once when it fits."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location("trace_floor", ROOT / "bench/churn/trace_floor.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["trace_floor"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["trace_floor"]


@pytest.fixture(scope="module")
def trace(floor):
    return floor.lora_bench.make_trace(24, 16.0, max_len=64)


def _adapters(n: int, distinct: int) -> list[str]:
    return [f"s{i % distinct}@v1" for i in range(n)]


def test_every_token_is_produced_and_lora_costs_time(floor, trace):
    model = floor.StepModel()
    base = floor.simulate(trace, [None] * 24, model, lora=False)
    lora = floor.simulate(trace, _adapters(24, 8), floor.StepModel(lora_fixed_ms=2.0), lora=True)
    tokens = int(sum(trace[2]))
    assert round(base["tok_s"] * base["seconds"]) == tokens == round(lora["tok_s"] * lora["seconds"])
    assert lora["seconds"] > base["seconds"] and lora["distinct_per_step_mean"] > 0
    assert base["distinct_per_step_mean"] == 0


def test_the_pool_holds_at_most_its_bytes_and_loads_each_adapter_once(floor, trace):
    per_rank_row = floor.LORA_ROW_BYTES
    assert per_rank_row == 81_920 * 64  # Llama-3-8B, every module, 32 layers, bf16
    pools = []

    def pool(clock):
        p = floor.SimPool(2 * 64 * per_rank_row, lambda key: 0.05, 2, clock)  # two rank-64 adapters
        original = p.tick

        def tick():
            landed = original()
            assert sum(p.resident.values()) <= p.capacity
            return landed

        p.tick = tick
        pools.append(p)
        return p

    roomy = floor.simulate(trace, _adapters(24, 4), floor.StepModel(), lora=True,
                           pool=lambda clock: floor.SimPool(1e12, lambda key: 0.05, 2, clock))  # fmt: skip
    assert roomy["loads"] == 4  # every adapter fits: each loads once
    tight = floor.simulate(trace, _adapters(24, 8), floor.StepModel(), lora=True, pool=pool)
    assert tight["loads"] >= 8 and round(tight["tok_s"] * tight["seconds"]) == int(sum(trace[2]))
    assert tight["ttft_p50_ms"] >= 50.0  # a request waits for its adapter's load


def test_a_bad_step_model_is_refused_naming_the_field(floor):
    with pytest.raises(ValueError, match="bandwidth: must be > 0"):
        floor.StepModel(bandwidth=0)
    with pytest.raises(ValueError, match="lora_fixed_ms: must be >= 0"):
        floor.StepModel(lora_fixed_ms=-1)
