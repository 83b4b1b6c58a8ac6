"""Fetch a base model folder from ``s3://bucket/prefix/`` into the host cache, verified, atomically.

Torch-free (boto3 + the artifacts' S3 helpers). The cache entry is ``<host-cache-dir>/models/<sha256>/``:
the files are downloaded into a temporary folder beside it, the base hash of that folder is compared
with the pinned one, and only then is it renamed into place, so a cache entry always holds the weights
its name claims and a pod restart skips the download. Credentials come from boto3's standard chain
(endpoint: ``AWS_ENDPOINT_URL_S3``); nothing here logs them.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3
from loraplane.artifacts.base_hash import BaseHashError, compute_base_hash

log = logging.getLogger("loraplane.model_fetch")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
WANTED_NAMES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)


class ModelFetchError(ValueError):
    """The model could not be fetched or is not the pinned one (the message names the field)."""


def is_s3_uri(model: str) -> bool:
    return model.startswith("s3://")


def model_cache_dir(host_cache_dir: str | Path, sha256: str) -> Path:
    return Path(host_cache_dir) / "models" / sha256


def select_files(listing: dict[str, int], uri: str) -> dict[str, int]:
    """{name: size} of the files a model folder needs; pickle weights refuse the whole model."""
    pickles = sorted(n for n in listing if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ModelFetchError(
            f"model: {uri} holds pickle weights ({', '.join(pickles[:3])}); only safetensors are loaded "
            "(convert them, e.g. with `model.save_pretrained(out, safe_serialization=True)`)"
        )
    wanted = {
        name: size
        for name, size in listing.items()
        if "/" not in name and (name in WANTED_NAMES or name.endswith(".safetensors"))
    }
    if "config.json" not in wanted:
        raise ModelFetchError(f"model: {uri} holds no config.json (is the prefix a model folder?)")
    if not any(name.endswith(".safetensors") for name in wanted):
        raise ModelFetchError(f"model: {uri} holds no *.safetensors weights")
    return wanted


def fetch_model(
    uri: str,
    sha256: str,
    host_cache_dir: str | Path,
    *,
    client=None,
    retry: s3.RetryPolicy | None = None,
) -> Path:
    """The local folder of the model at ``uri`` (downloaded on first use), whose base hash is ``sha256``."""
    final = model_cache_dir(host_cache_dir, sha256)
    if (final / "config.json").is_file():
        log.info("model: %s is cached at %s", uri, final)
        return final
    try:
        bucket, prefix = s3.parse_s3_uri(uri)
    except E.ArtifactError as exc:
        raise ModelFetchError(f"model: {exc}") from None
    client = client or s3.make_client()
    retry = retry or s3.RetryPolicy()
    try:
        files = select_files(s3.list_prefix(client, bucket, prefix, retry=retry), uri)
    except E.ArtifactError as exc:
        raise ModelFetchError(f"model: listing {uri}: {exc}") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha256[:16]}-", dir=final.parent))
    try:
        total = sum(files.values())
        log.info("model: downloading %d files (%d bytes) from %s", len(files), total, uri)
        for name, size in sorted(files.items()):
            _download(client, bucket, prefix + name, tmp / name, size, retry)
        _check_hash(tmp, sha256, uri)
        _install(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model: %s cached at %s", uri, final)
    return final


def _download(client, bucket: str, key: str, dest: Path, size: int, retry: s3.RetryPolicy) -> None:
    name = PurePosixPath(key).name

    def once() -> None:
        got = 0
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        with open(dest, "wb") as sink:
            try:
                while chunk := body.read(s3.CHUNK):
                    got += len(chunk)
                    sink.write(chunk)
            finally:
                body.close()
        if got != size:  # a truncated body (or an object replaced mid-download): try again
            raise s3.ShortBody(f"{name}: got {got} of {size} bytes")

    try:
        s3.with_retries(once, what=f"s3://{bucket}/{key}", retry=retry)
    except E.ArtifactError as exc:
        raise ModelFetchError(f"model: downloading {name}: {exc}") from None


def _check_hash(folder: Path, sha256: str, uri: str) -> None:
    try:
        got = compute_base_hash(folder)
    except BaseHashError as exc:
        raise ModelFetchError(f"model: {uri}: {exc}") from None
    if got != sha256:
        raise ModelFetchError(f"model_sha256: the weights at {uri} hash to {got}, not the pinned {sha256}")


def _install(tmp: Path, final: Path) -> None:
    """Rename into place; another process that won the race leaves its (identical) folder there."""
    os.chmod(tmp, 0o755)  # mkdtemp made it 0700
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
