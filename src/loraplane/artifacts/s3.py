"""S3 access: strict URIs, one client recipe, and retries with backoff and full jitter.

Credentials come only from boto3's standard chain; the endpoint from ``endpoint_url`` or boto3's own
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``. botocore's built-in retries are switched off on clients made
here, so one policy (``RetryPolicy``) covers both request faults (5xx, throttling, connect and read
timeouts) and body faults that botocore never retries (truncated or short bodies).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from loraplane.artifacts import errors as E

log = logging.getLogger(__name__)
T = TypeVar("T")
CHUNK = 1 << 20

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TRANSIENT_CODES = {
    "500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown", "Throttling",
    "ThrottlingException", "RequestTimeout", "RequestTimeoutException", "RequestLimitExceeded",
}  # fmt: skip
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_DENIED_CODES = {"403", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "ExpiredToken"}


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ("bucket", "a/b/"). The prefix is a folder: it always ends with '/'."""
    field_ = "source.uri"
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise E.ArtifactError(E.BAD_URI, f"{uri!r} does not start with s3://", field_)
    if any(c.isspace() or ord(c) < 32 for c in uri) or "?" in uri or "#" in uri or "\\" in uri:
        raise E.ArtifactError(
            E.BAD_URI, f"{uri!r} holds whitespace, control characters, '?', '#' or '\\'", field_
        )
    bucket, _, prefix = uri[5:].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise E.ArtifactError(E.BAD_URI, f"bucket {bucket!r} is not a valid S3 bucket name", field_)
    parts = prefix.removesuffix("/").split("/")
    if not prefix or not all(_PREFIX_PART.match(p) and p not in (".", "..") for p in parts):
        raise E.ArtifactError(
            E.BAD_URI,
            f"prefix {prefix!r} must be non-empty parts like name/version/ (no '..', no '//')",
            field_,
        )
    if len(parts) > 16 or ".." in prefix:
        raise E.ArtifactError(E.BAD_URI, f"prefix {prefix!r} is too deep or holds '..'", field_)
    return bucket, "/".join(parts) + "/"


def make_client(
    endpoint_url: str | None = None,
    *,
    connect_timeout: float = 5.0,
    read_timeout: float = 30.0,
    region: str | None = None,
):
    """An S3 client from the standard credential chain. Addressing is path-style when an endpoint is set."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "total_max_attempts": 1},  # RetryPolicy retries, once, visibly
        s3={"addressing_style": "path"} if endpoint else {},
        signature_version="s3v4",
    )
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 5
    base_delay: float = 0.25  # seconds; the n-th retry waits uniform(0, min(max_delay, base * 2**n))
    max_delay: float = 8.0

    def __post_init__(self):
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy: attempts >= 1, delays >= 0")

    def delay(self, retry: int) -> float:
        return random.uniform(0.0, min(self.max_delay, self.base_delay * (2**retry)))


class ShortBody(Exception):
    """The body ended before the announced or expected length: a transport fault, retried."""


def _code(exc: ClientError) -> str:
    err = exc.response.get("Error", {})
    return str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def classify(exc: BaseException, what: str) -> E.ArtifactError | None:
    """None for a transient fault worth retrying; otherwise the final ArtifactError."""
    if isinstance(exc, E.ArtifactError):
        return exc
    if isinstance(exc, ClientError):
        code = _code(exc)
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _TRANSIENT_CODES or status in _TRANSIENT_CODES or status == "429":
            return None
        if code in _NOT_FOUND_CODES or status == "404":
            return E.ArtifactError(E.NOT_FOUND, f"S3 says {code}", what)
        if code in _DENIED_CODES or status == "403":
            return E.ArtifactError(E.ACCESS_DENIED, f"S3 refused the request ({code})", what)
        return E.ArtifactError(E.SOURCE_UNREACHABLE, f"S3 error {code}", what)
    if isinstance(exc, BotoCoreError | ShortBody | ConnectionError | socket.timeout | TimeoutError):
        return None
    if isinstance(exc, S3UploadFailedError):  # boto3's transfer manager wraps the S3 error in text
        denied = next((code for code in _DENIED_CODES if code in str(exc) and not code.isdigit()), None)
        if denied:
            return E.ArtifactError(E.ACCESS_DENIED, f"S3 refused the upload ({denied})", what)
        return None
    if type(exc).__module__.startswith("urllib3"):  # ProtocolError and friends from inside a body read
        return None
    return None if isinstance(exc, OSError) else E.ArtifactError(E.SOURCE_UNREACHABLE, repr(exc), what)


def with_retries(fn: Callable[[], T], *, what: str, retry: RetryPolicy) -> T:
    """Run ``fn`` until it succeeds, a final error occurs, or the attempts are spent."""
    last: BaseException | None = None
    for attempt in range(retry.attempts):
        if attempt:
            time.sleep(retry.delay(attempt - 1))
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classify decides
            final = classify(exc, what)
            if final is not None:
                raise final from None
            last = exc
            log.warning("%s: attempt %d/%d failed: %s", what, attempt + 1, retry.attempts, _describe(exc))
    raise E.ArtifactError(
        E.SOURCE_UNREACHABLE, f"{retry.attempts} attempt(s) failed; last: {_describe(last)}", what
    )


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, ClientError):
        return f"S3 error {_code(exc)}"
    return f"{type(exc).__name__}: {exc}"[:300]


def list_prefix(client, bucket: str, prefix: str, *, retry: RetryPolicy) -> dict[str, int]:
    """{name relative to the prefix: size} of every object under the prefix."""

    def once() -> dict[str, int]:
        found: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                found[obj["Key"][len(prefix) :]] = int(obj["Size"])
        return found

    return with_retries(once, what=f"s3://{bucket}/{prefix}", retry=retry)


def get_small(client, bucket: str, key: str, *, max_bytes: int, retry: RetryPolicy) -> bytes | None:
    """A small object's bytes (a manifest, a signature); None when it does not exist."""

    def once() -> bytes:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            data = body.read(max_bytes + 1)
        finally:
            body.close()
        if len(data) > max_bytes:
            raise E.ArtifactError(E.FILE_TOO_LARGE, f"larger than {max_bytes} bytes", key.rsplit("/", 1)[-1])
        return data

    try:
        return with_retries(once, what=f"s3://{bucket}/{key}", retry=retry)
    except E.ArtifactError as exc:
        if exc.reason == E.NOT_FOUND:
            return None
        raise


def head_size(client, bucket: str, key: str, *, retry: RetryPolicy) -> int | None:
    """An object's size; None when it does not exist. (Without s3:ListBucket, S3 answers a missing key with
    403, which stays AccessDenied.)"""
    try:
        head = with_retries(lambda: client.head_object(Bucket=bucket, Key=key), what=f"s3://{bucket}/{key}",
                            retry=retry)  # fmt: skip
    except E.ArtifactError as exc:
        if exc.reason == E.NOT_FOUND:
            return None
        raise
    return int(head["ContentLength"])


def stream_verified(
    client,
    bucket: str,
    key: str,
    *,
    sha256: str,
    size: int,
    open_sink: Callable[[], BinaryIO],
    retry: RetryPolicy,
    on_bytes: Callable[[int], None] | None = None,
    new_check: Callable[[], object] | None = None,
    name: str | None = None,
) -> None:
    """Stream an object into a fresh sink per attempt, hashing as it goes.

    ``new_check`` makes a content check per attempt (``update(chunk)``, ``finish()`` raising an
    ArtifactError, e.g. tensors.TensorScanner); it judges only a body whose sha256 matched.

    Short or broken bodies are retried; more bytes than ``size`` or a wrong sha256 of a complete body are
    final (FileSizeMismatch / FileHashMismatch): the object is not the one the manifest signed. ``name`` is
    the file's name in the manifest (errors name it; default: the key's last part).
    """
    name = name or key.rsplit("/", 1)[-1]

    def once() -> None:
        digest, got = hashlib.sha256(), 0
        check = new_check() if new_check else None
        response = client.get_object(Bucket=bucket, Key=key)
        body = response["Body"]
        with open_sink() as sink:
            try:
                while chunk := body.read(min(CHUNK, size + 1 - got)):
                    got += len(chunk)
                    if got > size:
                        raise E.ArtifactError(
                            E.FILE_SIZE_MISMATCH, f"object is larger than {size} bytes", name
                        )
                    digest.update(chunk)
                    if check is not None:
                        check.update(chunk)
                    sink.write(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
            finally:
                body.close()
            if got < size:
                raise ShortBody(f"{name}: body ended at {got} of {size} bytes")
            if digest.hexdigest() != sha256:
                raise E.ArtifactError(
                    E.FILE_HASH_MISMATCH, f"sha256 {digest.hexdigest()} != manifest {sha256}", name
                )
            if check is not None:
                check.finish()

    with_retries(once, what=f"s3://{bucket}/{key}", retry=retry)
