"""Run a real kopf operator in-process against the emulator, in the test's event loop.

``kopf.operator()`` cancels every task it did not start once it stops (after 5 s), including
pytest-asyncio's; ``spawn_tasks`` + ``run_tasks(ignored=<tasks that existed before>)`` does not.
The emulator lives in its own thread, so the sync ``kubernetes`` client may be called from the test,
but only through ``asyncio.to_thread`` while the operator shares the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection

import kopf

from tests.kube.fixtures import RunningEmulator


def add_login(registry: kopf.OperatorRegistry, kube: RunningEmulator) -> None:
    """Authenticate kopf to the emulator only: no $KUBECONFIG, no in-cluster probing."""

    @kopf.on.login(registry=registry)
    def login_to_emulator(**_: object) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=kube.url, scheme="Bearer", token="dummy-token", insecure=True)


def fast_settings(settings: kopf.OperatorSettings | None = None) -> kopf.OperatorSettings:
    """Settings for tests: quiet, no peering, short back-offs; watches reconnect every 30 s."""
    settings = settings or kopf.OperatorSettings()
    settings.peering.standalone = True
    settings.watching.server_timeout = 30
    settings.watching.reconnect_backoff = 0.2
    settings.queueing.idle_timeout = 0.2
    settings.queueing.exit_timeout = 2
    settings.networking.request_timeout = 30
    return settings


@contextlib.asynccontextmanager
async def running_operator(
    kube: RunningEmulator,
    registry: kopf.OperatorRegistry,
    *,
    namespaces: Collection[str] = ("default",),
    clusterwide: bool = False,
    settings: kopf.OperatorSettings | None = None,
    memo: object | None = None,
    login: bool = True,
    stop_timeout: float = 20,
) -> AsyncIterator[asyncio.Task]:
    """Start kopf with ``registry``; yield once it is ready; stop it gracefully on exit."""
    if login:
        add_login(registry, kube)
    existing = set(asyncio.all_tasks())
    stop_flag, ready_flag = asyncio.Event(), asyncio.Event()
    tasks = await kopf.spawn_tasks(
        registry=registry,
        settings=fast_settings(settings),
        standalone=True,
        clusterwide=clusterwide,
        namespaces=() if clusterwide else namespaces,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        memo=memo,
    )
    runner = asyncio.create_task(kopf.run_tasks(tasks, ignored=existing), name="kopf-operator")
    try:
        await asyncio.wait_for(ready_flag.wait(), timeout=30)
        yield runner
    finally:
        stop_flag.set()
        await asyncio.wait_for(runner, timeout=stop_timeout)


async def eventually(predicate, timeout: float = 15, interval: float = 0.05):
    """Poll ``predicate`` (sync, run in a thread) until it returns a truthy value; return that value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        await asyncio.sleep(interval)
