"""HTTP fixtures: a tiny random Llama folder with a chat-template tokenizer, served by a real uvicorn on a free
loopback port in a background thread (one engine shared by every server of the session)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from loraplane.engine.core.async_engine import AsyncEngine
from tests.engine.conftest import TOKENIZER_CORPUS, build_tiny_hf_model

MODEL_NAME = "tiny-llama"
API_KEY = "lp-test-key-0123456789"
MAX_MODEL_LEN = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class SpyEngine(AsyncEngine):
    """An AsyncEngine that records the ids it was asked to abort (to see a client's disconnect arrive)."""

    def __init__(self, engine) -> None:
        self.aborted: list[str] = []
        super().__init__(engine)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        super().abort(request_id)


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a daemon thread, for the span of a with block."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def build_chat_tokenizer():
    """The engine tests' offline byte-level BPE, plus a chat template (transformers imported lazily)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TOKENIZER_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    """A servable folder: random Llama weights (vocab covers the tokenizer; eos = <eos>) + tokenizer files."""
    out = tmp_path_factory.mktemp("tiny-chat-llama")
    tokenizer = build_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    build_tiny_hf_model(
        out, "llama", vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None, pad_token_id=None
    )
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def engine(tiny_chat_model_dir):
    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.core.llm_engine import LLMEngine
    from loraplane.serve.main import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_chat_model_dir))
    config = EngineConfig(
        model=str(tiny_chat_model_dir),
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
    )
    spy = SpyEngine(LLMEngine(config, tokenizer=tokenizer))
    yield spy
    spy.close()


@pytest.fixture(scope="session")
def server(engine):
    """The open server (no API keys)."""
    from loraplane.http.app import create_app

    app = create_app(engine, engine.engine.tokenizer, MODEL_NAME)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="session")
def keyed_server(engine):
    """The same engine behind API keys and a small body limit."""
    from loraplane.http.app import create_app

    app = create_app(
        engine, engine.engine.tokenizer, MODEL_NAME, [API_KEY, "another-key"], max_body_bytes=64 << 10
    )
    with ServerThread(app) as running:
        yield running


@pytest.fixture
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)
