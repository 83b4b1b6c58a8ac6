"""The pod contract: the operator's argv parses, an s3:// base is fetched and pinned, the admin API answers."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from loraplane.artifacts.base_hash import compute_base_hash
from loraplane.operator import builders as B
from loraplane.operator.crd_models import BaseSpec
from loraplane.serve import main as serve
from loraplane.serve.model_fetch import ModelFetchError, fetch_model, model_cache_dir
from tests.http.conftest import MODEL_NAME, ServerThread, wait_until
from tests.s3_servers import moto_server

ADMIN_TOKEN = "admin-token-0123456789"
BUCKET = "models"


def operator_argv(trusted_keys: bool = True, api_keys: bool = True) -> list[str]:
    spec = {"model": {"uri": "s3://models/tiny/", "sha256": "ab" * 32}, "replicas": 1}
    spec["engine"] = {
        "maxRank": 32,
        "kvCacheFraction": 0.8,
        "maxNumSeqs": 64,
        "dtype": "bfloat16",
        "memoryMode": "unified",
    }
    if trusted_keys:
        spec["trust"] = {"publicKeysSecretRef": {"name": "signers"}}
    if api_keys:
        spec["auth"] = {"apiKeysSecretRef": {"name": "keys"}}
    argv = B.server_args(BaseSpec.parse(spec), "token", api_keys=api_keys)
    assert argv[0] == "serve"  # the console script's subcommand; serve's own parser sees the rest
    return argv[1:]


@pytest.mark.parametrize("optional", [True, False])
def test_the_operators_command_line_parses(optional, tmp_path):
    args = serve.build_parser().parse_args(operator_argv(optional, optional))
    assert (args.model, args.model_sha256) == ("s3://models/tiny/", "ab" * 32)
    assert (args.host, args.port, args.admin_port) == ("0.0.0.0", B.OPENAI_PORT, B.ADMIN_PORT)
    assert (args.max_rank, args.kv_cache_fraction, args.max_num_seqs, args.dtype) == (32, 0.8, 64, "bfloat16")
    assert args.memory_mode == "unified"
    assert args.gpu_adapter_bytes > 0 and args.host_adapter_bytes > 0
    assert args.admin_token_file == f"{B.ADMIN_TOKEN_DIR}/token" and args.host_cache_dir == B.CACHE_DIR
    assert args.usage_log_dir.startswith(f"{B.CACHE_DIR}/usage/") and args.usage_log_keep == B.USAGE_LOG_KEEP
    assert (args.trusted_keys_dir is not None) == optional and (args.api_keys_file is not None) == optional
    # The pod's mounted paths, here: the options validate what the operator passes.
    (tmp_path / "token").write_text(ADMIN_TOKEN)
    args.admin_token_file, args.host_cache_dir = str(tmp_path / "token"), str(tmp_path)
    args.trusted_keys_dir, args.api_keys_file = (str(tmp_path), None) if optional else (None, None)
    options = serve.options_from_args(args, args.model, args.served_model_name)
    assert options.model_name == "tiny" and options.kv_cache_fraction == 0.8
    assert options.memory_mode == "unified"


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"admin_port": 8001}, "admin_port"),  # no token file
        ({"max_rank": 0}, "max_rank"),
        ({"gpu_adapter_bytes": -1}, "gpu_adapter_bytes"),
        ({"kv_cache_fraction": 1.5}, "kv_cache_fraction"),
        ({"memory_mode": "shared"}, "memory_mode"),
        ({"trusted_keys_dir": "/nonexistent"}, "trusted_keys_dir"),
        ({"model": "s3://models/tiny/"}, "model"),  # s3 without a pin and a cache dir
        ({"model": "s3://Bad_Bucket/x/", "model_sha256": "ab" * 32, "host_cache_dir": "/tmp"}, "model"),
    ],
)
def test_bad_pod_options_name_their_field(overrides, field, tiny_chat_model_dir):
    with pytest.raises(ValueError, match=f"^{field}:"):
        serve.ServeOptions(**{"model": str(tiny_chat_model_dir), **overrides})


def test_memory_mode_flag_reaches_the_engine(tiny_chat_model_dir):
    """`--memory-mode unified`: KV and adapter weights share one budget (the engine reports the arena)."""
    args = serve.build_parser().parse_args(["--model", str(tiny_chat_model_dir), "--device", "cpu", "--dtype", "float32",
                                            "--num-kv-blocks", "64", "--memory-mode", "unified"])  # fmt: skip
    options = serve.options_from_args(args, args.model, None)
    assert options.memory_mode == "unified"
    engine = serve.build_engine(options, None)
    try:
        stats = engine.engine.stats()
        assert stats.unified_memory is not None and stats.unified_memory
    finally:
        engine.close()
    default = serve.build_parser().parse_args(["--model", str(tiny_chat_model_dir)])
    assert serve.options_from_args(default, default.model, None).memory_mode is None


def test_lora_merge_flag_reaches_the_engine(tiny_chat_model_dir):
    """`--lora-merge`: the engine keeps merged weights for a dominant adapter; off without the flag."""
    argv = [
        "--model",
        str(tiny_chat_model_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
    ]
    for flags, merging in (([], False), (["--lora-merge"], True)):
        args = serve.build_parser().parse_args(argv + flags)
        engine = serve.build_engine(serve.options_from_args(args, args.model, None), None)
        try:
            assert (engine.engine.runner.merger is not None) is merging
        finally:
            engine.close()


@pytest.fixture(scope="module")
def s3_model(tiny_chat_model_dir, tmp_path_factory):
    """moto S3 holding the tiny chat model at s3://models/tiny/ (plus a pickle-weights folder)."""
    with moto_server() as endpoint:
        client = endpoint.client()
        endpoint.create_bucket(BUCKET)
        for path in sorted(tiny_chat_model_dir.iterdir()):
            client.upload_file(str(path), BUCKET, f"tiny/{path.name}")
        client.put_object(Bucket=BUCKET, Key="pickled/config.json", Body=b"{}")
        client.put_object(Bucket=BUCKET, Key="pickled/pytorch_model.bin", Body=b"\x80\x04")
        yield endpoint


@pytest.fixture
def s3_env(s3_model, monkeypatch):
    for name, value in s3_model.env().items():  # boto3's standard chain, as the pod's env gives it
        monkeypatch.setenv(name, value)
    return s3_model


def test_an_s3_model_with_the_wrong_pin_is_refused_and_never_cached(s3_env, tmp_path, capsys):
    wrong = "cd" * 32
    argv = ["--model=s3://models/tiny/", f"--model-sha256={wrong}", f"--host-cache-dir={tmp_path}"]
    assert serve.main([*argv, "--device=cpu"]) == 2
    assert f"not the pinned {wrong}" in capsys.readouterr().err
    assert list((tmp_path / "models").iterdir()) == []  # the temporary download is gone too


def test_pickle_weights_are_refused(s3_env, tmp_path):
    with pytest.raises(ModelFetchError, match="pickle weights .*pytorch_model.bin"):
        fetch_model("s3://models/pickled/", "ab" * 32, tmp_path)


def test_an_s3_model_with_the_right_pin_is_cached_and_served(s3_env, tiny_chat_model_dir, tmp_path):
    pinned = compute_base_hash(tiny_chat_model_dir)
    options = serve.ServeOptions(
        model="s3://models/tiny/",
        model_sha256=pinned,
        host_cache_dir=str(tmp_path),
        device="cpu",
        max_model_len=64,
        num_kv_blocks=8,
    )
    app, engine = serve.build_app(options)
    try:
        with ServerThread(app) as server:
            ready = httpx.get(f"{server.url}/health/ready").json()
            assert ready == {"status": "ready", "base_hash": pinned, "model": "tiny"}
            assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["tiny"]
    finally:
        engine.close()
    cached = model_cache_dir(tmp_path, pinned)
    assert (cached / "config.json").is_file() and (cached / "tokenizer.json").is_file()
    # A restart finds the folder and never calls S3 (this client would fail on any call).
    assert fetch_model("s3://models/tiny/", pinned, tmp_path, client=object()) == cached


def test_the_public_and_admin_servers_share_one_event_loop(engine, tmp_path):
    import uvicorn

    from loraplane.http.app import create_app

    app = create_app(engine, engine.engine.tokenizer, MODEL_NAME)
    apps = [app, serve.build_admin_app(app, ADMIN_TOKEN)]
    servers = [uvicorn.Server(uvicorn.Config(a, port=0, log_level="warning", lifespan="off")) for a in apps]
    thread = threading.Thread(target=asyncio.run, args=(serve.serve_all(servers),), daemon=True)
    thread.start()
    wait_until(lambda: all(s.started for s in servers), "both servers started")
    public, admin = (s.servers[0].sockets[0].getsockname()[1] for s in servers)
    assert httpx.get(f"http://127.0.0.1:{public}/health/live").status_code == 200
    assert httpx.get(f"http://127.0.0.1:{admin}/health/live").status_code == 401
    servers[0].should_exit = True  # one stopping stops the other
    thread.join(timeout=30)
    assert not thread.is_alive() and servers[1].should_exit
