"""``loraplane operator run``: the operator, with ``kopf run``'s namespace, liveness and peering options.

    loraplane operator run --namespace ml-serving [--namespace other] [--standalone] \\
        [--liveness http://0.0.0.0:8080/healthz] [--metrics-port 9090] [--peering loraplane]
    loraplane operator run --all-namespaces [--drift-interval 30] [--full-pass-interval 300]
    loraplane operator crds [--write [DIR] | --check [DIR]]   (DIR: crds/)

The Kubernetes configuration is loaded once, explicitly: ``--kubeconfig`` (or $KUBECONFIG, read
here and passed on by path), else the in-cluster service account.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from loraplane.operator.allocator import COLLECT_EVERY_S
from loraplane.operator.caches import FULL_PASS_EVERY
from loraplane.operator.context import DEFAULT_DRIFT_INTERVAL, Tunables
from loraplane.operator.policy import DEFAULT_REGISTRIES, OperatorPolicy


def policy_of(args) -> OperatorPolicy:
    """The operator's policy from its flags (ValueError names the flag)."""
    return OperatorPolicy(
        allowed_s3_endpoints=tuple(args.allowed_s3_endpoint),
        host_path_prefix=args.host_path_prefix,
        allowed_registries=tuple(args.allowed_registry) or DEFAULT_REGISTRIES,
        server_image=args.server_image,
        allowed_tolerations=tuple(args.allowed_toleration),
        allowed_node_labels=tuple(args.allowed_node_label),
        allowed_priority_classes=tuple(args.allowed_priority_class),
        allowed_service_accounts=tuple(args.allowed_service_account),
        allowed_runtime_classes=tuple(args.allowed_runtime_class),
    )


def tunables_of(args) -> Tunables:
    """The operator's timing from its flags (ValueError names the flag)."""
    for flag in ("drift_interval", "full_pass_interval"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    if not 0 <= args.collect_interval < math.inf:
        raise ValueError(f"--collect-interval must be >= 0 seconds and finite, got {args.collect_interval}")
    return Tunables(drift_interval=args.drift_interval, full_pass_interval=args.full_pass_interval)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplane operator")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator")
    scope = run.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeatable; globs as in kopf)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster")
    run.add_argument("--standalone", action="store_true", help="no peering: the only operator instance")
    run.add_argument("--peering", metavar="NAME", help="kopf peering object name (for several replicas)")
    run.add_argument("--priority", type=int, default=0, help="peering priority")
    run.add_argument("--liveness", metavar="URL", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics here (0: off)")
    run.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="kubeconfig file")
    run.add_argument("--context", help="kubeconfig context")
    run.add_argument(
        "--drift-interval",
        type=float,
        default=DEFAULT_DRIFT_INTERVAL,
        help="seconds between drift checks of each adapter against its pods",
    )
    run.add_argument(
        "--full-pass-interval",
        type=float,
        default=FULL_PASS_EVERY,
        help="seconds after which a settled adapter's drift check reads its Secrets, trusted keys and policy "
        "again (quiet checks in between only compare its pods)",
    )
    run.add_argument(
        "--collect-interval",
        type=float,
        default=COLLECT_EVERY_S,
        help="seconds between full garbage collections, which keep bursts of work from ratcheting up the "
        "process's memory (0: only Python's own collections)",
    )
    policy = run.add_argument_group("policy", "what a LoRABase may ask of the operator (docs/security.md)")
    policy.add_argument(
        "--allowed-s3-endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="an S3 endpoint LoRABases may name (repeatable); none: AWS's endpoints only",
    )
    policy.add_argument(
        "--host-path-prefix",
        metavar="DIR",
        help="hostPath caches only at or under DIR (never /); unset: no hostPath caches",
    )
    policy.add_argument(
        "--allowed-registry",
        action="append",
        default=[],
        metavar="PREFIX",
        help=f"server images only from PREFIX/... (repeatable; default {DEFAULT_REGISTRIES[0]})",
    )
    policy.add_argument(
        "--server-image",
        metavar="IMAGE",
        help="pin every server pod to IMAGE; LoRABases may leave spec.image empty or name it",
    )
    for flag, what in (
        ("--allowed-toleration", "a taint key LoRABases' pods may tolerate (spec.tolerations[].key)"),
        ("--allowed-node-label", "a node label key spec.nodeSelector and spec.affinity.nodeAffinity may use"),
        ("--allowed-priority-class", "a PriorityClass spec.priorityClassName may name"),
        ("--allowed-service-account", "a ServiceAccount spec.serviceAccountName may name"),
        ("--allowed-runtime-class", "a RuntimeClass spec.runtimeClassName may name"),
    ):
        policy.add_argument(
            flag, action="append", default=[], metavar="NAME", help=f"{what} (repeatable; none: not at all)"
        )
    run.add_argument(
        "--gateway-inference-extension",
        action="store_true",
        help="write an InferencePool per LoRABase and an InferenceModelRewrite per LoRAAdapter where the "
        "Gateway API Inference Extension's CRDs are served (docs/routing.md)",
    )
    run.add_argument("--verbose", action="store_true")
    sub.add_parser("crds", help="write or check the CRD YAML: crds --write DIR | --check DIR")
    return parser  # fmt: skip


def run(args) -> int:
    import kopf

    from loraplane.operator import allocator, handlers, memtrace  # noqa: F401  (handlers: registers them)
    from loraplane.operator.context import Context
    from loraplane.operator.kube import Kube, load_api_client

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")  # fmt: skip
    allocator.cap_arenas()  # before kopf starts its threads: each would get an arena of its own
    allocator.release_large_blocks()  # else RSS ratchets up at every burst of connections
    if args.collect_interval:
        allocator.collect_cycles_every(args.collect_interval)
    memtrace.install_from_env()  # off unless LORAPLANE_TRACEMALLOC names a file
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    ctx = Context(
        Kube(load_api_client(args.kubeconfig, args.context)),
        tunables_of(args),
        policy=policy_of(args),
        routing=args.gateway_inference_extension,
    )
    kopf.run(
        registry=kopf.get_default_registry(),
        settings=handlers.make_settings(
            standalone=args.standalone, peering=args.peering, scanning=args.all_namespaces
        ),
        memo=kopf.Memo(ctx=ctx),
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
        clusterwide=args.all_namespaces,
        namespaces=args.namespaces or (),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["crds"]:  # its own parser (python -m loraplane.operator.crds)
        from loraplane.operator import crds

        return crds.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        policy_of(args)
        tunables_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    return run(args)
