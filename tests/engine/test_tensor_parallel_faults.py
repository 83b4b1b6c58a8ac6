"""A tensor-parallel engine whose worker dies stops with EngineFault instead of hanging or blaming requests."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.errors import EngineFault
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_a_dead_worker_stops_the_engine(tiny_llama_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=32,
                          max_model_len=64, enable_lora=False, tensor_parallel_size=2)  # fmt: skip
    engine = LLMEngine(config)
    driver = engine.runner.tp_driver
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        assert len(engine.generate([[1, 2, 3]], greedy)[0]) == 4
        [worker] = driver.workers
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while driver.failed is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert driver.failed is not None and "loraplane-tp-rank1" in driver.failed
        with pytest.raises(EngineFault, match="tensor-parallel worker died"):
            engine.generate([[4, 5, 6]], greedy)
    finally:
        driver.close()
        torch.set_num_threads(threads)
    assert not worker.is_alive()
