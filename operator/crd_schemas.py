"""OpenAPI schemas of LoRABase and LoRAAdapter spec and status (defaults and bounds from crd_models)."""

from __future__ import annotations

from loraplane.operator import crd_models as M
from loraplane.operator.openapi import (
    array,
    boolean,
    conditions,
    free_form,
    integer,
    name,
    number,
    obj,
    quantity,
    secret_ref,
    string,
)

S3_RULE = ("self.startsWith('s3://') && size(self) > 5", "must be an s3://bucket/prefix/ URI")


def base_spec() -> dict:
    model = obj(
        "The base model every pod of this LoRABase serves.",
        {
            "uri": string(
                "Where the base weights are (s3://..., a path baked into the image, or a hub id).",
                minLength=1,
                maxLength=1024,
            ),
            "sha256": string(
                "Pinned base hash: sha256 of the weight files' content, as `loraplane model hash` prints it. "
                "Pods refuse to start on other weights; adapters trained for another base are refused.",
                pattern=M.SHA256_PATTERN,
            ),
        },
        required=("uri", "sha256"),
    )
    resources = obj(
        "Compute per pod.",
        {
            "gpus": integer("GPUs per pod.", 0, 16, default=M.DEFAULT_GPUS),
            "gpuResource": string("Extended resource name of a GPU.", default=M.DEFAULT_GPU_RESOURCE),
            "cpu": string("CPU request and limit, a Kubernetes quantity (for example 8)."),
            "memory": string("Memory request and limit, a Kubernetes quantity (for example 64Gi)."),
        },
    )
    engine = obj(
        "Engine settings passed to `loraplane serve`.",
        {
            "gpuAdapterBytes": quantity(
                "GPU memory reserved for resident adapters.", M.DEFAULT_GPU_ADAPTER_BYTES
            ),
            "hostAdapterBytes": quantity("Pinned host RAM for warm adapters.", M.DEFAULT_HOST_ADAPTER_BYTES),
            "maxRank": integer(
                "Largest LoRA rank served; higher-rank adapters are refused (RankTooHigh).",
                1,
                M.MAX_RANK_LIMIT,
                default=M.DEFAULT_MAX_RANK,
            ),
            "kvCacheFraction": number(
                "Fraction of free GPU memory given to the KV cache.",
                0.05,
                0.98,
                default=M.DEFAULT_KV_FRACTION,
            ),
            "maxNumSeqs": integer("Most sequences in one step.", 1, 4096, default=M.DEFAULT_MAX_NUM_SEQS),
            "dtype": string("Compute dtype.", enum=list(M.DTYPES), default=M.DEFAULT_DTYPE),
        },
    )
    host_cache = obj(
        "The pods' content-addressed adapter cache on the node.",
        {
            "type": string(
                "emptyDir (per pod) or hostPath (shared by the pods of a node).",
                enum=list(M.HOST_CACHE_TYPES),
                default="emptyDir",
            ),
            "path": string("Node directory when type is hostPath.", pattern=r"^/[^\0]*$", maxLength=1024),
            "sizeLimit": quantity(
                "Largest cache size; least-recently-used versions go first.", M.DEFAULT_HOST_CACHE_SIZE
            ),
        },
        rules=(("self.type != 'hostPath' || has(self.path)", "path is required when type is hostPath"),),
    )
    storage = obj(
        "S3 access for the operator (manifest validation) and the pods (pulls).",
        {
            "endpoint": string("S3 endpoint URL; empty for AWS.", pattern=r"^https?://.+", maxLength=1024),
            "region": string("S3 region.", maxLength=64),
            "credentialsSecretRef": secret_ref(
                "Secret with S3 credentials, mounted into pods by reference.",
                ("accessKeyIdKey", M.DEFAULT_ACCESS_KEY_ID_KEY, "Key holding the access key id."),
                ("secretAccessKeyKey", M.DEFAULT_SECRET_ACCESS_KEY_KEY, "Key holding the secret access key."),
            ),
        },
    )
    trust = obj(
        "Who may sign adapters for this base.",
        {
            "publicKeysSecretRef": secret_ref(
                "Secret whose every key is a trusted Ed25519 public key (PEM); its key is the key id."
            )
        },
    )
    auth = obj(
        "Client authentication of the OpenAI API.",
        {
            "apiKeysSecretRef": secret_ref(
                "Secret holding api-keys.yaml (API key -> allowed adapters), mounted."
            )
        },
    )
    return obj(
        "Desired state of a pool of GPU server pods sharing one base model.",
        {
            "model": model,
            "replicas": integer("Number of server pods.", 0, M.MAX_REPLICAS, default=M.DEFAULT_REPLICAS),
            "image": string("Server container image.", default=M.DEFAULT_IMAGE, minLength=1),
            "resources": resources,
            "engine": engine,
            "hostCache": host_cache,
            "storage": storage,
            "trust": trust,
            "auth": auth,
            "adminTokenSecretRef": secret_ref(
                "Secret with the pods' admin API token. When absent the operator creates <name>-admin-token, "
                "owned by this LoRABase.",
                ("key", M.DEFAULT_ADMIN_TOKEN_KEY, "Key holding the token."),
            ),
            "nodeSelector": {
                "type": "object",
                "description": "Pod nodeSelector.",
                "additionalProperties": {"type": "string"},
            },
            "tolerations": array("Pod tolerations (core/v1 Toleration).", free_form("A toleration.")),
            "affinity": free_form("Pod affinity (core/v1 Affinity)."),
        },
        required=("model",),
    )


def base_status() -> dict:
    return obj(
        "Observed state, written by the operator only.",
        {
            "observedGeneration": integer("metadata.generation last reconciled.", 0, 2**62),
            "replicas": integer("Server pods that exist.", 0, 10**6),
            "readyReplicas": integer("Server pods that are ready.", 0, 10**6),
            "selector": string("Label selector of the pods (scale subresource)."),
            "observedBaseHash": string(
                "Base hash the ready pods report; empty while pods disagree or none answers.", maxLength=64
            ),
            "endpoint": string("In-cluster URL of the OpenAI API."),
            "adminTokenSecret": name("Secret holding the admin token (by name; never its value)."),
            "conditions": conditions(),
        },
    )


def adapter_spec() -> dict:
    source = obj(
        "Where the signed adapter version is.",
        {
            "uri": string(
                "s3://bucket/prefix/ holding loraplane-manifest.json, its signature and the files.",
                maxLength=1024,
                **{"x-kubernetes-validations": [{"rule": S3_RULE[0], "message": S3_RULE[1]}]},
            ),
            "manifestDigest": string(
                "Optional pin: sha256:<hex> of the manifest; anything else is refused (DigestMismatch).",
                pattern=M.DIGEST_PATTERN,
            ),
        },
        required=("uri",),
    )
    return obj(
        "Desired state of one LoRA adapter on every pod of a LoRABase.",
        {
            "baseRef": obj(
                "The LoRABase (same namespace) whose pods serve this adapter.",
                {"name": name("Name of the LoRABase.")},
                required=("name",),
            ),
            "source": source,
            "version": string(
                "Human version label; the manifest digest is the identity.",
                pattern=M.VERSION_PATTERN,
            ),
            "residency": obj(
                "Where the adapter stays between requests.",
                {
                    "pin": boolean("Never evict from the warm tier.", default=False),
                    "warm": string(
                        "Tier warmed before the pod reports ready.",
                        enum=list(M.WARM_TIERS),
                        default=M.DEFAULT_WARM,
                    ),
                },
            ),
            "rollout": obj(
                "How a new version rolls.",
                {
                    "maxUnavailable": integer(
                        "Pods loading the new version at once.",
                        1,
                        M.MAX_REPLICAS,
                        default=M.DEFAULT_MAX_UNAVAILABLE,
                    )
                },
            ),
        },
        required=("baseRef", "source", "version"),
    )


def adapter_status() -> dict:
    pod = obj(
        "One pod's truth, from its admin API.",
        {
            "name": string("Pod name."),
            "version": string("Version the pod serves (or is loading)."),
            "state": string(
                "Pending, Loading, Warm (loaded, not serving), Serving, Failed, Unreachable, Unloading.",
                enum=["Pending", "Loading", "Warm", "Serving", "Failed", "Unreachable", "Unloading"],
            ),
            "message": string("Detail, for Failed and Unreachable."),
            "since": string("When state last changed.", format="date-time"),
        },
        required=("name", "state"),
    )
    return obj(
        "Observed state, written by the operator only.",
        {
            "observedGeneration": integer("metadata.generation last reconciled.", 0, 2**62),
            "servingVersion": string("Version most pods serve (every pod once Ready)."),
            "digest": string("Manifest digest of servingVersion."),
            "servingSource": string("Source URI of servingVersion (restored to restarted pods while a new version fails)."),
            "validatedDigest": string("Manifest digest of spec.version, once validated."),
            "rank": integer("Largest LoRA rank of the validated version.", 0, M.MAX_RANK_LIMIT),
            "readyPods": integer("Pods serving spec.version.", 0, 10**6),
            "desiredPods": integer("Pods that should serve it (the base's replicas).", 0, 10**6),
            "pods": array("Per-pod state.", pod, **{"x-kubernetes-list-type": "map",
                                                    "x-kubernetes-list-map-keys": ["name"]}),
            "conditions": conditions(),
        },
    )  # fmt: skip
