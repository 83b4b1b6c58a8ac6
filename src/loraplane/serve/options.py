"""The options of ``loraplane serve`` and their command line (the operator's contract: docs/operator.md).

Torch-free. ``build_parser`` is what the contract test parses the operator's argv with.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from loraplane.serve.model_fetch import is_s3_uri

ADAPTER_NAME = re.compile(r"[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?")


@dataclass(slots=True)
class ServeOptions:
    model: str  # a local model folder, or s3://bucket/prefix/ (fetched into host_cache_dir)
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
    kv_cache_fraction: float | None = None  # EngineConfig.gpu_memory_utilization (None: its default)
    admin_port: int | None = None  # the admin API (needs admin_token_file)
    admin_token_file: str | None = None
    host_cache_dir: str | None = None  # the fetched base model and the adapters pulled from S3
    adapters: tuple[tuple[str, str], ...] = ()  # (name, local PEFT folder) served from the start
    pinned_adapters: tuple[str, ...] = ()  # of those, the names kept GPU-resident (NAME=DIR:pin)
    log_format: str = "json"
    metrics_adapter_labels: int = 100  # distinct adapter label values in metrics; later ones are "other"
    max_rank: int | None = None
    gpu_adapter_bytes: int | None = None
    host_adapter_bytes: int | None = None
    trusted_keys_dir: str | None = None
    tensor_parallel_size: int | None = None  # processes the base is split over, one GPU each (None: 1)
    memory_mode: str | None = None  # EngineConfig.memory_mode: "split" or "unified" (None: its default)
    lora_merge: bool | None = None  # EngineConfig.lora_merge (None: its default, off)
    routing_metrics: bool = False  # GET /metrics on the public port: the routers' families, no token
    usage_top_n: int = 100  # (tenant, adapter version) label sets with their own token series
    usage_log_dir: str | None = None  # the usage log's folder (None: no log, counters only)
    usage_log_max_bytes: int = 64 << 20  # rotate the usage log file at this size
    usage_log_keep: int = 0  # rotated usage log files kept (0: all)
    usage_fsync_ms: int = 1000  # fsync the usage log this often when written to (0: leave it to the OS)

    def __post_init__(self) -> None:
        for name in ("port", "admin_port"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= 65535):
                raise ValueError(f"{name}: must be in [0, 65535], got {value}")
        if self.model_sha256 is not None:
            self.model_sha256 = self.model_sha256.removeprefix("sha256:").lower()
            if len(self.model_sha256) != 64 or any(c not in "0123456789abcdef" for c in self.model_sha256):
                raise ValueError("model_sha256: must be 64 hex digits (as `loraplane model hash` prints)")
        for name in ("host_cache_dir", "trusted_keys_dir"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_dir():
                raise ValueError(f"{name}: {value} is not an existing directory")
        self._check_model()
        self._check_admin()
        self._check_adapters()
        for name in ("max_rank", "gpu_adapter_bytes", "host_adapter_bytes", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.kv_cache_fraction is not None and not (0.0 < self.kv_cache_fraction <= 1.0):
            raise ValueError(f"kv_cache_fraction: must be in (0, 1], got {self.kv_cache_fraction}")
        tp = self.tensor_parallel_size
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0):
            raise ValueError(f"tensor_parallel_size: must be a positive integer, got {tp!r}")
        if self.memory_mode not in (None, "split", "unified"):
            raise ValueError(f"memory_mode: must be 'split' or 'unified', got {self.memory_mode!r}")
        self._check_usage()

    def _check_usage(self) -> None:
        for name, least in (("usage_top_n", 0), ("usage_log_max_bytes", 4096), ("usage_log_keep", 0),
                            ("usage_fsync_ms", 0)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: must be an integer >= {least}, got {value!r}")
        folder = self.usage_log_dir
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"usage_log_dir: {folder} exists and is not a directory")

    def _check_model(self) -> None:
        if is_s3_uri(self.model):
            from loraplane.artifacts.errors import ArtifactError
            from loraplane.artifacts.s3 import parse_s3_uri

            try:
                parse_s3_uri(self.model)
            except ArtifactError as exc:
                raise ValueError(f"model: {exc}") from None
            if self.model_sha256 is None or self.host_cache_dir is None:
                raise ValueError("model: an s3:// model needs --model-sha256 and --host-cache-dir")
        elif not Path(self.model, "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a model folder (no config.json)")

    def _check_admin(self) -> None:
        if (self.admin_port is None) != (self.admin_token_file is None):
            raise ValueError("admin_port: --admin-port and --admin-token-file go together")
        if self.admin_port is not None and self.admin_port == self.port and self.port != 0:
            raise ValueError(f"admin_port: must differ from port ({self.port})")
        if self.admin_token_file is not None and not Path(self.admin_token_file).is_file():
            raise ValueError(f"admin_token_file: {self.admin_token_file} is not a readable file")

    def _check_adapters(self) -> None:
        self.adapters = tuple(tuple(a) for a in self.adapters)
        names = [name for name, _ in self.adapters]
        for name, folder in self.adapters:
            if not ADAPTER_NAME.fullmatch(name):
                raise ValueError(
                    f"adapter: {name!r}: a name is 1-63 lowercase letters, digits, '.', '_', '-'"
                )
            if not Path(folder).is_dir():
                raise ValueError(f"adapter: {name}={folder}: not a folder")
            if names.count(name) > 1:
                raise ValueError(f"adapter: {name!r} is given twice")
        self.pinned_adapters = tuple(self.pinned_adapters)
        for name in self.pinned_adapters:
            if name not in names:
                raise ValueError(f"pinned_adapters: {name!r} is not one of the adapters {names}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format: must be json or text, got {self.log_format!r}")
        if not isinstance(self.metrics_adapter_labels, int) or self.metrics_adapter_labels < 0:
            raise ValueError("metrics_adapter_labels: must be an integer >= 0")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if is_s3_uri(self.model):
            return PurePosixPath(self.model.removeprefix("s3://").rstrip("/")).name
        return Path(self.model).resolve().name


def build_parser(prog: str = "loraplane serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve a base model over the OpenAI API.")
    parser.add_argument(
        "--model",
        required=True,
        help="HF model folder (config.json, safetensors, tokenizer), or s3://bucket/prefix/ of one "
        "(fetched into --host-cache-dir/models/<sha256>/; needs --model-sha256)",
    )
    add_server_arguments(parser)
    parser.add_argument("--served-model-name", help="the name clients put in `model` (default: folder name)")
    parser.add_argument("--model-sha256", help="pinned base hash; refuse to start on other weights")
    add_pod_arguments(parser)
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
    parser.add_argument(
        "--api-keys-file", help="API keys: one per line, or the operator's api-keys.yaml; without it, no auth"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--log-format", default="json", choices=["json", "text"], help="log lines (default: json)"
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        type=_adapter_arg,
        metavar="NAME=DIR[:pin]",
        help="serve the PEFT LoRA folder DIR as model NAME (repeatable); signed when --trusted-keys-dir is set. "
        "It loads on demand and is warmed to the GPU while there is room; ':pin' keeps it GPU-resident",
    )
    parser.add_argument(
        "--metrics-adapter-labels",
        type=int,
        default=100,
        help="at most this many adapter names as metric labels; others count as 'other' (default 100)",
    )

    usage = parser.add_argument_group("token metering")
    usage.add_argument("--usage-top-n", type=int, default=100, help="(tenant, adapter version) label sets "
                       "with their own loraplane_tokens_total series; the rest count as tenant 'other' (default 100)")  # fmt: skip
    usage.add_argument("--usage-log-dir", help="append one JSON line per request (tenant, adapter, version, "
                       "tokens, status) to files in this folder; GET /admin/usage reads them")  # fmt: skip
    usage.add_argument("--usage-log-max-bytes", type=int, default=64 << 20,
                       help="start a new usage log file at this size (default 64 MiB)")  # fmt: skip
    usage.add_argument("--usage-log-keep", type=int, default=0,
                       help="rotated usage log files kept; older ones are deleted (default 0: keep all)")  # fmt: skip
    usage.add_argument("--usage-fsync-ms", type=int, default=1000, help="fsync the usage log this often while "
                       "it is written to; 0: leave write-back to the OS (default 1000)")  # fmt: skip


def _adapter_arg(value: str) -> tuple[str, str, bool]:
    name, sep, folder = value.partition("=")
    pin = folder.endswith(":pin")
    folder = folder.removesuffix(":pin")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR or NAME=DIR:pin, got {value!r}")
    return name, folder, pin


def add_pod_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags the operator's pods add (docs/operator.md, "The server's command line")."""
    pod = parser.add_argument_group("pod (set by the operator)")
    pod.add_argument("--admin-port", type=int, help="serve the admin API on this port (needs a token file)")
    pod.add_argument("--admin-token-file", help="file holding the admin API's Bearer token")
    pod.add_argument(
        "--tensor-parallel-size", type=int, help="split the base over N GPUs of the pod (default 1)"
    )
    pod.add_argument(
        "--memory-mode",
        choices=("split", "unified"),
        help="split: KV cache and adapter pools have fixed sizes (default); unified: they share one GPU budget "
        "and the share follows the load",
    )
    pod.add_argument(
        "--lora-merge",
        action="store_true",
        default=None,
        help="merge a dominant adapter into a copy of the projection weights (its steps cost a base step; "
        "the copy comes out of the KV cache)",
    )
    pod.add_argument(
        "--kv-cache-fraction", type=float, help="fraction of free GPU memory for weights + KV (0, 1]"
    )
    pod.add_argument(
        "--host-cache-dir", help="existing dir: the s3:// base model and adapters are cached here"
    )
    pod.add_argument(
        "--routing-metrics",
        action="store_true",
        default=None,
        help="serve the metrics routers read (queues, KV use, adapters by name) at /metrics on the public "
        "port without a token, for the Gateway API Inference Extension's endpoint picker",
    )
    pod.add_argument("--max-rank", type=int, help="highest LoRA rank the engine accepts")
    pod.add_argument("--gpu-adapter-bytes", type=int, help="GPU memory for adapter weights")
    pod.add_argument("--host-adapter-bytes", type=int, help="host cache budget for adapters (bytes)")
    pod.add_argument(
        "--trusted-keys-dir",
        help="existing dir of adapter-signing public keys; without it, S3 adapters are refused",
    )


def options_from_args(args: argparse.Namespace, model: str, served_model_name: str | None) -> ServeOptions:
    """``demo`` shares the server flags, not the pod ones: those default to None."""
    pod = {
        name: getattr(args, name, None)
        for name in (
            "model_sha256",
            "kv_cache_fraction",
            "admin_port",
            "admin_token_file",
            "host_cache_dir",
            "max_rank",
            "gpu_adapter_bytes",
            "host_adapter_bytes",
            "trusted_keys_dir",
            "tensor_parallel_size",
            "memory_mode",
            "lora_merge",
        )
    }
    pod["routing_metrics"] = bool(getattr(args, "routing_metrics", None))
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
        log_format=args.log_format,
        adapters=tuple((name, folder) for name, folder, _ in args.adapter),
        pinned_adapters=tuple(name for name, _, pin in args.adapter if pin),
        metrics_adapter_labels=args.metrics_adapter_labels,
        usage_top_n=args.usage_top_n,
        usage_log_dir=args.usage_log_dir,
        usage_log_max_bytes=args.usage_log_max_bytes,
        usage_log_keep=args.usage_log_keep,
        usage_fsync_ms=args.usage_fsync_ms,
        **pod,
    )
