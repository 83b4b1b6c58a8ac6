"""The wire below the client: SSE framing, error bodies, API keys, body limits, health, disconnect -> abort."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.http.app import create_app
from loraplane.http.auth import ApiKeys
from tests.engine.conftest import FakeRunner
from tests.http.conftest import API_KEY, MODEL_NAME, ServerThread, wait_until

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "temperature": 0}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


def test_sse_framing(server):
    body = {**CHAT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        chunk = json.loads(event.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL_NAME


def test_health(server):
    assert httpx.get(f"{server.url}/health/live").json() == {"status": "live"}
    assert httpx.get(f"{server.url}/health/ready").status_code == 200


def test_malformed_json_is_400(server):
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    error = assert_error(response, 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]


def test_missing_field_is_400_naming_it(server):
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME}), 400, "messages")


LONE = "\\ud800"  # a JSON escape of half a UTF-16 surrogate pair: valid JSON, not valid text
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", json.dumps({**COMPLETION, "prompt": "x"}).replace('"x"', f'"a{LONE}b"'), "prompt"),
        ("/v1/completions", json.dumps({**COMPLETION, "prompt": ["x"]}).replace('"x"', f'"{LONE}"'), "prompt"),
        ("/v1/completions", json.dumps({**COMPLETION, "model": "x"}).replace('"x"', f'"{LONE}"'), "model"),
        ("/v1/completions", json.dumps({**COMPLETION, "stop": ["x"]}).replace('"x"', f'"{LONE}"'), "stop"),
        ("/v1/chat/completions", json.dumps({**CHAT, "model": "x"}).replace('"x"', f'"{LONE}"'), "model"),
        ("/v1/chat/completions", json.dumps(CHAT).replace('"hello"', f'"hi {LONE}"'), "messages[0].content"),
        ("/v1/chat/completions",
         json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
         .replace('"x"', f'"{LONE}"'),
         "messages[0].content[0].text"),
        ("/v1/chat/completions",
         json.dumps({**CHAT, "messages": [{"role": "user", "content": "hi", "name": "x"}]})
         .replace('"x"', f'"{LONE}"'),
         "messages[0].name"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_400_naming_the_field(server, engine, path, raw, param):
    assert LONE in raw
    response = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"})
    assert "surrogate" in assert_error(response, 400, param)["message"]
    assert engine.is_alive()
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=60).status_code == 200


def test_unknown_route_is_an_openai_404(server):
    assert_error(httpx.get(f"{server.url}/v1/nope"), 404)


def test_api_keys(keyed_server):
    url = f"{keyed_server.url}/v1/models"
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": "Basic abc"},
    ):
        response = httpx.get(url, headers=headers)
        error = assert_error(response, 401)
        assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in response.text
    for key in (API_KEY, "another-key"):
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{keyed_server.url}/health/ready").status_code == 200  # probes carry no key


def test_api_keys_through_the_client(keyed_server):
    with openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0) as good:
        response = good.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=2)
        assert response.usage.completion_tokens <= 2


def test_the_key_is_checked_before_the_body_is_read(keyed_server):
    url = f"{keyed_server.url}/v1/chat/completions"
    for body in (b'{"model": ', b'{"model": 5}', b"x" * (1 << 20)):  # malformed, invalid, over the body limit
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.post(url, content=body, headers={"content-type": "application/json", **headers})
            assert assert_error(response, 401)["code"] == "invalid_api_key"
    keyed = {"content-type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    assert_error(httpx.post(url, content=b'{"model": ', headers=keyed), 400)
    assert_error(httpx.get(f"{keyed_server.url}/v1/nope"), 401)  # which routes exist is not told either


def test_body_too_large_is_413(keyed_server):
    url, headers = f"{keyed_server.url}/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (80 << 10)}).encode()
    assert_error(httpx.post(url, content=big, headers=headers), 413)

    def chunks():  # no Content-Length: the limit must hold while reading
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    assert_error(httpx.post(url, content=chunks(), headers=headers), 413)


def test_streaming_client_disconnect_aborts_in_the_engine(server, engine):
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        first = next(response.iter_lines())
        request_id = json.loads(first.removeprefix("data: "))["id"]
    wait_until(lambda: request_id in engine.aborted, "the stream's abort")
    wait_until(lambda: not engine.engine.has_unfinished(), "the engine going idle")


def test_waiting_client_disconnect_aborts_in_the_engine(server, engine):
    before = len(engine.aborted)
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
    wait_until(lambda: len(engine.aborted) > before, "the request's abort")
    assert engine.aborted[-1].startswith("chatcmpl-")
    wait_until(lambda: not engine.engine.has_unfinished(), "the engine going idle")


def test_ready_and_live_are_503_once_the_engine_stopped():
    engine = AsyncEngine(LLMEngine(EngineConfig(model="fake"), runner=FakeRunner()))
    with ServerThread(create_app(engine, None, "fake")) as server:
        assert httpx.get(f"{server.url}/health/ready").status_code == 200
        assert httpx.get(f"{server.url}/health/live").status_code == 200
        engine.close()
        assert httpx.get(f"{server.url}/health/ready").status_code == 503
        live = httpx.get(f"{server.url}/health/live")
        assert live.status_code == 503 and live.json()["status"] == "engine stopped"
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "fake", "prompt": [1, 2]})
        assert_error(response, 503)


def test_api_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha-key\n\n  beta-key  \n")
    keys = ApiKeys.from_file(path)
    assert len(keys) == 2 and "alpha" not in repr(keys)
    assert keys.authenticate("Bearer beta-key").key_index == 1
    assert keys.authenticate("bearer alpha-key").key_index == 0
    assert keys.authenticate("BEARER   alpha-key").key_index == 0  # RFC 7235: the scheme is case-insensitive
    assert keys.authenticate("Bearer gamma") is None and keys.authenticate(None) is None
    path.write_text("# only a comment\n")
    with pytest.raises(ValueError, match="api_keys_file"):
        ApiKeys.from_file(path)
    with pytest.raises(ValueError, match="api_keys_file"):
        ApiKeys.from_file(tmp_path / "missing")


def test_api_keys_yaml_as_the_operator_mounts_it(tmp_path):
    path = tmp_path / "api-keys.yaml"
    path.write_text("# mounted\nkeys:\n  - key: k-one\n    adapters: [support-bot]\n  - key: k-two\n")
    keys = ApiKeys.from_file(path)
    assert keys.authenticate("Bearer k-one").adapters == ("support-bot",)
    assert keys.authenticate("Bearer k-two").adapters is None
    path.write_text("keys:\n  - adapters: [x]\n")
    with pytest.raises(ValueError, match=r"keys\[0\]"):
        ApiKeys.from_file(path)
    path.write_text("keys: [\n  - key: secret-value\n")
    with pytest.raises(ValueError, match="not valid YAML") as caught:
        ApiKeys.from_file(path)
    assert "secret-value" not in str(caught.value)


@pytest.mark.parametrize("name", ["other", "anonymous"])
def test_a_key_may_not_take_a_name_the_metrics_reserve(tmp_path, name):
    path = tmp_path / "api-keys.yaml"
    path.write_text(f"keys:\n  - key: k-one\n    name: team-a\n  - key: k-two\n    name: {name}\n")
    with pytest.raises(ValueError, match=rf"keys\[1\]\.name: '{name}' is reserved"):
        ApiKeys.from_file(path)
