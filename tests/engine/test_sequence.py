"""SamplingParams, EngineConfig and Sequence validate their inputs and name the bad field."""

from __future__ import annotations

import pytest

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.sequence import SamplingParams, Sequence, SequenceStatus


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_sampling_params_reject_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_sequences():
    params = SamplingParams(temperature=0, stop="###", stop_token_ids=[3, 4])
    assert params.stop == ("###",)
    assert params.stop_token_ids == (3, 4)
    assert params.greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": ""}, "model"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"cpu_kv_cache_bytes": 0}, "cpu_kv_cache_bytes"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
        ({"cuda_graph_batch_sizes": (4, 2)}, "cuda_graph_batch_sizes"),
        ({"seed": None}, "seed"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"max_passed_over_s": -1}, "max_passed_over_s"),
        ({"max_passed_over_s": float("nan")}, "max_passed_over_s"),
        ({"max_waiting_seqs": 0}, "max_waiting_seqs"),
        ({"max_queue_wait_s": 0}, "max_queue_wait_s"),
        ({"max_queue_wait_s": float("inf")}, "max_queue_wait_s"),
        ({"adapter_load_timeout_s": 0}, "adapter_load_timeout_s"),
    ],
)
def test_engine_config_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}"):
        EngineConfig(**{"model": "/m", **kwargs})


def test_engine_config_defaults_are_valid():
    config = EngineConfig(model="/m", cuda_graph_batch_sizes=[1, 2, 4])
    assert config.cuda_graph_batch_sizes == (1, 2, 4)
    assert config.max_model_len is None


def test_sequence_tracks_tokens():
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4))
    assert seq.status is SequenceStatus.WAITING
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    seq.append_token(9)
    assert seq.token_ids == [1, 2, 3, 9]
    assert seq.output_token_ids == [9]
    assert seq.prompt_token_ids == [1, 2, 3]
    assert seq.last_token_id == 9
    assert seq.request_id.startswith("req-")


def test_sequence_ids_increase_and_bad_prompts_are_refused():
    first, second = Sequence([1]), Sequence([1])
    assert second.seq_id > first.seq_id
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence([])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence([1, -2])


def test_scheduling_side_imports_without_torch():
    """The scheduling side must run where torch is absent (and never drag transformers in)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import loraplane.engine.core.async_engine, loraplane.engine.core.llm_engine\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'numpy', 'triton') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
