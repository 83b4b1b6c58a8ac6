"""Adapter tiers and the AsyncEngine adapter surface on a real tiny model (CPU): load / warm / alias / pin /
unload, tier accounting, nothing held or pinned is ever evicted, an alias switch is atomic for requests."""

from __future__ import annotations

import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from loraplane.engine.api import AdapterError, StepStats  # noqa: E402
from loraplane.engine.core.async_engine import AsyncEngine  # noqa: E402
from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams  # noqa: E402
from tests.engine.peft_adapters import save_peft_adapter  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("res")
    specs = {
        f"a{i}": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) for i in range(4)
    }
    return {
        n: save_peft_adapter(tiny_llama_dir, root / n, seed=10 + i, **s)
        for i, (n, s) in enumerate(specs.items())
    }


def engine_for(model_dir, **kw) -> LLMEngine:
    torch.set_num_threads(1)
    cfg = EngineConfig(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=64,
                       num_kv_blocks=128, max_lora_rank=16, **kw)  # fmt: skip
    return LLMEngine(cfg)


def test_pinned_and_acquired_are_never_evicted(tiny_llama_dir, folders):
    lora = engine_for(tiny_llama_dir, max_loras=2).runner.lora  # room for two r16 adapters
    for name, folder in folders.items():
        lora.register(name, "v1", folder, name, lora.parse(folder), pin=name == "a0")
    lora.ensure_resident(["a0@v1"])
    lora.ensure_resident(["a1@v1"])
    lora.acquire("a1@v1")
    lora.request("a2@v1")  # the pool is full of what must stay: a2 waits, nothing is evicted
    assert not lora.is_ready("a2@v1") and lora.tier_of("a2@v1") == "host"
    assert lora.tier_of("a0@v1") == lora.tier_of("a1@v1") == "gpu"
    lora.release("a1@v1")
    lora.poll()  # the pending request goes through as soon as a1 is free
    assert lora.is_ready("a2@v1") and lora.tier_of("a1@v1") == "host" and lora.tier_of("a0@v1") == "gpu"
    stats = lora.tier_stats()
    per = lora.gpu.bytes_of["a0@v1"]
    assert stats["gpu"] == {"bytes": 2 * per, "entries": 2, "capacity": lora.gpu.capacity_bytes}
    assert stats["host"]["entries"] == 4 and stats["host"]["bytes"] == sum(
        w.nbytes for w in lora.host.entries.values()
    )
    # a host tier of one adapter: the LRU drops to disk whatever nothing needs, and reloads it on request
    lora.host.limit_bytes = per
    lora.register("extra", "v1", folders["a3"], "x", lora.parse(folders["a3"]))
    assert lora.tier_of("a3@v1") == "disk" and lora.tier_of("a0@v1") == "gpu"  # pinned stays in host too
    assert "a0@v1" in lora.host.entries
    lora.ensure_resident(["a3@v1"])
    assert lora.tier_of("a3@v1") == "gpu"


async def collect(stream) -> list[int]:
    return [t async for out in stream for t in out.new_token_ids]


async def test_async_surface_load_warm_alias_pin_unload(tiny_llama_dir, folders):
    reference = engine_for(tiny_llama_dir)
    for name, folder in folders.items():
        reference.runner.lora.register(name, "v1", folder, name, reference.runner.lora.parse(folder))

    def alone(key):
        seq = reference.add_request(PROMPT, GREEDY, adapter=key)
        while reference.has_unfinished():
            reference.step()
        return list(seq.output_token_ids)

    engine = AsyncEngine(engine_for(tiny_llama_dir))
    steps: list[StepStats] = []
    engine.add_step_listener(steps.append)
    try:
        info = engine.info()
        assert info.base_hash == engine.engine.runner.base_hash and info.vocab_size == 256
        assert info.max_lora_rank == 16 and "q_proj" in info.target_modules and info.max_model_len == 512
        with pytest.raises(AdapterError) as err:
            await engine.load_adapter("n", "v1", folders["a0"], "d0", expected_base_hash="f" * 64)
        assert err.value.reason == "BaseMismatch"
        a = await engine.load_adapter("n", "v1", folders["a0"], "d0", expected_base_hash=info.base_hash)
        assert (a.tier, a.state, a.rank, a.serving) == ("host", "loaded", 16, False) and a.timings["load"] > 0
        assert (await engine.load_adapter("n", "v1", folders["a0"], "d0")).digest == "d0"  # idempotent
        with pytest.raises(AdapterError) as err:
            await engine.load_adapter("n", "v1", folders["a1"], "other")
        assert err.value.reason == "AdapterConflict"
        with pytest.raises(AdapterError) as err:
            engine.add_request(PROMPT, GREEDY, adapter="n@v9")
        assert err.value.reason == "AdapterNotFound"
        w = await engine.warm_adapter("n", "v1")
        assert (w.tier, w.state) == ("gpu", "warm") and w.timings["warm"] > 0
        await engine.set_alias("n", "v1")
        assert engine.resolve("n") == "n@v1" and engine.resolve("nope") is None
        v1_tokens = await collect(engine.add_request(PROMPT, GREEDY, adapter=engine.resolve("n")))
        assert v1_tokens == alone("a0@v1") and steps and steps[-1].num_adapters == 1

        # load v2 beside v1; a request resolved before the switch keeps v1 even after it
        await engine.load_adapter("n", "v2", folders["a1"], "d1")
        before = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                                    adapter=engine.resolve("n"))  # fmt: skip
        await engine.set_alias("n", "v2")
        after = engine.add_request(PROMPT, GREEDY, adapter=engine.resolve("n"))
        got_before, got_after = await asyncio.gather(collect(before), collect(after))
        assert got_before[:6] == v1_tokens and got_after == alone("a1@v1")
        assert {i.key: i.serving for i in engine.adapters()} == {"n@v1": False, "n@v2": True}
        await engine.load_adapter("m", "v1", folders["a2"], "d2")  # one adapter's versions, not every one
        assert [i.key for i in engine.adapters("n")] == ["n@v1", "n@v2"]
        assert [i.key for i in engine.adapters("m")] == ["m@v1"] and engine.adapters("x") == []
        assert await engine.unload_adapter("m") == ["m@v1"]

        assert (await engine.pin_adapter("n", "v1", True)).pinned
        # unloading a version with a request in flight: no new requests, the running one finishes on it
        slow = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                  adapter="n@v1")  # fmt: skip
        stream = aiter(slow)
        first = await anext(stream)
        assert await engine.unload_adapter("n", "v1") == ["n@v1"]
        with pytest.raises(AdapterError):
            engine.add_request(PROMPT, GREEDY, adapter="n@v1")
        rest = [t async for out in stream for t in out.new_token_ids]
        tokens = first.new_token_ids + rest
        assert len(tokens) == 40 and tokens[:6] == v1_tokens
        assert [i.key for i in engine.adapters()] == ["n@v2"]
        for _ in range(200):  # freed by the engine thread right after the request's last step
            if engine.tier_of("n@v1") is None:
                break
            await asyncio.sleep(0.01)
        assert engine.tier_of("n@v1") is None
        assert await engine.unload_adapter("n") == ["n@v2"] and engine.resolve("n") is None
    finally:
        await engine.aclose()


def test_one_slot_numbering_across_module_pools(tiny_llama_dir, folders, tmp_path):
    """A version has the same slot in every pool it uses and rank 0 in the rest: one metadata per step."""
    lora = engine_for(tiny_llama_dir).runner.lora
    qv = save_peft_adapter(
        tiny_llama_dir, tmp_path / "qv", seed=5, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    lora.register("qv", "v1", qv, "qv", lora.parse(qv))
    lora.register("a0", "v1", folders["a0"], "a0", lora.parse(folders["a0"]))
    lora.ensure_resident(["a0@v1", "qv@v1"])
    slot = lora.gpu.slot_id["qv@v1"]
    assert set(lora.gpu.slots["qv@v1"].values()) == {slot} and lora.gpu.pools["k_proj"].ranks[slot] == 0
    metas = lora.prepare_step([("qv@v1", 2), ("a0@v1", 1), (None, 3)], "prefill")
    shared = {id(m) for m in metas.values() if m is not None}
    assert len(shared) == 1 and {m for m, v in metas.items() if v is None} == {
        "k_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
    }
    with pytest.raises(Exception, match="not a free slot"):
        lora.gpu.pools["q_proj"].allocate(8, 1.0, slot=slot)


async def test_warm_fails_on_non_finite_logits(tiny_llama_dir, folders, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "huge"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((folders["a0"] / "adapter_config.json").read_bytes())
    tensors = load_file(str(folders["a0"] / "adapter_model.safetensors"))
    save_file(
        {k: v * 2e38 if "lora_B" in k else v for k, v in tensors.items()},
        str(bad / "adapter_model.safetensors"),
    )
    engine = AsyncEngine(engine_for(tiny_llama_dir))
    try:
        await engine.load_adapter("huge", "v1", bad, "d")  # finite weights: accepted
        with pytest.raises(AdapterError) as err:
            await engine.warm_adapter("huge", "v1")
        assert err.value.reason == "WarmFailed"
        (info,) = engine.adapters()
        assert info.state == "failed" and "WarmFailed" in info.error
    finally:
        await engine.aclose()


async def test_an_unload_waits_for_a_request_still_queued_for_the_engine_thread(tiny_llama_dir, folders):
    """A request submitted just before its version is unloaded runs on that version: the step's end that
    frees unloading versions (poll) comes between the submission and the engine thread taking the request,
    here on purpose: the engine thread is held, and the test runs that poll itself."""
    engine = AsyncEngine(engine_for(tiny_llama_dir))
    held, release = threading.Event(), threading.Event()

    def hold_the_engine_thread():
        held.set()
        release.wait(30)

    try:
        await engine.load_adapter("n", "v1", folders["a0"], "d0")
        await engine.warm_adapter("n", "v1")
        await engine.set_alias("n", "v1")
        expected = await collect(engine.add_request(PROMPT, GREEDY, adapter="n@v1"))
        blocked = engine._on_engine_thread(hold_the_engine_thread)
        assert await asyncio.to_thread(held.wait, 30)
        stream = engine.add_request(PROMPT, GREEDY, adapter=engine.resolve("n"))  # queued: the thread is held
        lora = engine.engine.adapters
        lora.mark_unloading("n", "v1")  # what unload_adapter does first (its poll waits for the thread)
        lora.poll()  # a step's end on the engine thread: frees unloading versions that nothing holds
        assert lora.is_registered("n@v1"), "freed under a request already submitted"
        with pytest.raises(AdapterError):
            engine.add_request(PROMPT, GREEDY, adapter="n@v1")  # new requests are refused at once
        release.set()
        await blocked
        assert await collect(stream) == expected
        for _ in range(200):  # freed right after the request's last step
            if engine.tier_of("n@v1") is None:
                break
            await asyncio.sleep(0.01)
        assert engine.tier_of("n@v1") is None
    finally:
        release.set()
        engine.close()


async def test_a_lease_lets_a_requests_later_parts_start_on_a_version_being_unloaded(tiny_llama_dir, folders):
    """The extra choices of ``n > 1`` start after the first one's first token: a lease taken with the first
    keeps the version registered, so they start on it even once its unload has begun; nothing else does, and
    the version is freed once the lease and its requests are done."""
    engine = AsyncEngine(engine_for(tiny_llama_dir))
    try:
        await engine.load_adapter("n", "v1", folders["a0"], "d0")
        await engine.set_alias("n", "v1")
        expected = await collect(engine.add_request(PROMPT, GREEDY, adapter="n@v1"))
        lease = engine.lease_adapter("n@v1")
        assert await engine.unload_adapter("n", "v1") == ["n@v1"]
        assert engine.engine.adapters.is_registered("n@v1"), "freed under a live lease"
        with pytest.raises(AdapterError) as err:  # a request without the lease is refused
            engine.add_request(PROMPT, GREEDY, adapter="n@v1")
        assert err.value.reason == "AdapterNotFound"
        later = engine.add_request(PROMPT, GREEDY, adapter="n@v1", lease=lease)
        lease.release()
        lease.release()  # idempotent: counted out once
        assert await collect(later) == expected
        with pytest.raises(AdapterError):  # a released lease admits nothing more
            engine.add_request(PROMPT, GREEDY, adapter="n@v1", lease=lease)
        for _ in range(200):  # freed once the lease and its request are done
            if not engine.engine.adapters.is_registered("n@v1"):
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.adapters.is_registered("n@v1")
        with pytest.raises(AdapterError):  # no lease on a version that takes no requests
            engine.lease_adapter("n@v1")
    finally:
        engine.close()


async def test_a_forgotten_lease_is_released_by_the_collector(tiny_llama_dir, folders):
    engine = AsyncEngine(engine_for(tiny_llama_dir))
    try:
        await engine.load_adapter("n", "v1", folders["a0"], "d0")
        engine.lease_adapter("n@v1")  # dropped at once
        await engine.unload_adapter("n", "v1")
        for _ in range(200):
            if not engine.engine.adapters.is_registered("n@v1"):
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.adapters.is_registered("n@v1")
    finally:
        engine.close()
