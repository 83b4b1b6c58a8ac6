"""Cold adapters off the serving path: a slow load stalls nobody else, loads run side by side, a broken file
fails only its own requests, and a loop whose every request waits for an adapter sleeps instead of spinning.

Loads are slowed by a gated reader injected as the adapter manager's ``read`` (the real file read once the
gate opens), so every wait is deterministic."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from loraplane.artifacts.fsutil import SETTLE_NS
from loraplane.engine.api import AdapterError
from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.errors import RequestError
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams
from loraplane.engine.lora.safetensors_io import read_file
from tests.engine.peft_adapters import save_peft_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 9, 13, 17, 21, 25]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class GatedReader:
    """Reads the weights of the folders named in ``slow`` only once ``gate`` is set; counts who waits."""

    def __init__(self, slow: set[str]) -> None:
        self.slow, self.gate = slow, threading.Event()
        self.waiting: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, path: Path) -> memoryview:
        name = Path(path).parent.name
        if name in self.slow:
            with self.lock:
                self.waiting.add(name)
            assert self.gate.wait(60), "the test never opened the gate"
        return read_file(path)


@pytest.fixture(scope="module")
def adapters(make_hf_model, tmp_path_factory):
    base = make_hf_model("llama", tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("churn-adapters")
    folders = {
        name: save_peft_adapter(
            base, root / name, seed=i, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        )
        for i, name in enumerate(("hot", "cold1", "cold2", "broken"))
    }
    return base, folders


def make_async(base: Path, **kw) -> AsyncEngine:
    cfg = EngineConfig(model=str(base), device="cpu", block_size=4, max_num_batched_tokens=128,
                       num_kv_blocks=128, **kw)  # fmt: skip
    return AsyncEngine(LLMEngine(cfg))


async def collect(engine: AsyncEngine, adapter: str | None) -> list[int]:
    tokens = []
    async for out in engine.add_request(PROMPT, GREEDY, adapter=adapter):
        tokens += out.new_token_ids
    return tokens


async def load_all(engine: AsyncEngine, folders: dict[str, Path], names) -> None:
    for name in names:
        await engine.load_adapter(name, "v1", folders[name], f"sha256:{name}")


def to_disk(engine: AsyncEngine, *names: str) -> None:
    """Leave only the folder: the next request must load it from disk."""
    lora = engine.engine.runner.lora
    with lora.lock:
        for name in names:
            lora.host.drop(f"{name}@v1")
            assert lora.tier_of(f"{name}@v1") == "disk"


def test_resident_adapter_finishes_while_another_loads_slowly_and_tokens_are_unchanged(adapters):
    base, folders = adapters

    async def main():
        engine = make_async(base)
        try:
            await load_all(engine, folders, ("hot", "cold1"))
            await engine.warm_adapter("hot", "v1")
            alone = await collect(engine, "hot@v1")
            reader = GatedReader({"cold1"})
            engine.engine.runner.lora.read = reader
            to_disk(engine, "cold1")
            cold = asyncio.create_task(collect(engine, "cold1@v1"))
            while "cold1" not in reader.waiting:
                await asyncio.sleep(0.01)
            hot = await asyncio.wait_for(collect(engine, "hot@v1"), 30)
            assert hot == alone and not cold.done()
            reader.gate.set()
            assert len(await asyncio.wait_for(cold, 30)) == GREEDY.max_tokens
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_two_loads_are_in_flight_at_once(adapters):
    base, folders = adapters

    async def main():
        engine = make_async(base)
        try:
            await load_all(engine, folders, ("cold1", "cold2"))
            reader = GatedReader({"cold1", "cold2"})
            lora = engine.engine.runner.lora
            lora.read = reader
            to_disk(engine, "cold1", "cold2")
            tasks = [asyncio.create_task(collect(engine, f"{n}@v1")) for n in ("cold1", "cold2")]
            deadline = time.monotonic() + 30
            while reader.waiting != {"cold1", "cold2"}:  # both reads started before either could finish
                assert time.monotonic() < deadline, reader.waiting
                await asyncio.sleep(0.01)
            assert lora.loader.max_in_flight >= 2
            reader.gate.set()
            assert [len(t) for t in await asyncio.gather(*tasks)] == [GREEDY.max_tokens] * 2
        finally:
            await engine.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("damage", ["truncated", "checksum"])
def test_a_failing_load_fails_its_own_requests_with_a_named_reason(adapters, tmp_path, damage):
    base, folders = adapters
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folders["broken"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    folders = {**folders, "broken": broken}

    async def main():
        engine = make_async(base)
        try:
            await load_all(engine, folders, ("hot", "broken"))
            to_disk(engine, "broken")
            weights = broken / "adapter_model.safetensors"
            data = bytearray(weights.read_bytes())
            if damage == "truncated":
                weights.write_bytes(data[: len(data) // 2])
            else:  # same size, other bytes: only the hash taken at the first read can tell
                data[-8:] = b"\x00" * 8
                weights.write_bytes(bytes(data))
            bad = asyncio.create_task(collect(engine, "broken@v1"))
            good = asyncio.create_task(collect(engine, "hot@v1"))
            assert len(await asyncio.wait_for(good, 30)) == GREEDY.max_tokens
            with pytest.raises(RequestError) as err:
                await asyncio.wait_for(bad, 30)
            want = "BadAdapterFile" if damage == "truncated" else "ChecksumMismatch"
            assert f"adapter 'broken@v1': {want}: adapter_model.safetensors" in str(err.value), err.value
            assert engine.is_alive()
            assert len(await collect(engine, None)) == GREEDY.max_tokens  # the engine goes on
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_a_disk_registered_adapter_is_held_to_the_bytes_of_its_first_read(adapters, tmp_path):
    """Its first load returns before that read's hash ends; a reload after the file changed still fails."""
    base, folders = adapters
    folder = tmp_path / "cold"
    folder.mkdir()
    for f in folders["cold1"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())

    async def main():
        engine = make_async(base, max_loras=1, max_lora_rank=8)  # one adapter on the GPU
        try:
            await engine.load_adapter("cold", "v1", folder, "sha256:cold", on_disk=True)
            assert len(await collect(engine, "cold@v1")) == GREEDY.max_tokens  # the first read
            await load_all(engine, folders, ("hot",))
            assert len(await collect(engine, "hot@v1")) == GREEDY.max_tokens  # takes the GPU from cold
            to_disk(engine, "cold")
            weights = folder / "adapter_model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-8:] = b"\x00" * 8
            weights.write_bytes(bytes(data))
            with pytest.raises(RequestError, match="ChecksumMismatch"):
                await asyncio.wait_for(collect(engine, "cold@v1"), 30)
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_a_reload_of_an_unwritten_file_skips_the_hash_and_a_write_is_still_caught(adapters, tmp_path):
    """A file that has the identity (inode, size, mtime, ctime) it had when it last hashed to the version's
    digest is not hashed again on a reload; a write is caught even with its mtime put back, since the ctime
    cannot be put back. A file changed less than a timestamp tick ago is never trusted by its identity."""
    base, folders = adapters
    folder = tmp_path / "cold"
    folder.mkdir()
    for f in folders["cold1"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    weights = folder / "adapter_model.safetensors"

    async def reload(engine) -> list[int]:
        await load_all(engine, folders, ("hot",))
        assert len(await collect(engine, "hot@v1")) == GREEDY.max_tokens  # takes the GPU from cold
        to_disk(engine, "cold")
        return await asyncio.wait_for(collect(engine, "cold@v1"), 30)

    async def main():
        engine = make_async(base, max_loras=1, max_lora_rank=8)  # one adapter on the GPU
        lora = engine.engine.runner.lora
        try:
            await engine.load_adapter("cold", "v1", folder, "sha256:cold", on_disk=True)
            first = await collect(engine, "cold@v1")  # the first read: hashed off the load's path
            assert await reload(engine) == first
            assert lora.versions["cold@v1"].timings["disk_hash"] > 0, "a file written just now was trusted"
            await asyncio.sleep(SETTLE_NS / 1e9 + 0.1)  # older than any timestamp tick now
            assert await reload(engine) == first  # hashed once more: its identity is kept this time
            for _ in range(2):
                assert await reload(engine) == first
                assert lora.versions["cold@v1"].timings["disk_hash"] == 0.0, "an unwritten file hashed again"
            stat = weights.stat()
            data = bytearray(weights.read_bytes())
            data[-8:] = b"\x00" * 8
            weights.write_bytes(bytes(data))
            os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same size and mtime as before
            with pytest.raises(RequestError, match="ChecksumMismatch"):
                await reload(engine)
        finally:
            await engine.aclose()

    asyncio.run(main())


def copy_of(folders: dict[str, Path], folder: Path, digest_suffix: bytes = b"") -> str:
    """``cold1``'s files in ``folder``; the digest of its weights (of other bytes with ``digest_suffix``)."""
    folder.mkdir()
    for f in folders["cold1"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    data = (folder / "adapter_model.safetensors").read_bytes()
    return "sha256:" + hashlib.sha256(data + digest_suffix).hexdigest()


async def cold_with_its_hash_held(engine, folders, folder: Path, digest: str, after_s: float) -> list[int]:
    """Load ``cold`` from ``folder`` on the disk tier, serve it once, push it off the GPU and the host, and
    make its first read's hash look unfinished until ``after_s`` from now, when it gives ``digest``. Returns
    the first answer's tokens."""
    lora = engine.engine.runner.lora
    await engine.load_adapter("cold", "v1", folder, "sha256:cold", on_disk=True)
    first = await collect(engine, "cold@v1")
    await load_all(engine, folders, ("hot",))
    assert len(await collect(engine, "hot@v1")) == GREEDY.max_tokens  # takes the GPU from cold
    to_disk(engine, "cold")
    held: concurrent.futures.Future = concurrent.futures.Future()
    with lora.lock:
        v = lora.versions["cold@v1"]
        v.sha256, v.hashing, v.file_id = None, held, None  # as if the first read's hash still ran
    threading.Timer(after_s, held.set_result, args=((digest, 0.1),)).start()
    return first


def test_a_reload_does_not_wait_on_the_engine_thread_for_the_first_reads_hash(adapters, tmp_path):
    """A version whose first read is still being hashed and whose host copy is gone is reloaded only once
    that hash is known (the reload is checked against it), but the engine thread never blocks for it: it
    looks again at its next pass. Here the hash is held back for 1.5 s; the engine thread's call returns at
    once, and the request is served with the same tokens once the hash is in."""
    base, folders = adapters
    digest = copy_of(folders, tmp_path / "cold")

    async def main():
        engine = make_async(base, max_loras=1, max_lora_rank=8)
        lora = engine.engine.runner.lora
        try:
            first = await cold_with_its_hash_held(engine, folders, tmp_path / "cold", digest, 1.5)

            def advance() -> bool:
                with lora.lock:
                    return lora._advance("cold@v1")

            start = time.perf_counter()
            ready = await engine._on_engine_thread(advance)
            waited = time.perf_counter() - start
            assert not ready and waited < 1.0, f"the engine thread waited {waited:.2f} s for a hash"
            assert await asyncio.wait_for(collect(engine, "cold@v1"), 30) == first
        finally:
            await engine.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["warm", "request"])
def test_a_reload_after_the_first_reads_hash_is_checked_against_it(adapters, tmp_path, how):
    """Whether a warm-up (which blocks for the hash) or a request (which looks again later) brings it back, a
    reload is held to the first read's digest: a right one serves the adapter, a wrong one fails it by name."""
    base, folders = adapters

    async def main(right: bool):
        folder = tmp_path / f"cold-{right}"
        digest = copy_of(folders, folder, b"" if right else b"x")
        engine = make_async(base, max_loras=1, max_lora_rank=8)
        lora = engine.engine.runner.lora
        try:
            first = await cold_with_its_hash_held(engine, folders, folder, digest, 0.5)
            if how == "warm":
                if right:
                    await engine.warm_adapter("cold", "v1")
                    assert lora.tier_of("cold@v1") == "gpu"
                else:
                    with pytest.raises(AdapterError, match="ChecksumMismatch"):
                        await engine.warm_adapter("cold", "v1")
                    return
            if right:
                assert await asyncio.wait_for(collect(engine, "cold@v1"), 30) == first
            else:
                with pytest.raises(RequestError, match="ChecksumMismatch"):
                    await asyncio.wait_for(collect(engine, "cold@v1"), 30)
        finally:
            await engine.aclose()

    asyncio.run(main(True))
    asyncio.run(main(False))


def test_loop_sleeps_while_every_request_waits_for_an_adapter(adapters):
    """The engine thread's own CPU time (time.thread_time, read on that thread after each step) over a
    stretch in which the only requests wait for a load held at the gate: a spinning loop burns ~100 %."""
    base, folders = adapters

    async def main():
        engine = make_async(base)
        samples: list[tuple[float, float]] = []  # (wall, engine thread CPU) after each step
        engine.add_step_listener(lambda _: samples.append((time.perf_counter(), time.thread_time())))
        try:
            await load_all(engine, folders, ("cold1",))
            reader = GatedReader({"cold1"})
            engine.engine.runner.lora.read = reader
            to_disk(engine, "cold1")
            tasks = [asyncio.create_task(collect(engine, "cold1@v1")) for _ in range(3)]
            while "cold1" not in reader.waiting:
                await asyncio.sleep(0.01)
            first = len(samples)
            await asyncio.sleep(1.0)
            window = samples[max(0, first - 1) :]
            reader.gate.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            await engine.aclose()
        assert len(window) >= 2, "the loop must still look now and then (time-based limits)"
        wall = window[-1][0] - window[0][0]
        cpu = window[-1][1] - window[0][1]
        assert wall > 0.5 and cpu / wall < 0.10, f"engine thread busy {cpu / wall:.0%} of {wall:.2f} s"

    asyncio.run(main())


def test_unknown_reader_failure_is_named(adapters):
    """A read that raises (the disk vanished) fails the adapter's requests with BadAdapterFile."""
    base, folders = adapters

    def failing(path: Path) -> memoryview:
        raise OSError(5, "Input/output error", str(path))

    async def main():
        engine = make_async(base)
        try:
            await load_all(engine, folders, ("cold2",))
            engine.engine.runner.lora.read = failing
            to_disk(engine, "cold2")
            with pytest.raises(RequestError) as err:
                await asyncio.wait_for(collect(engine, "cold2@v1"), 30)
            assert "BadAdapterFile: adapter_model.safetensors: unreadable" in str(err.value), err.value
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_direct_read_equals_the_cached_read_and_bf16_nans_are_found(adapters, tmp_path):
    import torch

    from loraplane.engine.lora.safetensors_io import read_file_direct
    from loraplane.engine.lora.stacking import _finite_peak

    _, folders = adapters
    path = folders["hot"] / "adapter_model.safetensors"
    try:
        direct = read_file_direct(path)
    except OSError as exc:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(f"no O_DIRECT here: {exc}")
    assert bytes(direct) == bytes(read_file(path)) == path.read_bytes()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.randn(4, 8).to(dtype)
        assert _finite_peak(t) is not None
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u[2, 3] = bad
            assert _finite_peak(u) is None, (dtype, bad)
        big = torch.randn(100_003).to(dtype)  # the vectorised path and its tail
        for at in (0, 50_001, 100_002):
            for bad in (float("nan"), float("inf"), float("-inf")):
                u = big.clone()
                u[at] = bad
                assert _finite_peak(u) is None, (dtype, bad, at)
