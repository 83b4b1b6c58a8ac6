"""GPU room goes to the oldest waiting adapter first: a younger adapter that would fit the rows one finishing
request frees must not take them while an older one, still wanted by its requests, waits for room that
the end of the running requests will give it (else a stream of smaller adapters starves it until its requests
time out). An older adapter that needs more (pinned adapters, or adapters whose queue keeps filling, hold the
rest), or that no request waits for any more, holds nobody back."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from tests.engine.peft_adapters import save_peft_adapter  # noqa: E402

RANKS = {"big1": 16, "small1": 8, "old": 16, "young": 8}


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("order")
    return {
        n: save_peft_adapter(tiny_llama_dir, root / n, seed=i, r=r, lora_alpha=r, target_modules=["q_proj"])
        for i, (n, r) in enumerate(RANKS.items())
    }


def tiers(model_dir, folders):
    """Pools of 32 rows (two r16 adapters) holding big1 (r16) and small1 (r8), both in use: 8 rows free."""
    cfg = EngineConfig(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=64,
                       num_kv_blocks=128, max_lora_rank=16, max_loras=2)  # fmt: skip
    lora = LLMEngine(cfg).runner.lora
    for name, folder in folders.items():
        lora.register(name, "v1", folder, name, lora.parse(folder))
    for key in ("big1@v1", "small1@v1"):
        lora.ensure_resident([key])
        lora.acquire(key)  # a running request holds it
    return lora


def ask(lora, key: str) -> bool:
    """A request for ``key`` arrives (counted in, as the async engine does) and the scheduler asks for it."""
    lora.hold(key)
    lora.request(key)
    return lora.is_ready(key)


def test_a_younger_adapter_waits_behind_an_older_one_that_needs_the_room(tiny_llama_dir, folders):
    lora = tiers(tiny_llama_dir, folders)
    assert not ask(lora, "old@v1")  # 16 rows needed, 8 free: waits for big1 or small1 to finish
    assert not ask(lora, "young@v1"), "the younger r8 adapter took the rows before the older one"
    assert lora.tier_of("young@v1") == "host"
    lora.release("big1@v1")  # big1's request finishes: its 16 rows go to the oldest waiting adapter
    lora.poll()
    assert lora.is_ready("old@v1") and lora.tier_of("big1@v1") == "host"
    assert lora.is_ready("young@v1")  # then the younger one, in the 8 rows left


def test_an_older_adapter_that_needs_more_or_is_no_longer_wanted_holds_nobody_back(tiny_llama_dir, folders):
    lora = tiers(tiny_llama_dir, folders)
    lora.set_pinned("big1@v1", True)
    lora.set_pinned("small1@v1", True)  # 8 unpinned rows: old (r16) can never fit
    assert not ask(lora, "old@v1")
    assert ask(lora, "young@v1")
    lora = tiers(tiny_llama_dir, folders)
    for key in ("big1@v1", "small1@v1", "big1@v1", "small1@v1"):
        lora.hold(key)  # each runs one request and has another queued: their rows will not free up soon
    assert not ask(lora, "old@v1")
    assert ask(lora, "young@v1")
    lora = tiers(tiny_llama_dir, folders)
    assert not ask(lora, "old@v1")
    lora.note_request("old@v1", -1)  # its request was aborted: it still sits in the load queue
    assert ask(lora, "young@v1")
