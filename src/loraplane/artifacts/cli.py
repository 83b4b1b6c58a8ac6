"""``loraplane adapter``: keygen, pack, sign, push, verify, pull, inspect, yaml.

Exit codes (stable, for scripts):
  0  ok
  1  verification refused the artifact (any reason other than those below)
  2  usage: bad arguments, bad URI, unreadable key
  3  source unreachable: S3 kept failing or refused the credentials (SourceUnreachable, AccessDenied)
  4  not found: no such bucket, prefix or object
  5  local failure: the cache cannot make room, or a local file cannot be written
  6  push refused: another version already lives under that prefix (VersionExists; use --force)
With ``--json`` stdout holds exactly one JSON object: the result, or {"ok": false, "reason", "field", "message"}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3 as S3
from loraplane.artifacts.manifest import MANIFEST_FILE, SIGNATURE_FILE, Manifest, digest_of
from loraplane.artifacts.peft import DEFAULT_MAX_RANK

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NOT_FOUND, EXIT_LOCAL, EXIT_EXISTS = range(7)
_EXIT_BY_REASON = {
    E.SOURCE_UNREACHABLE: EXIT_UNREACHABLE,
    E.ACCESS_DENIED: EXIT_UNREACHABLE,
    E.NOT_FOUND: EXIT_NOT_FOUND,
    E.BAD_URI: EXIT_USAGE,
    E.BAD_KEY: EXIT_USAGE,
    E.CACHE_FULL: EXIT_LOCAL,
    E.VERSION_EXISTS: EXIT_EXISTS,
}


def exit_code(exc: E.ArtifactError) -> int:
    return _EXIT_BY_REASON.get(exc.reason, EXIT_REFUSED)


# --- commands ---------------------------------------------------------------------------------------


def cmd_keygen(args) -> dict:
    from loraplane.artifacts.signing import generate_keypair, key_id

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    private_path, public_path = out / f"{args.name}.key", out / f"{args.name}.pub"
    if not args.force and (private_path.exists() or public_path.exists()):
        raise FileExistsError(f"{private_path} or {public_path} exists (use --force)")
    private_pem, public_pem = generate_keypair()
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    public_path.write_bytes(public_pem)
    return {"key_id": key_id(public_pem), "private_key": str(private_path), "public_key": str(public_path)}


def cmd_pack(args) -> dict:
    from loraplane.artifacts.pack import pack_folder

    manifest = pack_folder(
        args.dir,
        name=args.name,
        version=args.version,
        base_dir=args.base,
        base_hash=args.base_hash,
        max_rank=args.max_rank,
    )
    return {
        "manifest": str(Path(args.dir) / MANIFEST_FILE),
        "digest": manifest.digest(),
        **_summary(manifest),
    }


def cmd_sign(args) -> dict:
    from loraplane.artifacts.pack import sign_folder

    return {
        "signature": str(Path(args.dir) / SIGNATURE_FILE),
        **sign_folder(args.dir, Path(args.key).read_bytes()),
    }


def cmd_push(args) -> dict:
    from loraplane.artifacts.pack import Progress, push_folder

    folder = Path(args.dir)
    manifest = Manifest.from_json((folder / MANIFEST_FILE).read_bytes())
    extra = sum(
        (folder / f).stat().st_size for f in (MANIFEST_FILE, SIGNATURE_FILE) if (folder / f).is_file()
    )
    progress = (
        None if args.json or args.quiet else Progress(manifest.total_bytes + extra, f"push {manifest.name}")
    )
    return push_folder(
        args.dir,
        args.uri,
        s3_client=_client(args),
        force=args.force,
        chunk_bytes=args.chunk_mb << 20,
        progress=progress,
        retry=_retry(args),
    )


def cmd_verify(args) -> dict:
    from loraplane.artifacts.verify import fetch_verified_manifest, verify_folder, verify_remote_files

    policy = _policy(args)
    if args.target.startswith("s3://"):
        client = _client(args)
        verified = fetch_verified_manifest(
            args.target,
            trusted_keys=_trusted(args),
            expected_base_hash=policy.expected_base_hash,
            pinned_digest=policy.pinned_digest,
            max_rank=policy.max_rank,
            s3_client=client,
            retry=_retry(args),
        )
        if not args.manifest_only:
            verify_remote_files(client, verified, policy, _retry(args))
    else:
        verified = verify_folder(Path(args.target), trusted_keys=_trusted(args), policy=policy)
    return {
        "verified": True,
        "digest": verified.digest,
        "key_id": verified.key_id,
        **_summary(verified.manifest),
    }


def cmd_pull(args) -> dict:
    from loraplane.artifacts.cache import HostCache

    cache = HostCache(args.cache, int(args.budget_gb * (1 << 30)), _client(args), retry=_retry(args))
    policy = _policy(args)
    local = cache.pull(
        args.uri,
        trusted_keys=_trusted(args),
        expected_base_hash=policy.expected_base_hash,
        pinned_digest=policy.pinned_digest,
        max_rank=policy.max_rank,
    )
    stats = cache.stats()
    return {
        "path": str(local.path),
        "digest": local.digest,
        "key_id": local.key_id,
        "downloaded_bytes": stats["bytes_downloaded"],
        **_summary(local.manifest),
    }


def cmd_inspect(args) -> dict:
    """Shows a manifest without trusting it: nothing here is verified."""
    manifest_bytes, sig_bytes = _read_target(args)
    manifest = Manifest.from_json(manifest_bytes)
    signer = None
    if sig_bytes is not None:
        from loraplane.artifacts.signing import parse_signature

        signer = parse_signature(sig_bytes)["key_id"]
    return {
        "digest": digest_of(manifest_bytes),
        "signed_by_unverified": signer,
        "manifest": manifest.to_dict(),
    }


def cmd_yaml(args) -> dict:
    manifest_bytes, _ = _read_target(args)
    manifest = Manifest.from_json(manifest_bytes)
    uri = args.target if args.target.startswith("s3://") else args.uri
    if not uri:
        raise E.ArtifactError(E.BAD_URI, "give --uri s3://... when TARGET is a local folder", "source.uri")
    S3.parse_s3_uri(uri)
    return lora_adapter_resource(manifest, digest_of(manifest_bytes), uri, args.base_ref, args.namespace)


def lora_adapter_resource(
    manifest: Manifest, digest: str, uri: str, base_ref: str, namespace: str | None
) -> dict:
    """The LoRAAdapter custom resource that pins this exact adapter version."""
    metadata = {"name": manifest.name, **({"namespace": namespace} if namespace else {})}
    metadata["labels"] = {"loraplane.dev/version": manifest.version}
    return {
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": metadata,
        "spec": {
            "baseRef": {"name": base_ref},
            "version": manifest.version,
            "source": {"uri": uri if uri.endswith("/") else uri + "/", "manifestDigest": digest},
        },
    }


# --- helpers ----------------------------------------------------------------------------------------


def _summary(manifest: Manifest) -> dict:
    return {
        "name": manifest.name,
        "version": manifest.version,
        "base_model_hash": manifest.base_model_hash,
        "max_rank": manifest.max_rank,
        "target_modules": list(manifest.target_modules),
        "bytes": manifest.total_bytes,
    }


def _client(args):
    return S3.make_client(args.endpoint_url)


def _retry(args) -> S3.RetryPolicy:
    return S3.RetryPolicy(attempts=args.attempts)


def _trusted(args) -> dict[str, bytes]:
    from loraplane.artifacts.signing import load_trusted_keys

    path = Path(args.trusted_keys)
    if path.is_file():  # a single .pub file
        return load_trusted_keys({path.name: path.read_bytes()})
    return load_trusted_keys(path)


def _policy(args):
    from loraplane.artifacts.base_hash import compute_base_hash
    from loraplane.artifacts.verify import Policy

    base_hash = args.base_hash or (compute_base_hash(args.base) if args.base else None)
    return Policy(expected_base_hash=base_hash, pinned_digest=args.digest, max_rank=args.max_rank)


def _read_target(args) -> tuple[bytes, bytes | None]:
    if args.target.startswith("s3://"):
        bucket, prefix = S3.parse_s3_uri(args.target)
        client, retry = _client(args), _retry(args)
        manifest = S3.get_small(client, bucket, prefix + MANIFEST_FILE, max_bytes=1 << 20, retry=retry)
        if manifest is None:
            raise E.ArtifactError(E.NOT_FOUND, f"no manifest under {args.target}", "source.uri")
        return manifest, S3.get_small(client, bucket, prefix + SIGNATURE_FILE, max_bytes=4096, retry=retry)
    folder = Path(args.target)
    if not (folder / MANIFEST_FILE).is_file():
        raise E.ArtifactError(E.MISSING_FILE, f"no manifest in {folder}", MANIFEST_FILE)
    sig = folder / SIGNATURE_FILE
    return (folder / MANIFEST_FILE).read_bytes(), sig.read_bytes() if sig.is_file() else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplane adapter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    common.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL_S3, then AWS)")
    common.add_argument(
        "--attempts", type=int, default=5, help="S3 attempts per request (backoff with jitter)"
    )
    checks = argparse.ArgumentParser(add_help=False)
    checks.add_argument("--trusted-keys", required=True, help="a .pub file or a folder of PEM public keys")
    base = checks.add_mutually_exclusive_group()
    base.add_argument("--base", help="base model folder: its base hash must match the manifest")
    base.add_argument("--base-hash", help="expected base hash (64 hex)")
    checks.add_argument("--digest", help="pinned manifest digest sha256:<hex>")
    checks.add_argument("--max-rank", type=int, help="refuse ranks above this")

    s = sub.add_parser("keygen", parents=[common], help="make an ed25519 signing key pair")
    s.add_argument("--out", default=".", help="folder for NAME.key (0600) and NAME.pub")
    s.add_argument("--name", default="loraplane-signing")
    s.add_argument("--force", action="store_true")
    s = sub.add_parser("pack", parents=[common], help="check a PEFT LoRA folder and write its manifest")
    s.add_argument("dir")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--base", help="base model folder (config.json + safetensors): shapes are checked")
    g.add_argument("--base-hash", help="base hash (64 hex) when the base folder is not at hand")
    s.add_argument("--name", required=True)
    s.add_argument("--version", required=True)
    s.add_argument("--max-rank", type=int, default=DEFAULT_MAX_RANK)
    s = sub.add_parser("sign", parents=[common], help="sign a packed folder's manifest")
    s.add_argument("dir")
    s.add_argument("--key", required=True, help="ed25519 private key PEM (from keygen)")
    s = sub.add_parser("push", parents=[common], help="upload a signed folder to s3://bucket/name/version/ "
                       "(each file once per bucket, under _loraplane/blobs/sha256/)")  # fmt: skip
    s.add_argument("dir")
    s.add_argument("uri")
    s.add_argument("--force", action="store_true",
                   help="replace another version stored under the prefix, and upload every blob again")  # fmt: skip
    s.add_argument("--chunk-mb", type=int, default=8, help="multipart threshold and part size")
    s = sub.add_parser("verify", parents=[common, checks], help="verify an S3 prefix or a local folder")
    s.add_argument("target", help="s3://bucket/name/version/ or a folder")
    s.add_argument("--manifest-only", action="store_true", help="S3: do not stream-hash the files")
    s = sub.add_parser("pull", parents=[common, checks], help="pull into a verified host cache")
    s.add_argument("uri")
    s.add_argument("--cache", required=True, help="host cache folder")
    s.add_argument("--budget-gb", type=float, default=10.0)
    s = sub.add_parser("inspect", parents=[common], help="show a manifest (unverified)")
    s.add_argument("target", help="s3://bucket/name/version/ or a folder")
    s = sub.add_parser("yaml", parents=[common], help="print the LoRAAdapter resource for a GitOps repo")
    s.add_argument("target", help="s3://bucket/name/version/ or a packed folder")
    s.add_argument("--base-ref", required=True, help="name of the LoRABase resource")
    s.add_argument("--uri", help="the S3 URI, when TARGET is a local folder")
    s.add_argument("--namespace")
    return p


COMMANDS = {
    "keygen": cmd_keygen,
    "pack": cmd_pack,
    "sign": cmd_sign,
    "push": cmd_push,
    "verify": cmd_verify,
    "pull": cmd_pull,
    "inspect": cmd_inspect,
    "yaml": cmd_yaml,
}


def _print_result(args, result: dict) -> None:
    if args.json:
        print(json.dumps({"ok": True, **result}, sort_keys=True))
    elif args.command == "yaml":
        import yaml

        print(yaml.safe_dump(result, sort_keys=False), end="")
    elif args.command == "inspect":
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {', '.join(map(str, value)) if isinstance(value, list) else value}")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
    logging.basicConfig(level=logging.WARNING, format=f"loraplane adapter {args.command}: %(message)s")
    try:
        result = COMMANDS[args.command](args)
    except E.ArtifactError as exc:
        return _fail(args, exit_code(exc), exc.to_dict())
    except ValueError as exc:
        return _fail(args, EXIT_USAGE, {"reason": "Usage", "field": None, "message": str(exc)})
    except OSError as exc:
        return _fail(args, EXIT_LOCAL, {"reason": "LocalError", "field": None, "message": str(exc)})
    _print_result(args, result)
    return EXIT_OK


def _fail(args, code: int, error: dict) -> int:
    if args.json:
        print(json.dumps({"ok": False, **error}, sort_keys=True))
    else:
        where = f" ({error['field']})" if error.get("field") else ""
        print(
            f"loraplane adapter {args.command}: {error['reason']}{where}: {error['message']}", file=sys.stderr
        )
    return code
