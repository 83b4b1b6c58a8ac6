"""What bursts of Kubernetes API calls on fresh TLS connections do to a process's RSS: the operator's case,
when a server Pod is replaced after a quiet spell and every reconcile thread's kept-alive connection has been
closed by the API server (idle timeout). A real control plane, the kubernetes client, the operator's malloc
settings (``operator/allocator.py``); each burst is ``2 x threads`` list calls from ``threads`` threads.

    python -m e2e.soak.tlsprobe --threads 16 --bursts 40 [--keep]   # --keep: connections stay open

Prints one JSON line: the RSS (MiB) after each burst.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loraplane.operator import allocator


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.soak.tlsprobe")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--bursts", type=int, default=40)
    parser.add_argument("--keep", action="store_true", help="reuse the connections (no reconnect per burst)")
    args = parser.parse_args()
    allocator.cap_arenas()  # as `loraplane operator run` does, before any thread starts
    allocator.release_large_blocks()
    import kubernetes  # after the malloc settings, like the operator

    from loraplane.operator.kube import load_api_client
    from tests.controlplane.cluster import ControlPlane

    with tempfile.TemporaryDirectory() as workdir, ControlPlane.start(Path(workdir)) as plane:
        client = load_api_client(str(plane.kubeconfig_path))
        core = kubernetes.client.CoreV1Api(client)
        pool = ThreadPoolExecutor(args.threads)
        rss = []
        for _ in range(args.bursts):
            if not args.keep:  # what the API server's idle timeout does between bursts
                client.rest_client.pool_manager.clear()
            list(pool.map(lambda _: core.list_namespace(), range(2 * args.threads)))
            time.sleep(0.2)
            rss.append(round(rss_mib(), 2))
    print(json.dumps({"threads": args.threads, "fresh_connections": not args.keep, "rss_mib": rss}))


if __name__ == "__main__":
    main()
