"""Token metering through the real server: 500 mixed requests of two tenants (whole and streamed, n of 1 and 2,
the base and an adapter, some left by their client midway) are counted in the usage log, the counters and
``GET /admin/usage`` exactly as the ``usage`` their answers carried, and as the server counted its tokens."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loraplane.http.admin import create_admin_app
from loraplane.http.app import create_app
from loraplane.http.auth import ApiKeys
from loraplane.http.metrics import Metrics
from loraplane.http.usage import OTHER, UsageMeter
from loraplane.http.usage_log import UsageLog
from loraplane.serve.sources import open_local_folder
from tests.adapter_factory import make_peft_folder
from tests.http.conftest import MODEL_NAME, ServerThread, wait_until

pytestmark = pytest.mark.timeout(600)

ADMIN = {"Authorization": "Bearer admin-token-usage"}
KEYS = {"team-a": "key-a-0123456789", "team-b": "key-b-0123456789"}
ADAPTER = "meter-chat"
REQUESTS = 500


@pytest.fixture(scope="module")
def metered(engine, tiny_chat_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("usage")
    keys = tmp / "api-keys.yaml"
    keys.write_text("keys:\n" + "".join(f"  - key: {k}\n    name: {n}\n" for n, k in KEYS.items()))
    config = json.loads((tiny_chat_model_dir / "config.json").read_text())
    version = asyncio.run(
        _load(engine, make_peft_folder(tmp / "adapter", base_config=config, rank=4, seed=3))
    )
    metrics = Metrics()
    meter = UsageMeter(metrics.registry, metrics.adapter_label, top_n=3, usage_log=UsageLog(tmp / "log"))
    app = create_app(engine, engine.engine.tokenizer, MODEL_NAME, ApiKeys.from_file(keys), metrics=metrics,
                     usage=meter)  # fmt: skip
    admin = create_admin_app(app.state.server, ADMIN["Authorization"].split()[1])
    try:
        with ServerThread(app) as public, ServerThread(admin) as admin_server:
            yield public, admin_server, meter, metrics, version
    finally:
        meter.log.close()
        asyncio.run(engine.unload_adapter(ADAPTER))


async def _load(engine, folder: Path) -> str:
    local = open_local_folder(folder, None, engine.info())
    await engine.load_adapter(ADAPTER, local.version, local.path, local.digest,
                              expected_base_hash=engine.info().base_hash)  # fmt: skip
    await engine.warm_adapter(ADAPTER, local.version, gpu=True)
    await engine.set_alias(ADAPTER, local.version)
    return local.version


def _plan(i: int, rng: random.Random) -> dict:
    """Request i: its tenant, model, endpoint, whether it streams, its n, and whether its client leaves."""
    kind = ("whole", "whole", "whole", "whole", "whole", "stream", "stream", "stream", "stream", "leave")[
        i % 10
    ]
    if i % 50 == 25:
        kind = "leave-whole"  # the client gives up waiting for a whole answer
    leaving = kind.startswith("leave")
    body = {"model": MODEL_NAME if i % 3 == 0 else ADAPTER, "max_tokens": 48 if leaving else rng.randint(1, 5),
            "temperature": 1.0, "seed": i, "n": 2 if i % 7 == 0 and not leaving else 1}  # fmt: skip
    if leaving:
        body["ignore_eos"] = True
    chat = i % 4 < 2
    if chat:
        body["messages"] = [{"role": "user", "content": f"hello number {i} " * rng.randint(1, 4)}]
    else:
        body["prompt"] = f"once upon a time {i}" * rng.randint(1, 3)
    if kind in ("stream", "leave"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": kind == "leave"}
    tenant = "team-a" if i % 2 else "team-b"
    return {"i": i, "tenant": tenant, "kind": kind, "path": "/v1/chat/completions" if chat else "/v1/completions",
            "body": body}  # fmt: skip


def _send(url: str, plan: dict) -> dict:
    headers = {"Authorization": f"Bearer {KEYS[plan['tenant']]}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        if plan["kind"] == "whole":
            reply = client.post(plan["path"], json=plan["body"])
            assert reply.status_code == 200, reply.text
            return {**plan, "id": reply.json()["id"], "usage": reply.json()["usage"]}
        if plan["kind"] == "leave-whole":
            with pytest.raises(httpx.ReadTimeout):
                client.post(plan["path"], json=plan["body"], timeout=httpx.Timeout(120, read=0.05))
            return {**plan, "id": None, "usage": None}
        return _stream(client, plan)


def _stream(client: httpx.Client, plan: dict) -> dict:
    """A streamed answer: its id and final usage; a leaving client reads two chunks with text and closes."""
    answer, texts = {**plan, "id": None, "usage": None, "seen": 0}, 0
    with client.stream("POST", plan["path"], json=plan["body"]) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            answer["id"] = chunk["id"]
            if chunk.get("usage"):
                answer["seen"] = chunk["usage"]["completion_tokens"]  # continuous usage: so far
                answer["usage"] = chunk["usage"] if not chunk["choices"] else None
            texts += any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk["choices"])
            if plan["kind"] == "leave" and texts == 2:
                return answer  # leaving the block closes the connection mid-stream
    assert answer["usage"] is not None, "a stream that ran to its end carries its usage last"
    return answer


def _sample_sum(metrics: Metrics, name: str, **match) -> float:
    families = metrics.registry.collect()
    return sum(s.value for f in families for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in match.items()))  # fmt: skip


def test_500_mixed_requests_are_metered_exactly_as_answered(metered):
    public, admin, meter, metrics, version = metered
    rng = random.Random(25)
    plans = [_plan(i, rng) for i in range(REQUESTS)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _send(public.url, p), plans))
    wait_until(lambda: meter.log.lines == REQUESTS, "a usage line for every request", timeout=60)
    records = list(meter.log.read(0))
    by_id = {r.id: r for r in records}
    assert len(records) == len(by_id) == REQUESTS

    for answer in answers:
        if answer["usage"] is not None:  # ran to its end: the line is the usage the client got
            r = by_id[answer["id"]]
            assert (r.prompt_tokens, r.completion_tokens) == (
                answer["usage"]["prompt_tokens"],
                answer["usage"]["completion_tokens"],
            ), answer
            assert r.status == "ok" and r.tenant == answer["tenant"]
            assert (r.adapter, r.version) == (
                (None, None) if answer["body"]["model"] == MODEL_NAME else (ADAPTER, version)
            )
        elif answer["kind"] == "leave":  # left midway: counted for at least what it was shown generating
            r = by_id[answer["id"]]
            assert answer["seen"] <= r.completion_tokens <= 48 and r.prompt_tokens > 0
    left = [by_id[a["id"]] for a in answers if a["kind"] == "leave"]
    assert any(r.status == "aborted" and r.completion_tokens < 48 for r in left), "no stream was cut short"
    assert sum(r.status == "aborted" for r in records) >= 5

    # The same tokens, however they are counted: the server's own token counters, the metered counters.
    prompt, completion = sum(r.prompt_tokens for r in records), sum(r.completion_tokens for r in records)
    assert _sample_sum(metrics, "loraplane_prompt_tokens_total") == prompt
    assert _sample_sum(metrics, "loraplane_generation_tokens_total") == completion
    assert _sample_sum(metrics, "loraplane_tokens_total", type="prompt") == prompt
    assert _sample_sum(metrics, "loraplane_tokens_total", type="completion") == completion
    assert _sample_sum(metrics, "loraplane_usage_requests_total", status="ok") == sum(
        r.status == "ok" for r in records
    )

    # Wired with top_n=3: two tenants x (base, adapter) are four label sets, one folds into tenant "other".
    label_sets = {(s.labels["tenant"], s.labels["adapter"], s.labels["version"]) for f in metrics.registry.collect()
                  for s in f.samples if s.name == "loraplane_tokens_total"}  # fmt: skip
    assert len(label_sets) == 4 and sum(t == OTHER for t, _, _ in label_sets) == 1
    assert {t for t, _, _ in label_sets} <= {"team-a", "team-b", OTHER}
    assert _sample_sum(metrics, "loraplane_usage_folded_series_total") == 1

    summary = httpx.get(f"{admin.url}/admin/usage", params={"since": "0", "limit": 10}, headers=ADMIN).json()
    assert summary["matched"] == REQUESTS and len(summary["records"]) == 10 and summary["truncated"]
    assert sum(t["prompt_tokens"] for t in summary["totals"]) == prompt
    assert sum(t["completion_tokens"] for t in summary["totals"]) == completion
    team_a = httpx.get(f"{admin.url}/admin/usage", headers=ADMIN,
                       params={"since": "1970-01-01T00:00:00Z", "tenant": "team-a", "adapter": ADAPTER}).json()  # fmt: skip
    assert team_a["matched"] == sum(r.tenant == "team-a" and r.adapter == ADAPTER for r in records)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({}, "since"),
        ({"since": "last week"}, "since"),
        ({"since": "2026-01-01T00:00:00"}, "since"),
        ({"since": "0", "tenant": "a b"}, "tenant"),
        ({"since": "0", "limit": "0"}, "limit"),
    ],  # fmt: skip
)
def test_admin_usage_refuses_bad_queries_naming_the_field(metered, params, field):
    _, admin, *_ = metered
    reply = httpx.get(f"{admin.url}/admin/usage", params=params, headers=ADMIN)
    assert reply.status_code in (400, 422) and reply.json()["message"].startswith(f"{field}:"), reply.text
    assert httpx.get(f"{admin.url}/admin/usage", params={"since": "0"}).status_code == 401
