"""``loraplane serve``: the OpenAI-compatible server on one model folder (uvicorn + FastAPI + AsyncEngine).

An ``s3://`` model is fetched into the host cache first (model_fetch). With ``--admin-port`` a second
uvicorn server in the same event loop serves the admin API (server/http/admin.py) over the same engine.

transformers (for the tokenizer), FastAPI and uvicorn are imported here, lazily, never by the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import sys

from .model_fetch import fetch_model, is_s3_uri
from .serve_options import ServeOptions, add_server_arguments, build_parser, options_from_args

__all__ = ["ServeOptions", "add_server_arguments", "build_parser", "options_from_args", "main", "run"]

log = logging.getLogger("loraplane.serve")


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
        tensor_parallel_size=options.tensor_parallel_size or 1,
    )
    if options.kv_cache_fraction is not None:
        config = dataclasses.replace(config, gpu_memory_utilization=options.kv_cache_fraction)
    return AsyncEngine.from_config(config, tokenizer)


def resolve_model(options: ServeOptions) -> ServeOptions:
    """The options on a local folder: an s3:// model is fetched (verified) into the host cache first."""
    if not is_s3_uri(options.model):
        return options
    local = fetch_model(options.model, options.model_sha256, options.host_cache_dir)
    return dataclasses.replace(options, model=str(local), served_model_name=options.model_name)


def build_app(options: ServeOptions):
    """(app, engine): the caller runs the app and closes the engine."""
    from loraplane.server.http.app import create_app
    from loraplane.server.http.auth import ApiKeys

    options = resolve_model(options)

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


def build_admin_app(app, token: str):
    from loraplane.server.http.admin import create_admin_app

    return create_admin_app(app.state.server, token)


async def serve_all(servers) -> None:
    """Serve uvicorn servers in one event loop; when one stops (a signal, a failure), stop the others."""
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks)


def run(options: ServeOptions, on_ready=None) -> int:
    """Build, call ``on_ready(app)`` (a banner, say), serve until interrupted, close the engine."""
    import uvicorn

    from loraplane.server.http.admin import read_admin_token

    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    token = read_admin_token(options.admin_token_file) if options.admin_token_file else None  # fail fast
    app, engine = build_app(options)
    try:
        servers = [uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port,
                                                 log_level=options.log_level))]  # fmt: skip
        if token is not None:
            admin = build_admin_app(app, token)
            config = uvicorn.Config(
                admin, host=options.host, port=options.admin_port, log_level=options.log_level
            )
            servers.append(uvicorn.Server(config))
        if on_ready is not None:
            on_ready(app)
        asyncio.run(serve_all(servers))
    finally:
        engine.close()
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = options_from_args(args, args.model, args.served_model_name)
        return run(options)
    except ValueError as exc:  # configuration errors name their field
        print(f"loraplane serve: {exc}", file=sys.stderr)
        return 2
