"""Processes the tests start die with the test session, even when it is killed (SIGKILL, a CI timeout).

``reaped(argv)`` runs ``argv`` through a small launcher that asks Linux for PR_SET_PDEATHSIG: the kernel sends
the child SIGKILL when the thread that started it ends. The setting survives ``exec``, so etcd, the
kube-apiserver, moto and the server Pods go down with the pytest process instead of holding ports and CPU
for the next run. Start them from a thread that lives as long as they should (the fixture's, the kubelet
stand-in's loop). Elsewhere than Linux ``argv`` is returned as it is.
"""

from __future__ import annotations

import os
import sys

PR_SET_PDEATHSIG = 1
_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent ended before the request: end too
    "    sys.exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def reaped(argv: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *map(str, argv)]
