"""Pure builders: a LoRABase in, the Kubernetes objects it owns out (plain dicts, no API calls).

Objects: the Deployment of server pods, a Service for the OpenAI port, a separate ``<base>-admin``
Service for the admin port (so exposure and network policy can differ; the operator itself calls
each pod's IP), and the admin-token Secret when the LoRABase references none. Every object carries
an ownerReference to the LoRABase, so deleting it cascades. Secrets reach the pods only by
reference: env ``secretKeyRef`` for S3 credentials, Secret volumes for keys and tokens.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets as _secrets

from loraplane.operator.crd_models import API_VERSION, BaseSpec
from loraplane.operator.pods import ADAPTERS_GATE
from loraplane.operator.policy import SECRET_LABEL

OPENAI_PORT = 8000
ADMIN_PORT = 8001
CONTAINER = "server"
CACHE_DIR = "/var/cache/loraplane"
USAGE_LOG_KEEP = 16  # rotated usage log files a pod keeps (64 MiB each) inside the host cache volume
TRUSTED_KEYS_DIR = "/etc/loraplane/trusted-keys"
API_KEYS_DIR = "/etc/loraplane/api-keys"
ADMIN_TOKEN_DIR = "/etc/loraplane/admin"
TEMPLATE_HASH = "loraplane.dev/pod-template-hash"
BASE_LABEL = "loraplane.dev/base"
COMPONENT = "server"


def labels(base_name: str) -> dict:
    return {
        "app.kubernetes.io/name": "loraplane",
        "app.kubernetes.io/instance": base_name,
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/managed-by": "loraplane-operator",
        BASE_LABEL: base_name,
    }


def selector(base_name: str) -> dict:
    """The pods of one base (immutable in a Deployment: never add to it)."""
    return {BASE_LABEL: base_name, "app.kubernetes.io/component": COMPONENT}


def selector_string(base_name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(base_name).items())


def owner_reference(base: dict) -> dict:
    meta = base["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRABase",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(base: dict, name: str) -> dict:
    return {
        "name": name,
        "namespace": base["metadata"]["namespace"],
        "labels": labels(base["metadata"]["name"]),
        "ownerReferences": [owner_reference(base)],
    }


def admin_token_secret_name(base: dict, spec: BaseSpec) -> str:
    return spec.admin_token.name if spec.admin_token else f"{base['metadata']['name']}-admin-token"


def admin_token_key(spec: BaseSpec) -> str:
    return spec.admin_token.key if spec.admin_token else "token"


def build_admin_token_secret(base: dict, token: str | None = None) -> dict:
    """The generated admin token, owned by the LoRABase. ``token`` is for tests; None draws 32 random bytes."""
    value = token or _secrets.token_urlsafe(32)
    metadata = _metadata(base, f"{base['metadata']['name']}-admin-token")
    metadata["labels"][SECRET_LABEL] = "true"  # the operator's own, for the operator
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata,
        "data": {"token": base64.b64encode(value.encode()).decode()},
    }


def server_args(spec: BaseSpec, admin_token_key_: str, api_keys: bool, routing: bool = False) -> list[str]:
    """The command line of ``loraplane serve`` (the contract with the server, docs/operator.md). ``routing``:
    the public port also serves the metrics the endpoint picker scrapes (docs/routing.md)."""
    eng = spec.engine
    args = [
        "serve",
        f"--model={spec.model_uri}",
        f"--model-sha256={spec.model_sha256}",
        "--host=0.0.0.0",
        f"--port={OPENAI_PORT}",
        f"--admin-port={ADMIN_PORT}",
        f"--admin-token-file={ADMIN_TOKEN_DIR}/{admin_token_key_}",
        f"--host-cache-dir={CACHE_DIR}",
        # One folder per pod: a hostPath cache is shared by the pods of a node. $(POD_NAME): the env below.
        f"--usage-log-dir={CACHE_DIR}/usage/$(POD_NAME)",
        f"--usage-log-keep={USAGE_LOG_KEEP}",
        f"--max-rank={eng.max_rank}",
        f"--gpu-adapter-bytes={eng.gpu_adapter_bytes}",
        f"--host-adapter-bytes={eng.host_adapter_bytes}",
        f"--kv-cache-fraction={eng.kv_cache_fraction}",
        f"--max-num-seqs={eng.max_num_seqs}",
        f"--dtype={eng.dtype}",
    ]
    if eng.memory_mode is not None:
        args.append(f"--memory-mode={eng.memory_mode}")
    if spec.tensor_parallel_size > 1:
        args.append(f"--tensor-parallel-size={spec.tensor_parallel_size}")
    if spec.trusted_keys_secret:
        args.append(f"--trusted-keys-dir={TRUSTED_KEYS_DIR}")
    if api_keys:
        args.append(f"--api-keys-file={API_KEYS_DIR}/api-keys.yaml")
    if routing:
        args.append("--routing-metrics")
    return args


def _env(spec: BaseSpec) -> list[dict]:
    env = [
        {"name": "HOME", "value": "/tmp"},
        # Compiled kernels live beside the host cache: with a hostPath cache a replaced pod on the same node
        # starts without recompiling (a bare start compiles every LoRA launch shape: minutes on a GPU).
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "LORAPLANE_CACHE", "value": CACHE_DIR},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    if spec.storage.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": spec.storage.endpoint})
    if spec.storage.region:
        env.append({"name": "AWS_REGION", "value": spec.storage.region})
    if spec.storage.credentials:
        for var, key in (
            ("AWS_ACCESS_KEY_ID", spec.storage.access_key_id_key),
            ("AWS_SECRET_ACCESS_KEY", spec.storage.secret_access_key_key),
        ):
            ref = {"name": spec.storage.credentials, "key": key}
            env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
    return env


def _volumes(base: dict, spec: BaseSpec) -> tuple[list[dict], list[dict]]:
    if spec.host_cache_type == "hostPath":
        cache = {
            "name": "host-cache",
            "hostPath": {"path": spec.host_cache_path, "type": "DirectoryOrCreate"},
        }
    else:
        cache = {"name": "host-cache", "emptyDir": {"sizeLimit": spec.host_cache_size}}
    token = {"secretName": admin_token_secret_name(base, spec), "defaultMode": 0o400}
    volumes = [cache, {"name": "admin-token", "secret": token}]
    # The root filesystem is read-only: scratch files go to /tmp.
    volumes.append({"name": "tmp", "emptyDir": {}})
    mounts = [
        {"name": "host-cache", "mountPath": CACHE_DIR},
        {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.tensor_parallel_size > 1:
        # NCCL's intra-node transport lives in /dev/shm; the runtime's 64 MB default is too small for it.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    for name, secret, path in (
        ("trusted-keys", spec.trusted_keys_secret, TRUSTED_KEYS_DIR),
        ("api-keys", spec.api_keys_secret, API_KEYS_DIR),
    ):
        if secret:
            volumes.append({"name": name, "secret": {"secretName": secret, "defaultMode": 0o400}})
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
    return volumes, mounts


def _resources(spec: BaseSpec) -> dict:
    limits = {}
    if spec.gpus:
        limits[spec.gpu_resource] = str(spec.gpus)
    if spec.cpu:
        limits["cpu"] = spec.cpu
    if spec.memory:
        limits["memory"] = spec.memory
    return {"requests": dict(limits), "limits": limits}


def _probe(path: str, period: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 3,
    }


def build_pod_template(base: dict, spec: BaseSpec, image: str | None = None, routing: bool = False) -> dict:
    """``image``: the one the operator's policy chose (a pinned image), else ``spec.image``."""
    volumes, mounts = _volumes(base, spec)
    container = {
        "name": CONTAINER,
        "image": image or spec.image,
        "args": server_args(
            spec, admin_token_key(spec), api_keys=bool(spec.api_keys_secret), routing=routing
        ),
        "ports": [
            {"name": "http", "containerPort": OPENAI_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "readinessProbe": _probe("/health/ready", 5, 3),
        "livenessProbe": _probe("/health/live", 10, 6),
        # Loading a large base takes minutes; liveness must not kill a pod that is still loading.
        "startupProbe": _probe("/health/live", 10, 90),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec = {
        # The server image's user (docker/server.Dockerfile); fsGroup makes the cache volume writable.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
        "automountServiceAccountToken": False,  # the server never calls the Kubernetes API
        # Ready (a Service's endpoint) only once the operator has loaded its adapters (readiness_gate.py).
        "readinessGates": [{"conditionType": ADAPTERS_GATE}],
        "terminationGracePeriodSeconds": 60,
    }
    for key, value in (("nodeSelector", spec.node_selector), ("tolerations", spec.tolerations)):
        if value:
            pod_spec[key] = value
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    for key, value in (("priorityClassName", spec.priority_class_name),
                       ("serviceAccountName", spec.service_account_name),
                       ("runtimeClassName", spec.runtime_class_name)):  # fmt: skip
        if value:
            pod_spec[key] = value
    template = {"metadata": {"labels": labels(base["metadata"]["name"])}, "spec": pod_spec}
    template["metadata"]["annotations"] = {TEMPLATE_HASH: template_hash(template)}
    return template


def template_hash(template: dict) -> str:
    """A short hash of the pod template: changes exactly when the pods must roll."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


def build_deployment(base: dict, spec: BaseSpec, image: str | None = None, routing: bool = False) -> dict:
    name = base["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(base, name),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(name)},
            # GPU pools rarely hold a spare GPU for a surge pod: replace one pod at a time, which always progresses.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": build_pod_template(base, spec, image, routing),
        },
    }


def _service(base: dict, name: str, port_name: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(base, name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(base["metadata"]["name"]),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
        },
    }


def build_service(base: dict) -> dict:
    """The OpenAI API of the pool: ``http://<base>.<namespace>.svc:8000/v1``."""
    return _service(base, base["metadata"]["name"], "http", OPENAI_PORT)


def build_admin_service(base: dict) -> dict:
    """The admin port, for people (port-forward); the operator calls pods directly by IP."""
    return _service(base, f"{base['metadata']['name']}-admin", "admin", ADMIN_PORT)


def endpoint(base: dict) -> str:
    meta = base["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:{OPENAI_PORT}/v1"
