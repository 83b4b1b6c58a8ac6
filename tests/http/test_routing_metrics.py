"""The routers' metric families on a real server, read as the endpoint picker reads them, while requests run.

An engine that schedules one request at a time (max_num_seqs=1) and steps slowly (a step listener sleeps) keeps
one adapter's request running and another's waiting long enough to scrape both /metrics endpoints.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http import gie_picker
from tests.http.adapter_fixtures import ADMIN_HEADERS, adapter_world
from tests.http.conftest import MAX_MODEL_LEN, wait_until

STEP_SLEEP_S = 0.02


@pytest.fixture(scope="module")
def slow_engine(tiny_chat_model_dir):
    from loraplane.engine.core.async_engine import AsyncEngine
    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.core.llm_engine import LLMEngine
    from loraplane.serve.main import load_tokenizer

    config = EngineConfig(model=str(tiny_chat_model_dir), device="cpu", dtype="float32", max_num_seqs=1,
                          max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, max_loras=4)  # fmt: skip
    engine = AsyncEngine(LLMEngine(config, tokenizer=load_tokenizer(str(tiny_chat_model_dir))))
    engine.add_step_listener(lambda _stats: time.sleep(STEP_SLEEP_S))  # a step of a slower device
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory, slow_engine, tiny_chat_model_dir):
    with adapter_world(tmp_path_factory.mktemp("routing"), slow_engine, tiny_chat_model_dir,
                       routing_metrics=True) as w:  # fmt: skip
        assert w.put("chat", w.published["chat-v1"]).status_code == 200
        assert w.put("support", w.published["support-v1"]).status_code == 200
        yield w


def admin_text(world) -> str:
    response = httpx.get(f"{world.admin.url}/metrics", headers=ADMIN_HEADERS)
    assert response.status_code == 200
    return response.text


def public_text(world) -> str:
    response = httpx.get(f"{world.public.url}/metrics")  # no key: the picker scrapes without one
    assert response.status_code == 200
    return response.text


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def lora_info(text: str) -> dict[str, str]:
    found = [labels for (name, labels) in samples(text) if name == "vllm:lora_requests_info"]
    assert len(found) == 1, found
    return dict(found[0])


def generate(world, model: str, max_tokens: int, done: list) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    done.append(httpx.post(f"{world.public.url}/v1/completions", json=body, timeout=120).status_code)


def test_idle_server_speaks_the_protocol(world):
    for text in (admin_text(world), public_text(world)):
        pod = gie_picker.extract(text)
        assert pod.errors == []
        assert (pod.waiting_queue_size, pod.running_requests_size) == (0, 0)
        assert pod.max_active_models == 4 and pod.active_models == {} and pod.waiting_models == {}
        assert pod.cache_num_gpu_blocks == 64 and pod.cache_block_size == 16
    seen = samples(admin_text(world))
    # Both adapters were warmed to the GPU: resident and idle, which lora_requests_info cannot show.
    for name in ("chat", "support"):
        assert seen[("vllm:lora_adapter_loaded", (("adapter_name", name), ("level", "gpu"), ("pinned", "false"),
                                                  ("rank", "4")))] == 1  # fmt: skip
    assert seen[("vllm:num_gpu_loaded_lora_adapters", ())] == 2
    assert seen[("vllm:max_gpu_lora_adapters", ())] == 4
    assert seen[("vllm:lora_adapter_load_seconds_count", ())] >= 2
    assert seen[("loraplane_requests_running", ())] == 0  # our own metrics stay beside them


def test_running_and_waiting_adapters_while_requests_are_in_flight(world):
    done: list[int] = []
    first = threading.Thread(target=generate, args=(world, "chat", 120, done))
    first.start()
    wait_until(lambda: gie_picker.extract(public_text(world)).running_requests_size == 1, "chat running")
    second = threading.Thread(target=generate, args=(world, "support", 4, done))
    second.start()
    wait_until(lambda: gie_picker.extract(public_text(world)).waiting_queue_size == 1, "support waiting")
    text = public_text(world)
    pod = gie_picker.extract(text)
    assert pod.errors == []
    assert pod.active_models == {"chat": 0} and pod.waiting_models == {"support": 0}
    assert pod.max_active_models == 4 and pod.kv_cache_usage_percent > 0
    info = lora_info(text)  # prometheus_client reads the same labels
    assert info == {"max_lora": "4", "running_lora_adapters": "chat", "waiting_lora_adapters": "support"}
    assert gie_picker.lora_affinity(pod, "chat") == 1.0
    assert gie_picker.lora_affinity(pod, "tenant-b") == 0.8  # 2 of 4 slots named: room to load
    # The admin endpoint has the same families, and ours beside them.
    admin = gie_picker.extract(admin_text(world))
    assert admin.active_models == pod.active_models and admin.waiting_models == pod.waiting_models
    first.join(timeout=120)
    second.join(timeout=120)
    assert done == [200, 200]
    idle = gie_picker.extract(public_text(world))
    assert idle.active_models == {} and idle.waiting_models == {} and idle.running_requests_size == 0


def test_lora_info_value_is_the_time_of_the_last_change(world):
    before = samples(public_text(world))
    stamp = [v for (name, _), v in before.items() if name == "vllm:lora_requests_info"][0]
    assert abs(stamp - time.time()) < 3600 and stamp <= time.time()
    time.sleep(0.05)
    assert [v for (n, _), v in samples(public_text(world)).items() if n == "vllm:lora_requests_info"] == [
        stamp
    ]


def test_public_metrics_hold_only_the_routers_families(world):
    names = {name for name, _ in samples(public_text(world))}
    assert names and all(name.startswith("vllm:") for name in names), names


def test_picker_rules_refuse_what_expfmt_refuses():
    with pytest.raises(gie_picker.ParseError):
        gie_picker.parse('vllm:x{running-adapters="a"} 1\n')  # not a legacy label name
    with pytest.raises(gie_picker.ParseError):
        gie_picker.parse("# TYPE a gauge\n# TYPE a gauge\na 1\n")
    pod = gie_picker.extract('vllm:lora_requests_info{max_lora="x",running_lora_adapters=" a, ,b"} 5\n')
    assert pod.active_models == {"a": 0, "b": 0} and pod.max_active_models == 0
    assert any("invalid syntax" in e for e in pod.errors)
    assert any("vllm:num_requests_waiting" in e for e in pod.errors)
