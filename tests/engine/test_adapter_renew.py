"""A version registered again while its old record is still held (a request in flight after an unload, or a
failed load): the new registration's source replaces the old one's, and its next need loads afresh."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from loraplane.engine.api import AdapterError, RemoteAdapter
from loraplane.engine.core.errors import RequestError
from tests.engine.test_adapter_churn import collect, make_async
from tests.engine.test_adapter_remote import RANKS, folders  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Unreachable(Exception):
    reason = "SourceUnreachable"


def unreachable() -> tuple[Path, str]:
    raise Unreachable("S3 error 503 at http://s3.internal:9000 bucket adapters")


def test_a_failed_pull_retried_while_a_request_holds_the_version_pulls_again(folders):  # noqa: F811
    base, made = folders
    pulls = []

    def good() -> tuple[Path, str]:
        pulls.append(1)
        return made["far"], "sha256:far"

    async def main():
        engine = make_async(base)
        lora = engine.engine.runner.lora
        try:
            await engine.register_remote_adapter(
                "far", "v1", "sha256:far", RemoteAdapter(unreachable, RANKS, 1)
            )
            with pytest.raises(AdapterError):
                await engine.warm_adapter("far", "v1")
            assert lora.info("far@v1").state == "failed"
            lora.hold("far@v1")  # a request submitted and not ended keeps the record
            await engine.unload_adapter("far", "v1")
            info = await engine.register_remote_adapter(
                "far", "v1", "sha256:far", RemoteAdapter(good, RANKS, 1)
            )
            assert (info.state, info.error, info.tier, info.in_flight) == ("loaded", None, "remote", 1)
            lora.note_request("far@v1", -1)
            assert (await engine.warm_adapter("far", "v1")).state == "warm"
            assert pulls == [1]
            assert len(await collect(engine, "far@v1")) > 0
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_a_warm_up_of_a_version_whose_pull_failed_names_the_pulls_reason_once(folders):  # noqa: F811
    base, _ = folders

    async def main():
        engine = make_async(base)
        try:
            await engine.register_remote_adapter(
                "far", "v1", "sha256:far", RemoteAdapter(unreachable, RANKS, 1)
            )
            for _ in range(2):  # the warm-up that ran the pull, then one of the failed version
                with pytest.raises(AdapterError) as err:
                    await engine.warm_adapter("far", "v1")
                assert err.value.reason == "SourceUnreachable", err.value  # not relabelled WarmFailed
                assert str(err.value).count("SourceUnreachable") == 1, err.value
            assert engine.engine.runner.lora.info("far@v1").error.count("SourceUnreachable") == 1
        finally:
            await engine.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("held", [True, False], ids=["request-in-flight", "freed"])
def test_a_version_registered_again_after_an_unload_never_gets_the_old_records_pull(folders, held):  # noqa: F811
    """Unloaded while its pull runs, then registered with a new fetch, whether a request still held the old
    record or it was freed: the new record's load is its own, never the old pull's (which fails: the
    serving side let its entry go)."""
    base, made = folders
    gate, started = threading.Event(), threading.Event()

    def old_fetch() -> tuple[Path, str]:
        started.set()
        assert gate.wait(60)
        raise AdapterError("AdapterNotFound", "far@v1 was unloaded while it was pulled")

    async def main():
        engine = make_async(base)
        lora = engine.engine.runner.lora
        try:
            await engine.register_remote_adapter(
                "far", "v1", "sha256:far", RemoteAdapter(old_fetch, RANKS, 1)
            )
            lora.prefetch("far@v1")
            await asyncio.to_thread(started.wait, 30)
            if held:
                lora.hold("far@v1")
            await engine.unload_adapter("far", "v1")
            assert lora.is_registered("far@v1") == held
            new = RemoteAdapter(lambda: (made["far"], "sha256:far"), RANKS, 1)
            await engine.register_remote_adapter("far", "v1", "sha256:far", new)
            warm = asyncio.create_task(engine.warm_adapter("far", "v1"))
            await asyncio.sleep(0.2)
            gate.set()  # the old pull fails now: only the old record hears it
            assert (await asyncio.wait_for(warm, 30)).state == "warm"
            if held:
                lora.note_request("far@v1", -1)
        finally:
            gate.set()
            await engine.aclose()

    asyncio.run(main())


def test_a_request_of_a_version_whose_pull_failed_learns_the_reason_not_the_source(folders):  # noqa: F811
    base, _ = folders

    async def main():
        engine = make_async(base)
        try:
            await engine.register_remote_adapter(
                "far", "v1", "sha256:far", RemoteAdapter(unreachable, RANKS, 1)
            )
            for _ in range(2):  # the request that ran the pull, then one failed at once
                with pytest.raises(RequestError) as err:
                    await asyncio.wait_for(collect(engine, "far@v1"), 30)
                told = str(err.value)
                assert "adapter 'far@v1': SourceUnreachable" in told and "s3.internal" not in told, told
            assert "s3.internal" in engine.engine.runner.lora.info("far@v1").error  # the admin API sees it
        finally:
            await engine.aclose()

    asyncio.run(main())
