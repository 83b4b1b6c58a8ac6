"""What a LoRABase may ask of the operator: the operator's own settings, never the custom resource's.

Whoever may write a LoRABase must not borrow the operator's reach: its credentials (sent to an S3
endpoint), its right to read Secrets (mounted into pods or used to sign S3 requests), the nodes' file
systems (hostPath), the image pods run and where and as whom they run. Five rules, each a setting of ``loraplane operator run`` that
the Helm chart exposes (``operator.policy``):

- S3 endpoints: ``spec.storage.endpoint`` must be one of ``--allowed-s3-endpoint``; with none set, only
  AWS's own endpoints (``https://s3[.<region>].amazonaws.com``) or no endpoint at all;
- Secrets: every Secret a LoRABase names must carry the label ``loraplane.dev/use: "true"``, so a
  Secret meant for something else is never sent anywhere;
- hostPath caches: only at or under ``--host-path-prefix`` (normalized; never ``/`` in any spelling); without
  it, none;
- images: only from ``--allowed-registry`` prefixes, or exactly ``--server-image`` when the operator
  pins one (then a LoRABase may leave ``spec.image`` empty, at the CRD default, or name that image);
- placement (tolerations, nodeSelector, affinity, priorityClassName, serviceAccountName, runtimeClassName):
  only what the ``--allowed-*`` lists name (placement_policy.py); without them, none.

A LoRABase that breaks a rule gets a condition whose reason names the rule, and no object is created
or changed for it; adapters on it are not validated, since that would use its endpoint and Secret.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from loraplane.operator import placement_policy
from loraplane.operator.placement_policy import PLACEMENT_NOT_ALLOWED

SECRET_LABEL = "loraplane.dev/use"
DEFAULT_REGISTRIES = ("ghcr.io/loraplane",)

# Condition reasons, one per rule.
ENDPOINT_NOT_ALLOWED = "EndpointNotAllowed"
SECRET_NOT_LABELED = "SecretNotLabeled"
HOST_PATH_NOT_ALLOWED = "HostPathNotAllowed"
IMAGE_NOT_ALLOWED = "ImageNotAllowed"
RULES = frozenset(
    {
        ENDPOINT_NOT_ALLOWED,
        SECRET_NOT_LABELED,
        HOST_PATH_NOT_ALLOWED,
        IMAGE_NOT_ALLOWED,
        PLACEMENT_NOT_ALLOWED,
    }
)

_AWS_ENDPOINT = re.compile(r"^https://s3(-fips)?(\.dualstack)?(\.[a-z0-9-]+)?\.amazonaws\.com(\.cn)?$")
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._:/@+-]{0,254}$", re.IGNORECASE)


class PolicyViolation(Exception):
    """A LoRABase field asks for something the operator's settings do not allow."""

    def __init__(self, reason: str, field_: str, message: str):
        super().__init__(f"{field_}: {message}")
        self.reason, self.field, self.message = reason, field_, message


def normalize_endpoint(url: str) -> str:
    """``scheme://host[:port]`` in lower case, default ports dropped; ValueError for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"{url!r} must be scheme://host[:port] only (no user, path, query or fragment)")
    port = parts.port  # raises ValueError for a bad port
    default = {"http": 80, "https": 443}[parts.scheme]
    return f"{parts.scheme}://{parts.hostname}" + (f":{port}" if port and port != default else "")


def normalize_path(path: str) -> str:
    """One spelling per absolute path: ``//``, ``/./`` and ``/a/..`` are all ``/`` (POSIX's normpath keeps a
    leading ``//``, which names the root on Linux too)."""
    return "/" + posixpath.normpath(path).lstrip("/")


def normalize_image(image: str) -> str:
    """A full reference: ``nginx`` -> ``docker.io/library/nginx``, registry host in lower case."""
    first, _, rest = image.partition("/")
    if not rest:
        return f"docker.io/library/{image}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{image}"
    return f"{first.lower()}/{rest}"


def _registry_prefix(entry: str) -> str:
    """``registry.internal:5000`` (a host alone) or ``ghcr.io/loraplane`` (a host and a path), normalized."""
    entry = entry.strip().rstrip("/")
    return entry.lower() if "/" not in entry else normalize_image(entry)


@dataclass(frozen=True, slots=True)
class OperatorPolicy:
    allowed_s3_endpoints: tuple[str, ...] = ()  # empty: AWS's endpoints only
    host_path_prefix: str | None = None  # None: hostPath caches are refused
    allowed_registries: tuple[str, ...] = DEFAULT_REGISTRIES  # image prefixes, e.g. ghcr.io/loraplane
    server_image: str | None = None  # pinned: every server pod runs exactly this image
    # Placement allow-lists (placement_policy.py); empty: a LoRABase may not set the field.
    allowed_tolerations: tuple[str, ...] = ()  # toleration keys
    allowed_node_labels: tuple[str, ...] = ()  # node label keys for nodeSelector and node affinity
    allowed_priority_classes: tuple[str, ...] = ()
    allowed_service_accounts: tuple[str, ...] = ()
    allowed_runtime_classes: tuple[str, ...] = ()

    def __post_init__(self):
        try:
            endpoints = tuple(normalize_endpoint(u) for u in self.allowed_s3_endpoints)
        except ValueError as exc:
            raise ValueError(f"--allowed-s3-endpoint: {exc}") from None
        object.__setattr__(self, "allowed_s3_endpoints", endpoints)
        prefix = (self.host_path_prefix or "").strip() or None
        if prefix is not None:
            if not prefix.startswith("/") or normalize_path(prefix) == "/":
                raise ValueError(f"--host-path-prefix {prefix!r} must be an absolute path other than / "
                                 "(in any spelling: //, /./, /a/..)")  # fmt: skip
            prefix = normalize_path(prefix)
        object.__setattr__(self, "host_path_prefix", prefix)
        registries = tuple(_registry_prefix(r) for r in self.allowed_registries if r.strip())
        if any(not _IMAGE.match(r) for r in registries):
            raise ValueError(f"--allowed-registry: {self.allowed_registries!r} holds a malformed prefix")
        object.__setattr__(self, "allowed_registries", registries)
        if self.server_image is not None and not _IMAGE.match(self.server_image):
            raise ValueError(f"--server-image {self.server_image!r} is not an image reference")
        for kind in placement_policy.FLAGS:
            name = f"allowed_{kind}"
            object.__setattr__(self, name, placement_policy.checked_entries(kind, getattr(self, name)))

    # --- the rules ----------------------------------------------------------------------------------
    def check_endpoint(self, endpoint: str | None) -> None:
        if not endpoint:
            return  # boto3's default: AWS
        field_ = "spec.storage.endpoint"
        try:
            normalized = normalize_endpoint(endpoint)
        except ValueError as exc:
            raise PolicyViolation(ENDPOINT_NOT_ALLOWED, field_, str(exc)) from None
        if self.allowed_s3_endpoints:
            if normalized not in self.allowed_s3_endpoints:
                raise PolicyViolation(
                    ENDPOINT_NOT_ALLOWED,
                    field_,
                    f"{normalized} is not among the operator's allowed S3 endpoints "
                    f"{list(self.allowed_s3_endpoints)} (operator.policy.allowedS3Endpoints)",
                )
        elif not _AWS_ENDPOINT.match(normalized):
            raise PolicyViolation(
                ENDPOINT_NOT_ALLOWED,
                field_,
                f"{normalized} is not an AWS endpoint, and the operator allows no other "
                "(operator.policy.allowedS3Endpoints is empty)",
            )

    def check_host_path(self, cache_type: str, path: str | None) -> None:
        if cache_type != "hostPath":
            return
        field_ = "spec.hostCache.path"
        if self.host_path_prefix is None:
            raise PolicyViolation(
                HOST_PATH_NOT_ALLOWED,
                field_,
                "hostPath caches are off (operator.policy.hostPathPrefix is empty)",
            )
        if not path or not path.startswith("/") or normalize_path(path) != path or path == "/":
            raise PolicyViolation(
                HOST_PATH_NOT_ALLOWED, field_, f"{path!r} is not a normalized absolute path"
            )
        if path != self.host_path_prefix and not path.startswith(self.host_path_prefix + "/"):
            raise PolicyViolation(
                HOST_PATH_NOT_ALLOWED,
                field_,
                f"{path!r} is outside {self.host_path_prefix!r} (operator.policy.hostPathPrefix)",
            )

    def server_image_for(self, requested: str | None, default: str) -> str:
        """The image the pods run: the pinned one, or the requested (or default) one if allowed.

        ``default`` is the CRD's default image: the API server writes it into a spec that names none, so
        a pinned operator treats it as "unset"."""
        field_ = "spec.image"
        if self.server_image is not None:
            if requested and requested not in (self.server_image, default):
                raise PolicyViolation(
                    IMAGE_NOT_ALLOWED,
                    field_,
                    f"{requested!r}: the operator pins the server image to {self.server_image!r}",
                )
            return self.server_image
        image = requested or default
        full = normalize_image(image) if _IMAGE.match(image) and ".." not in image else None
        if full is None or not any(full.startswith(r + "/") for r in self.allowed_registries):
            raise PolicyViolation(
                IMAGE_NOT_ALLOWED,
                field_,
                f"{image!r} is not from an allowed registry {list(self.allowed_registries)} "
                "(operator.policy.allowedRegistries)",
            )
        return image

    def check_placement(self, raw_spec: dict) -> None:
        """Every placement field of a raw LoRABase spec within the allow-lists; the first breach raises."""
        allow = {kind: getattr(self, f"allowed_{kind}") for kind in placement_policy.FLAGS}
        for field_, message in placement_policy.violations(raw_spec, allow):
            raise PolicyViolation(PLACEMENT_NOT_ALLOWED, field_, message)

    @staticmethod
    def check_secret_labels(field_: str, name: str, labels: dict | None) -> None:
        if (labels or {}).get(SECRET_LABEL) != "true":
            raise PolicyViolation(
                SECRET_NOT_LABELED,
                field_,
                f'Secret {name!r} lacks the label {SECRET_LABEL}: "true"; the operator uses only Secrets '
                "labeled for it",
            )


def referenced_secrets(spec) -> list[tuple[str, str]]:
    """(field, Secret name) of every Secret a parsed LoRABase spec names."""
    refs = [
        ("spec.storage.credentialsSecretRef.name", spec.storage.credentials),
        ("spec.trust.publicKeysSecretRef.name", spec.trusted_keys_secret),
        ("spec.auth.apiKeysSecretRef.name", spec.api_keys_secret),
        ("spec.adminTokenSecretRef.name", spec.admin_token.name if spec.admin_token else None),
    ]
    return [(field_, name) for field_, name in refs if name]
