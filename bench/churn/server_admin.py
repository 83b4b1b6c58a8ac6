"""The churn server bench's adapters through the admin API, the way a pod gets them: signed artifacts in S3,
pulled into the host cache, verified and loaded by ``PUT /admin/adapters/{name}``.

- S3 is moto's standalone server over HTTP on a free port (as the tests run it); boto3 is not patched.
- Each adapter is packed (manifest naming it, pinned to the base's hash), signed with a fresh Ed25519 key
  and pushed with the library the ``loraplane adapter pack|sign|push`` CLI calls.
- ``loraplane serve`` gets what a user would give it: ``--host-cache-dir``, ``--trusted-keys-dir`` (the
  public key), ``--admin-port`` and ``--admin-token-file``; S3 through boto3's standard chain: the endpoint
  in ``AWS_ENDPOINT_URL_S3`` and the credentials in a file named by ``AWS_SHARED_CREDENTIALS_FILE``.
- Registration PUTs every adapter with its manifest digest and ``warm: "host"`` (a cold-heavy workload
  need not keep them on the GPU), a few at a time, then waits until ``GET /admin/adapters`` shows all warm.
  ``--admin-warm lazy`` PUTs ``warm: "lazy"`` instead: the pod verifies each signed manifest and registers
  the version on the engine's remote tier without pulling it; the trace's first request for an adapter pulls
  it (on the engine's loader), so registering 1,000 adapters downloads no weights.

Bytes: a push stores each distinct file once per bucket, under its sha256 (``_loraplane/blobs/sha256/<hex>``;
the artifact's prefix holds only its signed manifest), and the host cache also stores files by their sha256
(``blobs/<sha256>``, hard-linked into each adapter's folder). The bench's adapters share one weights file
per rank, so S3 and the host cache each hold one weights file per rank, whatever the adapter count:
``s3_bytes`` is what the bucket stores, ``s3_bytes_one_copy_per_artifact`` what it would store with each
artifact's files under its own prefix (1,000 Llama-3-8B-shaped adapters: ~157 GB). ``--admin-adapters
used`` (the GPU default) pushes and registers only the adapters the trace asks for; ``all`` registers every
one (the quick default).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BUCKET = "adapters"
VERSION = "v1"
TOKEN = "churn-admin-token"
PUT_AT_ONCE = 8  # concurrent PUTs (the engine serialises the warm-ups; pulls overlap)


@dataclass
class AdminSetup:
    """What ``loraplane serve`` is started with, and what was pushed."""

    argv: list[str]
    env: dict[str, str]
    artifacts: dict[str, tuple[str, str]]  # name -> (s3 uri, manifest digest)
    cache_dir: Path
    s3: object  # tests.s3_servers.S3Endpoint
    stats: dict = field(default_factory=dict)


@contextlib.contextmanager
def s3_adapters(work: Path, folders: dict[str, Path], threads: int = 8):
    """moto's S3 server holding a signed artifact of every folder; yields the ``AdminSetup``."""
    from loraplane.artifacts.base_hash import compute_base_hash
    from loraplane.artifacts.signing import generate_keypair
    from tests.s3_servers import free_port, moto_server

    _check_room(folders)
    private_pem, public_pem = generate_keypair()
    keys, trusted, cache = work / "signing", work / "trusted-keys", work / "host-cache"
    for folder in (keys, trusted, cache):
        folder.mkdir(parents=True, exist_ok=True)
    (keys / "signer.pem").write_bytes(private_pem)
    os.chmod(keys / "signer.pem", 0o600)
    (trusted / "signer.pub").write_bytes(public_pem)
    (work / "admin-token").write_text(TOKEN)
    base_hash = compute_base_hash(work)
    with moto_server() as s3:
        s3.create_bucket(BUCKET)
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:  # hashing and uploads give up the GIL
            done = pool.map(lambda kv: _publish(work, kv[0], kv[1], base_hash, private_pem, s3.client()),
                            folders.items())  # fmt: skip
            pushed = dict(zip(folders, done, strict=True))
        artifacts = {name: (p["uri"], p["digest"]) for name, p in pushed.items()}
        env = {"AWS_ENDPOINT_URL_S3": s3.url, "AWS_SHARED_CREDENTIALS_FILE": str(_credentials(work, s3)),
               "AWS_DEFAULT_REGION": s3.region, "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
        argv = ["--host-cache-dir", str(cache), "--trusted-keys-dir", str(trusted),
                "--admin-port", str(free_port()), "--admin-token-file", str(work / "admin-token")]  # fmt: skip
        stats = {"pack_sign_push_s": round(time.perf_counter() - started, 2), "artifacts": len(artifacts),
                 **_bucket_bytes(s3.client(), pushed)}  # fmt: skip
        yield AdminSetup(argv, env, artifacts, cache, s3, stats)


def _bucket_bytes(client, pushed: dict[str, dict]) -> dict:
    """What the bucket stores, its blobs, and what it would store with one copy of the files per artifact."""
    from loraplane.artifacts.s3blobs import BLOB_ROOT

    listed = [o for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
              for o in page.get("Contents", [])]  # fmt: skip
    blobs = [o["Size"] for o in listed if o["Key"].startswith(BLOB_ROOT)]
    manifests = sum(o["Size"] for o in listed if not o["Key"].startswith(BLOB_ROOT))
    return {"s3_bytes": sum(o["Size"] for o in listed), "s3_objects": len(listed), "s3_blobs": len(blobs),
            "s3_blob_bytes": sum(blobs),
            "s3_bytes_one_copy_per_artifact": manifests + sum(p["bytes"] for p in pushed.values()),
            "push_uploaded_bytes": sum(p["uploaded_bytes"] for p in pushed.values()),
            "push_deduplicated_bytes": sum(p["deduplicated_bytes"] for p in pushed.values())}  # fmt: skip


def _check_room(folders: dict[str, Path]) -> None:
    """moto spills each object to a file in the temp folder: refuse before pushing what cannot fit (the
    distinct files: the folders' hard links to one file are one blob in S3)."""
    files = {(f / n).stat().st_ino: (f / n).stat().st_size for f in folders.values()
             for n in ("adapter_config.json", "adapter_model.safetensors")}  # fmt: skip
    need = sum(files.values())
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if need > 0.9 * free:
        raise RuntimeError(f"admin_adapters: {len(folders)} artifacts need {need / 1e9:.1f} GB in S3, "
                           f"{tempfile.gettempdir()} has {free / 1e9:.1f} GB free (try --admin-adapters used)")  # fmt: skip


def _publish(work: Path, name: str, source: Path, base_hash: str, private_pem: bytes, client) -> dict:
    """pack -> sign -> push of one adapter (a folder of hard links to the source's files); push_folder's
    answer (uri, digest, bytes, uploaded_bytes, deduplicated_bytes)."""
    from loraplane.artifacts.pack import pack_folder, push_folder, sign_folder

    folder = work / "artifacts" / name
    folder.mkdir(parents=True)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        os.link(source / file, folder / file)
    pack_folder(folder, name=name, version=VERSION, base_hash=base_hash)
    signed = sign_folder(folder, private_pem)
    uri = f"s3://{BUCKET}/{name}/{VERSION}/"
    pushed = push_folder(folder, uri, s3_client=client)
    if pushed["digest"] != signed["digest"]:
        raise RuntimeError(f"{name}: pushed {pushed['digest']}, signed {signed['digest']}")
    return pushed


def _credentials(work: Path, s3) -> Path:
    """The shared-credentials file boto3's default chain reads (the secret is never on a command line)."""
    path = work / "aws" / "credentials"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"[default]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n"
    )
    os.chmod(path, 0o600)
    return path


def admin_url(setup: AdminSetup) -> str:
    return f"http://127.0.0.1:{setup.argv[setup.argv.index('--admin-port') + 1]}"


async def register(setup: AdminSetup, timeout_s: float = 3600, warm: str = "host") -> dict:
    """PUT every artifact, then wait for all to be warm (``warm="disk"``: pulled; ``"lazy"``: registered, pulled by their first
    request); returns the time and the admin API's views."""
    ready = ("warm",) if warm not in ("lazy", "disk") else ("loaded", "warm")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    gate = asyncio.Semaphore(PUT_AT_ONCE)
    async with httpx.AsyncClient(base_url=admin_url(setup), headers=headers, timeout=600) as client:

        async def put(name: str, uri: str, digest: str) -> None:
            body = {"uri": uri, "version": VERSION, "manifest_digest": digest, "warm": warm}
            async with gate:
                response = await client.put(f"/admin/adapters/{name}", json=body)
            if response.status_code not in (200, 202):
                raise RuntimeError(
                    f"PUT /admin/adapters/{name}: HTTP {response.status_code}: {response.text[:300]}"
                )

        started = time.perf_counter()
        await asyncio.gather(*(put(n, u, d) for n, (u, d) in setup.artifacts.items()))
        while True:
            views = (await client.get("/admin/adapters")).json()["adapters"]
            states = {v["name"]: v["state"] for v in views}
            failed = {v["name"]: v.get("error") for v in views if v["state"] == "failed"}
            if failed:
                raise RuntimeError(f"admin loads failed: {dict(list(failed.items())[:3])}")
            if all(states.get(n) in ready for n in setup.artifacts):
                break
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(
                    f"not {ready[0]} within {timeout_s} s: {sum(s in ready for s in states.values())} of {len(setup.artifacts)}"
                )
            await asyncio.sleep(0.1)
        seconds = time.perf_counter() - started
    blobs = [e for e in os.scandir(setup.cache_dir / "adapters" / "blobs") if e.is_file()]
    return {"admin_register_s": round(seconds, 2), "admin_adapters": len(views),
            "admin_warm": sum(v["state"] == "warm" for v in views), "admin_warm_mode": warm,
            "admin_remote": sum(v["tier"] == "remote" for v in views),
            "admin_digests_match": all(v["digest"] == setup.artifacts[v["name"]][1] for v in views),
            "host_cache_blobs": len(blobs), "host_cache_bytes": sum(e.stat().st_size for e in blobs),
            **setup.stats}  # fmt: skip
