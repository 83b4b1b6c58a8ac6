"""The engine's remote tier on its own: a version registered from its ranks, whose fetch (the serving side's
S3 pull, here a gated copy of a local folder) runs on a loader worker when a request or a warm-up first
needs it. The S3 pull itself, through the admin API, is tested in tests/http/test_admin_lazy.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from loraplane.artifacts.fsutil import file_identity
from loraplane.engine.api import AdapterError, RemoteAdapter, VerifiedFile
from loraplane.engine.core.errors import RequestError
from tests.engine.peft_adapters import save_peft_adapter
from tests.engine.test_adapter_churn import GREEDY, collect, make_async

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RANKS = {"q_proj": 8, "v_proj": 8}


class Fetch:
    """Copies ``source`` into ``dest`` once ``gate`` is set (the pull), on whichever thread calls it."""

    def __init__(self, source: Path, dest: Path, digest: str, gated: bool = False) -> None:
        self.source, self.dest, self.digest = source, dest, digest
        self.gate, self.started = threading.Event(), threading.Event()
        self.threads: list[str] = []
        if not gated:
            self.gate.set()

    def __call__(self) -> tuple[Path, str]:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"
        shutil.copytree(self.source, self.dest, dirs_exist_ok=True)
        return self.dest, self.digest


@pytest.fixture(scope="module")
def folders(make_hf_model, tmp_path_factory):
    base = make_hf_model("llama", tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("remote-adapters")
    made = {
        name: save_peft_adapter(
            base, root / name, seed=i, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        )
        for i, name in enumerate(("hot", "far"))
    }
    return base, made


def remote(fetch: Fetch, ranks=RANKS) -> RemoteAdapter:
    return RemoteAdapter(fetch, dict(ranks), (fetch.source / "adapter_model.safetensors").stat().st_size)


def test_a_remote_version_serves_like_a_loaded_one_and_its_warm_up_leaves_the_engine_serving(
    folders, tmp_path
):
    base, made = folders

    async def main():
        engine = make_async(base)
        try:
            await engine.load_adapter("hot", "v1", made["hot"], "sha256:hot")
            await engine.load_adapter("far", "v0", made["far"], "sha256:far0")  # the same weights, parsed now
            await engine.warm_adapter("hot", "v1")
            alone = await collect(engine, "hot@v1")
            fetch = Fetch(made["far"], tmp_path / "pulled", "sha256:far", gated=True)
            info = await engine.register_remote_adapter("far", "v1", "sha256:far", remote(fetch))
            assert (info.tier, info.rank, info.state) == ("remote", 8, "loaded")
            assert engine.engine.runner.lora.tier_stats()["remote"]["entries"] == 1
            warm = asyncio.create_task(engine.warm_adapter("far", "v1"))
            await asyncio.to_thread(fetch.started.wait, 30)
            assert await asyncio.wait_for(collect(engine, "hot@v1"), 30) == alone  # the pull blocks nobody
            assert not warm.done()
            fetch.gate.set()
            assert (await asyncio.wait_for(warm, 30)).state == "warm"
            assert fetch.threads[0].startswith("loraplane-adapter-load")  # a loader worker, not the engine's
            assert (
                engine.tier_of("far@v1") == "gpu"
                and "pull" in engine.engine.runner.lora.info("far@v1").timings
            )
            assert await collect(engine, "far@v1") == await collect(engine, "far@v0")
        finally:
            await engine.aclose()

    asyncio.run(main())


class Refused(Exception):
    reason = "FileHashMismatch"


@pytest.mark.parametrize(
    "failure, want",
    [
        (
            Refused("FileHashMismatch: adapter_model.safetensors: sha256 differs"),
            "FileHashMismatch: pull: adapter_model",
        ),
        (OSError(5, "Input/output error"), "PullFailed: pull: [Errno 5] Input/output error"),
        ("digest", "DigestMismatch: pull: far@v1: fetched manifest sha256:other"),
    ],
)
def test_a_failed_pull_fails_its_own_requests_with_its_reason(folders, tmp_path, failure, want):
    base, made = folders

    def fetch() -> tuple[Path, str]:
        if failure == "digest":
            return made["far"], "sha256:other"
        raise failure

    async def main():
        engine = make_async(base)
        try:
            await engine.load_adapter("hot", "v1", made["hot"], "sha256:hot")
            await engine.register_remote_adapter(
                "far", "v1", "sha256:far", RemoteAdapter(fetch, RANKS, 1 << 20)
            )
            bad = asyncio.create_task(collect(engine, "far@v1"))
            assert len(await asyncio.wait_for(collect(engine, "hot@v1"), 30)) == GREEDY.max_tokens
            reason, detail = want.split(": ", 1)
            for attempt in (bad, collect(engine, "far@v1")):  # marked failed: the next request fails at once
                with pytest.raises(RequestError) as err:
                    await asyncio.wait_for(attempt, 30)
                # the request learns the version and the reason; the pull's details stay with the operator
                assert f"adapter 'far@v1': {reason}: the pull of its files failed" in str(err.value), (
                    err.value
                )
                assert detail not in str(err.value)
            info = engine.engine.runner.lora.info("far@v1")
            assert info.state == "failed" and info.error.startswith(want), info.error
            assert len(await collect(engine, None)) == GREEDY.max_tokens
        finally:
            await engine.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    "ranks, reason, field",
    [
        ({"q_proj": 128}, "RankTooHigh", "q_proj rank 128"),
        ({"lm_head": 8}, "UnknownModule", "'lm_head'"),
        ({}, "BadAdapterFile", "ranks"),
    ],
)
def test_a_remote_registration_is_refused_by_its_ranks_naming_the_module(folders, ranks, reason, field):
    base, _ = folders

    async def main():
        engine = make_async(base)
        try:
            with pytest.raises(AdapterError) as err:
                await engine.register_remote_adapter(
                    "x", "v1", "sha256:x", RemoteAdapter(lambda: None, ranks, 1)
                )
            assert err.value.reason == reason and field in err.value.message, err.value
            assert not engine.adapters()
        finally:
            await engine.aclose()

    asyncio.run(main())


class VerifiedFetch(Fetch):
    """A fetch that also tells what it verified of the weights file: its digest and the file's identity then.
    ``write_after``: the file is written once verified (same size, its mtime put back)."""

    def __init__(self, source: Path, dest: Path, digest: str, write_after: bool) -> None:
        super().__init__(source, dest, digest)
        self.write_after = write_after

    def __call__(self) -> tuple[Path, str, VerifiedFile]:
        folder, digest = super().__call__()
        weights = folder / "adapter_model.safetensors"
        verified = VerifiedFile(
            "sha256:" + hashlib.sha256(weights.read_bytes()).hexdigest(), file_identity(weights)
        )
        if self.write_after:
            stat, data = weights.stat(), bytearray(weights.read_bytes())
            data[-8:] = b"\x00" * 8  # the last values become zeros: still a valid file
            weights.write_bytes(bytes(data))
            os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        return folder, digest, verified


@pytest.mark.parametrize("write_after", [False, True], ids=["unwritten", "written-after"])
def test_a_fetch_that_verified_the_weights_spares_the_load_its_hash_unless_the_file_changed(
    folders, tmp_path, write_after
):
    base, made = folders

    async def main():
        engine = make_async(base)
        try:
            fetch = VerifiedFetch(made["far"], tmp_path / "pulled", "sha256:far", write_after)
            await engine.register_remote_adapter("far", "v1", "sha256:far", remote(fetch))
            if write_after:  # the identity moved: hashed, and refused
                with pytest.raises(RequestError, match="ChecksumMismatch"):
                    await asyncio.wait_for(collect(engine, "far@v1"), 30)
                return
            assert len(await asyncio.wait_for(collect(engine, "far@v1"), 30)) == GREEDY.max_tokens
            version = engine.engine.runner.lora.versions["far@v1"]
            want = (
                "sha256:"
                + hashlib.sha256((made["far"] / "adapter_model.safetensors").read_bytes()).hexdigest()
            )
            assert (version.sha256, version.hashing, version.timings["disk_hash"]) == (want, None, 0.0)
        finally:
            await engine.aclose()

    asyncio.run(main())
