"""/metrics on the admin port, parsed with prometheus_client's parser after known traffic."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.http.metrics import Metrics
from tests.http.adapter_fixtures import ADMIN_HEADERS, adapter_world
from tests.http.conftest import MAX_MODEL_LEN, MODEL_NAME


@pytest.fixture(scope="module")
def world(tmp_path_factory, engine, tiny_chat_model_dir):
    # One adapter name as a label at most: the second adapter counts as "other".
    with adapter_world(tmp_path_factory.mktemp("metrics"), engine, tiny_chat_model_dir,
                       metrics=Metrics(max_adapter_labels=1)) as w:  # fmt: skip
        yield w


def scrape(world) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{world.admin.url}/metrics", headers=ADMIN_HEADERS).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_after_known_traffic(world):
    assert world.put("chat", world.published["chat-v1"]).status_code == 200
    assert world.put("support", world.published["support-v1"]).status_code == 200
    before = scrape(world)
    url = f"{world.public.url}/v1/completions"
    for model, n in (("chat", 3), ("support", 2), (MODEL_NAME, 1)):
        for _ in range(n):
            body = {"model": model, "prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            assert httpx.post(url, json=body).status_code == 200
    assert httpx.post(url, json={"model": "chat", "prompt": "hi", "seed": -1}).status_code == 400
    assert httpx.post(url, json={"model": "nope", "prompt": "hi"}).status_code == 404
    after = scrape(world)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = {"endpoint": "/v1/completions", "status": "200"}
    assert delta("loraplane_requests_total", **ok, adapter="chat") == 3
    assert delta("loraplane_requests_total", **ok, adapter="other") == 2  # past the label limit
    assert delta("loraplane_requests_total", **ok, adapter="base") == 1
    assert delta("loraplane_requests_total", endpoint="/v1/completions", status="400", adapter="none") == 1
    assert delta("loraplane_requests_total", endpoint="/v1/completions", status="404", adapter="none") == 1
    assert delta("loraplane_generation_tokens_total", adapter="chat") == 15
    assert delta("loraplane_generation_tokens_total", adapter="base") == 5
    assert delta("loraplane_prompt_tokens_total", adapter="chat") > 0
    ttft = sum(
        delta("loraplane_time_to_first_token_seconds_count", tier=t)
        for t in ("gpu", "host", "disk", "remote")
    )
    assert ttft == 6
    assert delta("loraplane_inter_token_latency_seconds_count") == 6 * 4
    assert delta("loraplane_request_duration_seconds_count", endpoint="/v1/completions") == 8
    assert value(after, "loraplane_requests_waiting") == 0 and value(after, "loraplane_requests_running") == 0
    assert value(after, "loraplane_step_adapters_count") > value(before, "loraplane_step_adapters_count")
    assert value(after, "loraplane_kv_blocks_total") > 0
    # Adapter lifecycle: two loads, each phase timed, both adapters held on a tier.
    assert value(after, "loraplane_adapter_loads_total") >= 2
    for phase in ("download", "verify", "load", "warm"):
        assert value(after, "loraplane_adapter_phase_seconds_count", phase=phase) >= 2, phase
    assert sum(value(after, "loraplane_adapters", tier=t) for t in ("gpu", "host", "disk")) >= 2
    assert value(after, "loraplane_host_cache_bytes") > 0
    # Split memory: the unified pool's gauge has no samples.
    assert not any(name == "loraplane_gpu_memory_bytes" for name, _ in after)


def test_verification_failures_are_counted_by_reason(world):
    before = scrape(world)
    assert world.put("rogue", world.published["rogue-v1"]).status_code == 422
    after = scrape(world)
    key = ("loraplane_adapter_verification_failures_total", (("reason", "UnknownKey"),))
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert not any("key-" in str(k) or "Bearer" in str(k) for k in after)


@pytest.fixture(scope="module")
def unified_engine(tiny_chat_model_dir):
    from loraplane.engine.core.async_engine import AsyncEngine
    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.core.llm_engine import LLMEngine
    from loraplane.serve.main import load_tokenizer

    config = EngineConfig(model=str(tiny_chat_model_dir), device="cpu", dtype="float32",
                          max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, memory_mode="unified")  # fmt: skip
    engine = AsyncEngine(LLMEngine(config, tokenizer=load_tokenizer(str(tiny_chat_model_dir))))
    yield engine
    engine.close()


def test_unified_memory_bytes_by_use(tmp_path_factory, unified_engine, tiny_chat_model_dir):
    with adapter_world(tmp_path_factory.mktemp("unified"), unified_engine, tiny_chat_model_dir,
                       metrics=Metrics()) as world:  # fmt: skip
        assert world.put("chat", world.published["chat-v1"]).status_code == 200
        body = {"model": "chat", "prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{world.public.url}/v1/completions", json=body).status_code == 200
        after = scrape(world)
    memory = {
        use: after.get(("loraplane_gpu_memory_bytes", (("use", use),))) for use in ("kv", "adapters", "free")
    }
    assert None not in memory.values(), memory  # every use has a sample
    assert memory["adapters"] > 0 and memory["kv"] > 0  # the adapter's rows and the request's KV were held
    pool = unified_engine.engine.stats().unified_memory  # the three uses always add up to the whole pool
    assert sum(memory.values()) == pool["bytes_kv"] + pool["bytes_adapters"] + pool["bytes_free"] > 0
