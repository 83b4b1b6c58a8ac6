"""``loraplane serve``: the OpenAI-compatible server on one model folder (uvicorn + FastAPI + AsyncEngine).

An ``s3://`` model is fetched into the host cache first (model_fetch). With ``--admin-port`` a second
uvicorn server in the same event loop serves the admin API (src/loraplane/http/admin.py) over the same engine.

transformers (for the tokenizer), FastAPI and uvicorn are imported here, lazily, never by the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import sys
from pathlib import Path

from loraplane.serve.model_fetch import fetch_model, is_s3_uri
from loraplane.serve.options import ServeOptions, add_server_arguments, build_parser, options_from_args

__all__ = ["ServeOptions", "add_server_arguments", "build_parser", "options_from_args", "main", "run"]

log = logging.getLogger("loraplane.serve")


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def build_engine(options: ServeOptions, tokenizer):
    from loraplane.engine.core.async_engine import AsyncEngine
    from loraplane.engine.core.config import EngineConfig

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
    if options.memory_mode is not None:
        config = dataclasses.replace(config, memory_mode=options.memory_mode)
    if options.lora_merge:
        config = dataclasses.replace(config, lora_merge=True)
    adapters = {"max_lora_rank": options.max_rank, "lora_pool_bytes": options.gpu_adapter_bytes,
                "lora_host_bytes": options.host_adapter_bytes}  # fmt: skip
    config = dataclasses.replace(config, **{k: v for k, v in adapters.items() if v is not None})
    return AsyncEngine.from_config(config, tokenizer)


def resolve_model(options: ServeOptions) -> ServeOptions:
    """The options on a local folder: an s3:// model is fetched (verified) into the host cache first."""
    if not is_s3_uri(options.model):
        return options
    local = fetch_model(options.model, options.model_sha256, options.host_cache_dir)
    return dataclasses.replace(options, model=str(local), served_model_name=options.model_name)


def build_app(options: ServeOptions):
    """(app, engine): the caller runs the app (after ``prepare``) and closes the engine."""
    from loraplane.http.app import create_app
    from loraplane.http.auth import ApiKeys
    from loraplane.http.metrics import Metrics

    options = resolve_model(options)

    api_keys = ApiKeys.from_file(options.api_keys_file) if options.api_keys_file else None
    tokenizer = load_tokenizer(options.model)
    engine = build_engine(options, tokenizer)
    try:
        _check_base_hash(options, engine.info().base_hash)
        metrics = Metrics(options.metrics_adapter_labels)
        app = create_app(engine, tokenizer, options.model_name, api_keys, metrics=metrics,
                         routing_metrics=options.routing_metrics, usage=usage_meter(options, metrics))  # fmt: skip
        app.state.options = options
        app.state.trusted_keys = trusted_keys(options)
    except BaseException:
        engine.close()
        raise
    if api_keys is None:
        where = "anyone who reaches it" if not _is_loopback(options.host) else "any local process"
        log.warning("no --api-keys-file: the OpenAI API on %s is open to %s", options.host, where)
    else:
        log.info("API keys from %s: %d keys", options.api_keys_file, len(api_keys))
    return app, engine


def usage_meter(options: ServeOptions, metrics):
    """The token meter: counters in ``metrics``, and the usage log with ``--usage-log-dir``."""
    from loraplane.http.usage import UsageMeter
    from loraplane.http.usage_log import UsageLog

    usage_log = None
    if options.usage_log_dir is not None:
        usage_log = UsageLog(options.usage_log_dir, options.usage_log_max_bytes, options.usage_log_keep,
                             options.usage_fsync_ms / 1000)  # fmt: skip
        log.info("usage log in %s", options.usage_log_dir)
    return UsageMeter(metrics.registry, metrics.adapter_label, options.usage_top_n, usage_log)


def trusted_keys(options: ServeOptions) -> dict[str, bytes]:
    if options.trusted_keys_dir is None:
        return {}
    from loraplane.artifacts.errors import ArtifactError
    from loraplane.artifacts.signing import load_trusted_keys

    try:
        return load_trusted_keys(options.trusted_keys_dir)
    except ArtifactError as exc:
        raise ValueError(f"trusted_keys_dir: {exc}") from None


async def prepare(app) -> None:
    """Before serving: register and route the local adapters (``--adapter name=DIR[:pin]``). An unpinned one
    is registered on the disk tier (its config and header read; its signature or shapes checked by
    ``open_local_folder``) and warmed to the GPU while the pools have free room; the others load when a
    request needs them. A pinned one is parsed now and must fit the GPU pools."""
    from loraplane.artifacts.errors import ArtifactError
    from loraplane.engine.api import AdapterError
    from loraplane.serve.sources import open_local_folder

    state, options = app.state.server, app.state.options
    keys = app.state.trusted_keys
    if options.adapters and not keys:
        log.warning("no --trusted-keys-dir: local adapters are not signature-checked")
    for name, folder in options.adapters:
        try:
            local = await asyncio.to_thread(open_local_folder, Path(folder), keys or None, state.info)
            pin = name in options.pinned_adapters
            await state.engine.load_adapter(name, local.version, local.path, local.digest, pin=pin,
                                            expected_base_hash=state.info.base_hash, on_disk=not pin)  # fmt: skip
            await state.engine.warm_adapter(name, local.version, gpu=True, only_if_room=not pin)
            await state.engine.set_alias(name, local.version)
        except (ArtifactError, AdapterError) as exc:
            detail = f"{exc.field}: {exc.message}" if getattr(exc, "field", None) else exc.message
            raise ValueError(f"adapter: {name}={folder}: {exc.reason}: {detail}") from None
        log.info("serving adapter %s@%s from %s (%s)", name, local.version, folder, local.digest)


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
    """The admin app over ``app``'s state; it pulls adapters when the server has a host cache."""
    from loraplane.http.adapters import AdapterRegistry
    from loraplane.http.admin import create_admin_app
    from loraplane.serve.sources import S3Source

    state = app.state.server
    options = getattr(app.state, "options", None)
    registry = None
    if options is not None and options.host_cache_dir is not None:
        source = S3Source.create(options.host_cache_dir, options.host_adapter_bytes,
                                 app.state.trusted_keys, state.engine.info)  # fmt: skip
        registry = AdapterRegistry(
            state.engine, state.metrics, source.pull, source.release, source.pin, source.inspect
        )
        state.metrics.watch_engine(state.engine, source.cache)
    else:
        state.metrics.watch_engine(state.engine)
    return create_admin_app(state, token, registry)


async def serve_all(servers, before=None) -> None:
    """Serve uvicorn servers in one event loop; when one stops (a signal, a failure), stop the others."""
    if before is not None:
        await before
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

    from loraplane.http import logs
    from loraplane.http.admin import read_admin_token

    logs.configure(options.log_level, json_lines=options.log_format == "json")
    token = read_admin_token(options.admin_token_file) if options.admin_token_file else None  # fail fast
    app, engine = build_app(options)
    try:
        # Our RequestLog writes the access lines; uvicorn's own lines go through the root logger (JSON too).
        quiet = dict(host=options.host, log_level=options.log_level, access_log=False, log_config=None)
        servers = [uvicorn.Server(uvicorn.Config(app, port=options.port, **quiet))]
        if token is not None:
            admin = build_admin_app(app, token)
            servers.append(uvicorn.Server(uvicorn.Config(admin, port=options.admin_port, **quiet)))
        if on_ready is not None:
            on_ready(app)
        asyncio.run(serve_all(servers, before=prepare(app)))
    finally:
        engine.close()
        if app.state.server.usage.log is not None:
            app.state.server.usage.log.close()  # the last lines fsynced
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = options_from_args(args, args.model, args.served_model_name)
        return run(options)
    except ValueError as exc:  # configuration errors name their field
        print(f"loraplane serve: {exc}", file=sys.stderr)
        return 2
