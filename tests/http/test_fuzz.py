"""schemathesis fuzzes the public app against its own OpenAPI schema: no answer is a 5xx, and the engine
still serves after the run. Bounded (a few dozen examples per operation) to stay near a minute on 2 cores."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.http.conftest import MODEL_NAME


def operations(url: str):
    # schemathesis' pytest plugin (from_fixture) does not run under this pytest; drive Hypothesis directly.
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_no_request_is_a_server_error(server, engine):
    seen = []
    for operation in operations(server.url):

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)  # fmt: skip
        def call(case) -> None:
            # Three in four bodies name the served model, so checks past `model` are reached too.
            if isinstance(case.body, dict) and "model" in case.body and hash(repr(case.body)) % 4:
                case.body["model"] = MODEL_NAME
            response = case.call(base_url=server.url, timeout=60)
            seen.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)
            assert engine.is_alive()

        call()
    assert len(seen) > 60 and {200, 400} <= set(seen)


def test_the_engine_serves_after_the_fuzzing(server, engine):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert engine.is_alive()
