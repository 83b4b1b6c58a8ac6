"""What the engine says about one request reaches that request alone: early abort under overload is 429 with
Retry-After, a failure inside a step is 500 for that request (in-band for a stream), refused values are 400,
and the next request is served. The engine here is a scripted stand-in keyed by the request's seed."""

from __future__ import annotations

import json

import httpx
import pytest

from loraplane.engine.api import EngineInfo, OverloadedError
from loraplane.engine.core.llm_engine import RequestOutput
from loraplane.http.app import create_app
from tests.http.conftest import ServerThread

OVERLOADED_AT_ADD, FAILS_IN_STEP, OVERLOADED_IN_STREAM, FAILS_AFTER_A_TOKEN, REFUSED_ON_THREAD = 1, 2, 3, 4, 5


class ScriptedEngine:
    def __init__(self) -> None:
        self.listeners = []

    def info(self) -> EngineInfo:
        return EngineInfo("0" * 64, 64, 100, 8, ("q_proj",), "cpu", "float32")

    def adapters(self, name=None):
        return []

    def resolve(self, name):
        return None

    def tier_of(self, key):
        return None

    def add_step_listener(self, fn) -> None:
        self.listeners.append(fn)

    def is_alive(self) -> bool:
        return True

    def abort(self, request_id) -> None:
        pass

    def add_request(self, prompt, sampling, request_id=None, adapter=None, lease=None):
        if sampling.seed == OVERLOADED_AT_ADD:
            raise OverloadedError("the queue is full", 2.5)
        return self._stream(request_id, len(prompt), sampling.seed)

    async def _stream(self, request_id, prompt_len, seed):
        def out(n, finished):
            return RequestOutput(
                request_id, [7], "x", finished, "length" if finished else None, prompt_len, n
            )

        if seed == FAILS_IN_STEP:
            raise RuntimeError("Overflow when unpacking long long")
        if seed == OVERLOADED_IN_STREAM:
            raise OverloadedError("waited past its deadline", 1.2)
        if seed == REFUSED_ON_THREAD:
            raise ValueError("SamplingParams.top_k: too large for this engine")
        yield out(1, False)
        if seed == FAILS_AFTER_A_TOKEN:
            raise RuntimeError("non-finite logits")
        yield out(2, True)


@pytest.fixture(scope="module")
def scripted():
    with ServerThread(create_app(ScriptedEngine(), None, "m")) as server:
        yield server


def post(server, seed: int, stream: bool = False) -> httpx.Response:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 2, "seed": seed, "stream": stream}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)


def stream_events(response: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]


@pytest.mark.parametrize(
    "seed, status, code",
    [(OVERLOADED_AT_ADD, 429, "overloaded"), (OVERLOADED_IN_STREAM, 429, "overloaded"),
     (FAILS_IN_STEP, 500, "request_failed"), (FAILS_AFTER_A_TOKEN, 500, "request_failed"),
     (REFUSED_ON_THREAD, 400, None)],
)  # fmt: skip
def test_each_failure_is_this_requests_answer(scripted, seed, status, code):
    response = post(scripted, seed)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    if status == 429:
        assert response.headers["retry-after"] == ("3" if seed == OVERLOADED_AT_ADD else "2")  # rounded up
    if seed == REFUSED_ON_THREAD:
        assert response.json()["error"]["param"] == "top_k"
    assert post(scripted, 0).status_code == 200  # the next request is served


def test_a_stream_reports_its_failure_in_band(scripted):
    response = post(scripted, FAILS_AFTER_A_TOKEN, stream=True)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    events = stream_events(response)
    assert events[0]["choices"][0]["text"] == "x"
    assert events[-1]["error"]["code"] == "request_failed" and "non-finite" in events[-1]["error"]["message"]
    overloaded = stream_events(post(scripted, OVERLOADED_IN_STREAM, stream=True))
    assert overloaded[-1]["error"]["code"] == "overloaded"
    assert post(scripted, OVERLOADED_AT_ADD, stream=True).status_code == 429  # before any byte: a real 429
