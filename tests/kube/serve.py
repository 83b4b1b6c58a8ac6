"""Serve the emulator until Ctrl-C, for a manual session with kubectl (or a transcript for docs).

    .venv/bin/python tests/kube/serve.py --kubeconfig /tmp/emu.kubeconfig [--port 8001]
    KUBECONFIG=/tmp/emu.kubeconfig kubectl apply -f crds/ -f examples/ && kubectl get loraadapters

Run it as a file path, not ``python -m`` from the repo root: there ``operator/`` would shadow the stdlib.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]  # its modules shadow others
sys.path.append(str(_HERE.parents[1]))  # the repo root, last: its operator/ must not shadow the stdlib

from tests.kube.fixtures import RunningEmulator  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (default: any free one)")
    parser.add_argument(
        "--kubeconfig", type=pathlib.Path, help="where to write the kubeconfig (default: tmp)"
    )
    args = parser.parse_args(argv)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kube-emulator-"))
    running = RunningEmulator(workdir, port=args.port).start()
    if args.kubeconfig is not None:
        shutil.copyfile(running.kubeconfig_path, args.kubeconfig)
    print(f"serving {running.url}; KUBECONFIG={args.kubeconfig or running.kubeconfig_path}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
