"""Content-addressed artifact files in S3: each distinct file is stored once per bucket, as registries store
layers.

Layout of a bucket::

    _loraplane/blobs/sha256/<hex>     a file's bytes, named by their sha256 (shared by every artifact listing it)
    <name>/<version>/                 an artifact: loraplane-manifest.json and loraplane-manifest.sig only

The signed manifest lists each file with its sha256 and size, so the manifest alone says where the bytes
are, and a reader checks them against it (size at HEAD, sha256 while streaming). The blob root starts with
'_', which no artifact prefix may (``parse_s3_uri``), so blobs and artifacts never collide. A digest must be
64 lowercase hex digits before it becomes a key: a manifest cannot steer a read outside the blob root.

Artifacts pushed before this layout keep their files under their own prefix; a file listed there is read
from there (``locate_files``), so both layouts pull alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3 as S3
from loraplane.artifacts.manifest import Manifest

BLOB_ROOT = "_loraplane/blobs/sha256/"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def blob_key(sha256: str, field_: str = "sha256") -> str:
    """The key of the blob holding the content with this sha256; anything but 64 lowercase hex is refused."""
    if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):
        raise E.ArtifactError(
            E.BAD_MANIFEST, f"{sha256!r} is not a sha256 of 64 lowercase hex digits", field_
        )
    return BLOB_ROOT + sha256


@dataclass(frozen=True, slots=True)
class Located:
    key: str  # the object holding the file's bytes
    size: int  # its size as S3 reports it
    blob: bool  # content-addressed (True) or under the artifact's own prefix (False)


def locate_files(
    client, bucket: str, prefix: str, manifest: Manifest, listed: Mapping[str, int], *, retry: S3.RetryPolicy
) -> dict[str, Located]:
    """Where each of the manifest's files is: under the prefix when the listing has it (an artifact pushed
    before blobs), else its blob (one HEAD). A file in neither place is MissingFile, naming the file."""
    found = {}
    for name, entry in manifest.files.items():
        if name in listed:
            found[name] = Located(prefix + name, listed[name], False)
            continue
        key = blob_key(entry.sha256, f"manifest.files.{name}.sha256")
        size = S3.head_size(client, bucket, key, retry=retry)
        if size is None:
            raise E.ArtifactError(E.MISSING_FILE, f"neither under s3://{bucket}/{prefix} nor at s3://{bucket}/{key}",
                                  name)  # fmt: skip
        found[name] = Located(key, size, True)
    return found


def push_blobs(
    client,
    bucket: str,
    folder: Path,
    manifest: Manifest,
    *,
    upload: Callable[[Path, str], None],
    force: bool,
    retry: S3.RetryPolicy,
    progress: Callable[[int], None] | None = None,
) -> dict[str, int]:
    """Upload each file that its blob does not hold yet (HEAD: absent, or of another size); ``force``
    uploads every one again (a blob of the right size but wrong bytes is caught only by a pull's hash).
    Returns the bytes uploaded and skipped."""
    sent = skipped = 0
    for name, entry in manifest.files.items():
        key = blob_key(entry.sha256, f"manifest.files.{name}.sha256")
        if not force and S3.head_size(client, bucket, key, retry=retry) == entry.size:
            skipped += entry.size
            if progress:
                progress(entry.size)
            continue
        upload(folder / name, key)
        sent += entry.size
    return {"uploaded_bytes": sent, "deduplicated_bytes": skipped}
