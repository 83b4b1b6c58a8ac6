"""The host cache's pull path for adapters that share weight files: ``S3Source.pull`` (``HostCache.pull``,
then the serving side's check of the folder), what the engine's lazy fetch runs on each of its loader
threads. ``python bench/run.py pull_path --out bench/pull_path/results``.

S3 is moto's standalone server over HTTP (as the tests run it). ``--adapters`` signed artifacts share
``--ranks`` weight files (one per rank, content-addressed in S3 and in the host cache), pushed with the
library behind ``loraplane adapter pack|sign|push``. Two rounds, each pulling every adapter once from
``--threads`` threads in order: ``first`` into an empty cache (each rank's first pull downloads its blob,
every other pull finds it cached), ``again`` into the filled cache (each adapter's folder is cached).

``restart`` pulls them all again through a new ``HostCache`` on the same folder: what a restarted server (or
another process sharing the cache) does first.

Bytes read for checks: what this process read from files during the round (``rchar`` of /proc/self/io; the
download's socket reads are not in it, as the ``first`` round shows), divided by the weight bytes the
round's pulls hand over: the number of times each pull's files were read to be hashed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BUCKET = "adapters"
MODULES = ("q_proj", "v_proj")
# Llama-3-8B's attention widths over 16 layers: rank 32 -> 27 MB, rank 64 -> 53 MB of float32 weights.
BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "num_hidden_layers": 16, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "tie_word_embeddings": False}  # fmt: skip


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _publish(work: Path, n: int, ranks: list[int], client, private_pem: bytes, base_hash: str) -> list[str]:
    """One weights file per rank; ``n`` artifacts of hard links to them, packed, signed and pushed."""
    from loraplane.artifacts.pack import pack_folder, push_folder, sign_folder
    from tests.adapter_factory import make_peft_folder

    sources = {r: make_peft_folder(work / f"rank{r}", base_config=BASE, rank=r, target_modules=MODULES)
               for r in ranks}  # fmt: skip
    uris = []
    for i in range(n):
        folder = work / "artifacts" / f"a{i:04d}"
        folder.mkdir(parents=True)
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            os.link(sources[ranks[i % len(ranks)]] / file, folder / file)
        pack_folder(folder, name=f"a{i:04d}", version="v1", base_hash=base_hash)
        sign_folder(folder, private_pem)
        uris.append(push_folder(folder, f"s3://{BUCKET}/a{i:04d}/v1/", s3_client=client)["uri"])
    return uris


def _round(name: str, source, specs, threads: int) -> dict:
    cache = source.cache
    before = dict(cache.counters)
    rchar, started = _rchar(), time.perf_counter()

    def pull(spec):
        t0 = time.perf_counter()
        local = source.pull(spec)
        seconds = time.perf_counter() - t0
        source.release(local.digest)
        return (
            seconds,
            local.download_s,
            local.verify_s,
            (local.path / "adapter_model.safetensors").stat().st_size,
        )

    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(pull, specs))
    wall = time.perf_counter() - started
    downloaded = cache.counters["bytes_downloaded"] - before.get("bytes_downloaded", 0)
    read = _rchar() - rchar
    handed = sum(d[3] for d in done)
    per = sorted(d[0] for d in done)
    return {"round": name, "pulls": len(done), "wall_s": wall, "pull_p50_s": statistics.median(per),
            "pull_max_s": per[-1], "cache_pull_s_mean": statistics.mean(d[1] for d in done),
            "folder_check_s_mean": statistics.mean(d[2] for d in done), "downloaded_MB": downloaded / 1e6,
            "check_read_MB": read / 1e6, "hash_passes_per_pull": read / handed,
            "cache_hash_passes": cache.counters["hash_passes"] - before.get("hash_passes", 0)}  # fmt: skip


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench/run.py pull_path")
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--ranks", default="32,64", help="one shared weights file per rank")
    parser.add_argument("--threads", type=int, default=4, help="pulls at once (the engine's loader workers)")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]

    from loraplane.artifacts.cache import HostCache
    from loraplane.artifacts.signing import generate_keypair, key_id
    from loraplane.engine.api import EngineInfo
    from loraplane.http.adapters import LoadSpec
    from loraplane.serve.sources import S3Source
    from tests.s3_servers import moto_server

    base_hash = "ab" * 32
    private_pem, public_pem = generate_keypair()
    info = EngineInfo(base_hash, 4096, BASE["vocab_size"], max(ranks), MODULES, "cpu", "float32")
    with tempfile.TemporaryDirectory(prefix="pull-path-") as tmp, moto_server() as s3:
        work = Path(tmp)
        s3.create_bucket(BUCKET)
        t0 = time.perf_counter()
        uris = _publish(work, args.adapters, ranks, s3.client(), private_pem, base_hash)
        publish_s = time.perf_counter() - t0
        cache = HostCache(work / "host-cache", 64 << 30, s3.client())
        source = S3Source(cache, {key_id(public_pem): public_pem}, lambda: info)
        specs = [LoadSpec(f"a{i:04d}", "v1", uri, None) for i, uri in enumerate(uris)]
        rows = [_round("first", source, specs, args.threads), _round("again", source, specs, args.threads)]
        source = S3Source(HostCache(cache.root, 64 << 30, s3.client()), source.trusted_keys, lambda: info)
        rows.append(_round("restart", source, specs, args.threads))
        blob_mb = {r: (work / f"rank{r}" / "adapter_model.safetensors").stat().st_size / 1e6 for r in ranks}
    return {
        "title": f"S3Source.pull of {args.adapters} adapters sharing {len(ranks)} weight files, "
        f"{args.threads} at once",
        "columns": [
            "round",
            "pulls",
            "wall_s",
            "pull_p50_s",
            "pull_max_s",
            "cache_pull_s_mean",
            "folder_check_s_mean",
            "downloaded_MB",
            "check_read_MB",
            "hash_passes_per_pull",
            "cache_hash_passes",
        ],  # fmt: skip
        "rows": rows,
        "meta": {
            "weights_MB_per_rank": {r: round(mb, 1) for r, mb in blob_mb.items()},
            "publish_s": round(publish_s, 1),
            "cpus": os.cpu_count(),
            "loraplane": str(Path(sys.modules["loraplane"].__file__).parent),
            "s3": "moto standalone server",
        },
        "notes": [
            "cache_pull_s: HostCache.pull; folder_check_s: the serving side's check of the pulled folder",
            "hash_passes_per_pull: file bytes read over the weight bytes handed over",
        ],
    }
