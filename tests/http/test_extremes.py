"""Every numeric field at its type's extremes: each answer is 200 or a 400 naming the field, never a 5xx,
and the engine serves a normal request afterwards (one bad value must not stop the engine for everyone)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.http.conftest import MODEL_NAME

EXTREMES = [
    0,
    -1,
    2**31,
    2**63,
    2**64,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "7",
    [1],
    True,
]
BASE = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0.7, "ignore_eos": True}
ENDPOINTS = {
    "/v1/completions": (
        {**BASE, "prompt": "hello"},
        ["temperature", "top_p", "top_k", "seed", "n", "presence_penalty", "frequency_penalty", "max_tokens",
         "logprobs", "best_of"],
    ),
    "/v1/chat/completions": (
        {**BASE, "messages": [{"role": "user", "content": "hello"}]},
        ["temperature", "top_p", "top_k", "seed", "n", "presence_penalty", "frequency_penalty", "max_tokens",
         "max_completion_tokens", "top_logprobs"],
    ),
}  # fmt: skip


def post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes NaN and Infinity as bare literals, as a careless client would.
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_numeric_fields_at_extremes_never_hurt_the_engine(server, engine, path):
    base, fields = ENDPOINTS[path]
    answers: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for field in fields:
            for value in EXTREMES:
                body = {**base, field: value}
                if field == "top_logprobs":
                    body["logprobs"] = True
                response = post(client, path, body)
                answers[response.status_code] = answers.get(response.status_code, 0) + 1
                assert response.status_code in (200, 400), (field, value, response.text)
                if response.status_code == 400:
                    assert response.json()["error"]["param"] == field, (field, value, response.text)
                assert engine.is_alive(), (field, value)
        # Sampling with the largest seed the engine takes, and the largest top_k, still works.
        for extra in ({"seed": 2**63 - 1}, {"top_k": engine.info().vocab_size}):
            assert post(client, path, {**base, **extra}).status_code == 200, extra
        normal = post(client, path, base)
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 2
    assert answers[400] > answers.get(200, 0) > 0  # both kinds of answer happened


def test_logit_bias_and_token_ids_at_extremes(server, engine):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for value in (2**63, float("nan"), 1e308, -1, "x"):
            body = {**BASE, "prompt": [1, 2], "logit_bias": {"1": value if value != -1 else -101}}
            assert post(client, "/v1/completions", body).status_code == 400
            response = post(client, "/v1/completions", {**BASE, "prompt": [1, value]})
            assert response.status_code == 400 and response.json()["error"]["param"].startswith("prompt")
    assert engine.is_alive()
