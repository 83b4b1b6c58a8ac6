"""``loraplane serve``: the OpenAI-compatible server on one model folder (uvicorn + FastAPI + AsyncEngine).

transformers (for the tokenizer), FastAPI and uvicorn are imported here, lazily, never by the engine.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("loraplane.serve")


@dataclass(slots=True)
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    num_kv_blocks: int | None = None  # default: sized from free memory
    model_sha256: str | None = None  # the pinned base hash: refuse to serve other weights
    api_keys_file: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if not Path(self.model, "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a model folder (no config.json)")
        if self.model_sha256 is not None:
            self.model_sha256 = self.model_sha256.removeprefix("sha256:").lower()
            if len(self.model_sha256) != 64 or any(c not in "0123456789abcdef" for c in self.model_sha256):
                raise ValueError("model_sha256: must be 64 hex digits (as `loraplane model hash` prints)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name


def build_parser(prog: str = "loraplane serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model folder over the OpenAI API.")
    parser.add_argument(
        "--model", required=True, help="HF model folder (config.json, safetensors, tokenizer)"
    )
    add_server_arguments(parser)
    parser.add_argument("--served-model-name", help="the name clients put in `model` (default: folder name)")
    parser.add_argument("--model-sha256", help="pinned base hash; refuse to start on other weights")
    return parser


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: from memory)"
    )
    parser.add_argument("--api-keys-file", help="file with one API key per line; without it, no auth")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def build_engine(options: ServeOptions, tokenizer):
    from loraplane.server.engine.async_engine import AsyncEngine
    from loraplane.server.engine.config import EngineConfig

    config = EngineConfig(
        model=options.model,
        dtype=options.dtype,
        device=options.device,
        max_num_seqs=options.max_num_seqs,
        max_model_len=options.max_model_len,
        num_kv_blocks=options.num_kv_blocks,
    )
    return AsyncEngine.from_config(config, tokenizer)


def build_app(options: ServeOptions):
    """(app, engine): the caller runs the app and closes the engine."""
    from loraplane.server.http.app import create_app
    from loraplane.server.http.auth import ApiKeys

    api_keys = ApiKeys.from_file(options.api_keys_file) if options.api_keys_file else None
    tokenizer = load_tokenizer(options.model)
    engine = build_engine(options, tokenizer)
    try:
        _check_base_hash(options, engine.engine.runner.base_hash)
        app = create_app(engine, tokenizer, options.model_name, api_keys)
    except BaseException:
        engine.close()
        raise
    if api_keys is None and not _is_loopback(options.host):
        log.warning("serving on %s without API keys: anyone who reaches it may use it", options.host)
    return app, engine


def _check_base_hash(options: ServeOptions, loaded: str) -> None:
    """The runner hashed the weights it loaded (the artifacts module's definition); compare with the pin."""
    if options.model_sha256 is not None and loaded != options.model_sha256:
        raise ValueError(
            f"model_sha256: the weights in {options.model} hash to {loaded}, not the pinned {options.model_sha256}"
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(options: ServeOptions, on_ready=None) -> int:
    """Build, call ``on_ready(app)`` (a banner, say), serve until interrupted, close the engine."""
    import uvicorn

    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app, engine = build_app(options)
    try:
        if on_ready is not None:
            on_ready(app)
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level)
    finally:
        engine.close()
    return 0


def options_from_args(args: argparse.Namespace, model: str, served_model_name: str | None) -> ServeOptions:
    return ServeOptions(
        model=model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        api_keys_file=args.api_keys_file,
        served_model_name=served_model_name,
        log_level=args.log_level,
        model_sha256=getattr(args, "model_sha256", None),
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = options_from_args(args, args.model, args.served_model_name)
        return run(options)
    except ValueError as exc:  # configuration errors name their field
        print(f"loraplane serve: {exc}", file=sys.stderr)
        return 2
