"""Step 1 of an adapter: read its manifest from S3 with the operator's credentials and verify it.

Signature against the base's trusted keys, manifest base hash against ``LoRABase.spec.model.sha256``,
rank against ``spec.engine.maxRank``, targets against what the engine serves, optional pinned digest.
Nothing unverified reaches a pod. The S3 client is built per base from its Secret, read by name.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

import boto3
from botocore.config import Config

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3 as S3
from loraplane.artifacts.signing import load_trusted_keys
from loraplane.artifacts.verify import VerifiedManifest, fetch_verified_manifest
from loraplane.operator import conditions as C
from loraplane.operator.context import Context
from loraplane.operator.crd_models import DEFAULT_IMAGE, AdapterSpec, BaseSpec
from loraplane.operator.policy import PolicyViolation, referenced_secrets


class ValidationFailed(Exception):
    def __init__(self, reason: str, message: str, transient: bool = False):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.transient = reason, message, transient


async def labeled_secret(ctx: Context, namespace: str, name: str, field_: str) -> dict[str, str]:
    """A Secret a LoRABase names, used only when labeled for the operator (policy.py)."""
    secret = await ctx.kube.secret(namespace, name)
    if secret is None:
        raise ValidationFailed(C.SECRET_NOT_FOUND, f"{field_}: Secret {name!r} not found", transient=True)
    labels, data = secret
    try:
        ctx.policy.check_secret_labels(field_, name, labels)
    except PolicyViolation as exc:
        raise ValidationFailed(exc.reason, str(exc)) from None
    return data


async def s3_client(ctx: Context, namespace: str, spec: BaseSpec):
    storage = spec.storage
    try:  # before any Secret is read: its credentials go nowhere the operator does not allow
        ctx.policy.check_endpoint(storage.endpoint)
    except PolicyViolation as exc:
        raise ValidationFailed(exc.reason, str(exc)) from None
    kwargs = {}
    if storage.credentials:
        data = await labeled_secret(
            ctx, namespace, storage.credentials, "spec.storage.credentialsSecretRef.name"
        )
        try:
            kwargs = {
                "aws_access_key_id": data[storage.access_key_id_key],
                "aws_secret_access_key": data[storage.secret_access_key_key],
            }
        except KeyError as exc:
            raise ValidationFailed(
                C.SECRET_NOT_FOUND,
                f"Secret {storage.credentials!r} has no key {exc.args[0]!r}",
                transient=True,
            ) from None
    config = Config(
        connect_timeout=5,
        read_timeout=20,
        retries={"mode": "standard", "total_max_attempts": 1},
        s3={"addressing_style": "path"} if storage.endpoint else {},
        signature_version="s3v4",
    )
    # Building a boto3 client costs tens of milliseconds: keep one per endpoint and credentials.
    key = (
        storage.endpoint,
        storage.region,
        hashlib.sha256(repr(sorted(kwargs.items())).encode()).hexdigest(),
    )
    region = storage.region or "us-east-1"
    return ctx.s3_clients.get(
        key,
        lambda: boto3.session.Session(**kwargs).client(
            "s3", endpoint_url=storage.endpoint, region_name=region, config=config
        ),
    )


async def check_base_policy(ctx: Context, namespace: str, base: dict, spec: BaseSpec) -> str:
    """Every operator rule a LoRABase must keep (policy.py); the server image its pods run."""
    policy = ctx.policy
    try:
        policy.check_endpoint(spec.storage.endpoint)
        policy.check_host_path(spec.host_cache_type, spec.host_cache_path)
        image = policy.server_image_for((base.get("spec") or {}).get("image"), DEFAULT_IMAGE)
        policy.check_placement(base.get("spec") or {})
    except PolicyViolation as exc:
        raise ValidationFailed(exc.reason, str(exc)) from None
    for field_, name in referenced_secrets(spec):
        await labeled_secret(ctx, namespace, name, field_)
    return image


async def trusted_keys(ctx: Context, namespace: str, spec: BaseSpec) -> dict[str, bytes]:
    if not spec.trusted_keys_secret:
        raise ValidationFailed(C.UNKNOWN_KEY, "the LoRABase trusts no key (spec.trust.publicKeysSecretRef)")
    data = await labeled_secret(
        ctx, namespace, spec.trusted_keys_secret, "spec.trust.publicKeysSecretRef.name"
    )
    try:
        return load_trusted_keys(data)
    except E.ArtifactError as exc:
        raise ValidationFailed(exc.reason, exc.message) from None


@dataclass(frozen=True, slots=True)
class Source:
    """Where a version lives, and the digest it must have (what validate() reads of an AdapterSpec)."""

    uri: str
    manifest_digest: str | None


def check_identity(name: str, version: str, verified: VerifiedManifest) -> None:
    """The signed manifest is the adapter this object names: its name and its version."""
    manifest = verified.manifest
    for field_, want, signed in (
        ("metadata.name", name, manifest.name),
        ("spec.version", version, manifest.version),
    ):
        if want != signed:
            raise ValidationFailed(
                C.IDENTITY_MISMATCH, f"{field_} is {want!r}, the signed manifest says {signed!r}"
            )


async def check_not_older(
    ctx: Context, namespace: str, base: BaseSpec, spec: AdapterSpec, status: dict, verified: VerifiedManifest
) -> None:
    """Rollback protection: without a pinned digest, a version signed before the one it replaces is
    refused. Anyone who can write to the bucket can copy an old signed version to a new prefix; only a
    spec that pins the digest (``spec.source.manifestDigest``) may go back on purpose."""
    serving, source = status.get("digest"), status.get("servingSource")
    if spec.manifest_digest is not None or not serving or not source or serving == verified.digest:
        return
    try:
        previous = await validate(ctx, namespace, base, Source(source, serving))
    except ValidationFailed as exc:
        raise ValidationFailed(
            C.ROLLBACK_REFUSED,
            f"cannot read the serving version at {source} to compare creation times ({exc.reason}); "
            "pin spec.source.manifestDigest to replace it anyway",
            transient=exc.transient,
        ) from None
    if verified.manifest.created < previous.manifest.created:
        raise ValidationFailed(
            C.ROLLBACK_REFUSED,
            f"{spec.version} was signed at {verified.manifest.created}, before the serving "
            f"{previous.manifest.version} ({previous.manifest.created}); pin spec.source.manifestDigest "
            "to roll back on purpose",
        )


async def validate(
    ctx: Context, namespace: str, base: BaseSpec, adapter: AdapterSpec | Source
) -> VerifiedManifest:
    """The verified manifest, or ValidationFailed with a documented reason."""
    keys = await trusted_keys(ctx, namespace, base)
    fingerprint = hashlib.sha256(b"".join(sorted(keys.values()))).hexdigest()
    source = (base.storage.endpoint, base.storage.region, base.storage.credentials)
    key = (adapter.uri, adapter.manifest_digest, base.model_sha256, base.engine.max_rank, fingerprint, source)
    # one S3 read per source, however many adapters ask at once
    return await ctx.validations.get(key, lambda: _fetch(ctx, namespace, base, adapter, keys))


async def _fetch(
    ctx: Context, namespace: str, base: BaseSpec, adapter: AdapterSpec, keys
) -> VerifiedManifest:
    client = await s3_client(ctx, namespace, base)
    retry = S3.RetryPolicy(attempts=ctx.tunables.s3_attempts, base_delay=0.2, max_delay=2.0)
    try:
        return await asyncio.to_thread(
            fetch_verified_manifest,
            adapter.uri,
            trusted_keys=keys,
            expected_base_hash=base.model_sha256,
            pinned_digest=adapter.manifest_digest,
            max_rank=base.engine.max_rank,
            s3_client=client,
            retry=retry,
        )
    except E.ArtifactError as exc:
        if exc.reason == E.ACCESS_DENIED and base.storage.credentials:  # rotated keys: read them again
            ctx.kube.forget_secret(namespace, base.storage.credentials)
        raise ValidationFailed(exc.reason, f"{exc.field + ': ' if exc.field else ''}{exc.message}",
                               transient=exc.transient) from None  # fmt: skip
    except Exception as exc:  # botocore's endpoint errors and the like: the source, not the artifact
        raise ValidationFailed(
            C.SOURCE_UNREACHABLE, f"{type(exc).__name__}: {exc}"[:300], transient=True
        ) from None
