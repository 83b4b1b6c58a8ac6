"""No LoRABase borrows the operator's reach: endpoints, Secrets, host paths and images are the operator's
settings. Pure rules first, then each rule against the emulator with a listener that must hear nothing."""

from __future__ import annotations

import socket
import threading

import pytest

from loraplane.operator import policy as P
from loraplane.operator.cli import _parser, main, policy_of
from tests.operator.harness import TEST_ENDPOINTS, OperatorThread, condition, wait_for
from tests.s3_servers import free_port


def _violation(fn, *args) -> P.PolicyViolation:
    with pytest.raises(P.PolicyViolation) as err:
        fn(*args)
    return err.value


def test_endpoint_rule():
    aws_only = P.OperatorPolicy()
    aws_only.check_endpoint(None)
    for ok in (
        "https://s3.amazonaws.com",
        "https://s3.eu-west-1.amazonaws.com/",
        "https://S3.US-EAST-2.amazonaws.com",
    ):
        aws_only.check_endpoint(ok)
    for bad in ("http://s3.amazonaws.com", "https://s3.amazonaws.com.evil.io", "http://127.0.0.1:9000",
                "https://user:pw@s3.amazonaws.com", "https://s3.amazonaws.com/x", "ftp://s3.amazonaws.com"):  # fmt: skip
        err = _violation(aws_only.check_endpoint, bad)
        assert err.reason == P.ENDPOINT_NOT_ALLOWED and err.field == "spec.storage.endpoint", bad
    listed = P.OperatorPolicy(allowed_s3_endpoints=("http://minio.storage.svc:9000/", "https://s3.internal"))
    listed.check_endpoint("http://MINIO.storage.svc:9000")
    listed.check_endpoint("https://s3.internal:443")
    for bad in (
        "http://minio.storage.svc:9001",
        "https://minio.storage.svc:9000",
        "https://s3.amazonaws.com",
    ):
        assert _violation(listed.check_endpoint, bad).reason == P.ENDPOINT_NOT_ALLOWED, bad
    with pytest.raises(ValueError, match="allowed-s3-endpoint"):
        P.OperatorPolicy(allowed_s3_endpoints=("minio:9000",))


def test_host_path_rule():
    P.OperatorPolicy().check_host_path("emptyDir", None)
    assert (
        "hostPathPrefix" in _violation(P.OperatorPolicy().check_host_path, "hostPath", "/var/cache/x").message
    )
    policy = P.OperatorPolicy(host_path_prefix="/var/cache/loraplane")
    for ok in ("/var/cache/loraplane", "/var/cache/loraplane/pool-a"):
        policy.check_host_path("hostPath", ok)
    for bad in ("/", "/var/cache/loraplane-evil", "/var/cache/loraplane/../../etc", "/var/cache",
                "var/cache/loraplane/x", "/var/cache/loraplane/", "/etc/kubernetes"):  # fmt: skip
        err = _violation(policy.check_host_path, "hostPath", bad)
        assert err.reason == P.HOST_PATH_NOT_ALLOWED and err.field == "spec.hostCache.path", bad
    for bad_prefix in ("/", "//", "///", "/./", "/a/..", "//.", " // ", "/var/..//", "relative"):
        with pytest.raises(ValueError, match="host-path-prefix"):  # the node's root in any spelling
            P.OperatorPolicy(host_path_prefix=bad_prefix)
    for spelled, normal in (("/a/../b", "/b"), ("/a/", "/a"), ("//var//cache/", "/var/cache")):
        assert P.OperatorPolicy(host_path_prefix=spelled).host_path_prefix == normal
    spelled = P.OperatorPolicy(host_path_prefix="//var/cache/loraplane/")
    spelled.check_host_path("hostPath", "/var/cache/loraplane/pool-a")
    for bad in ("//", "//var/cache/loraplane/x", "/var/cache/loraplane-evil"):
        assert _violation(spelled.check_host_path, "hostPath", bad).reason == P.HOST_PATH_NOT_ALLOWED, bad


def test_image_rule():
    policy = P.OperatorPolicy(allowed_registries=("ghcr.io/loraplane", "registry.internal:5000/ml/"))
    default = "ghcr.io/loraplane/loraplane-server:0.1.0"
    assert policy.server_image_for(None, default) == default
    assert policy.server_image_for("registry.internal:5000/ml/server@sha256:" + "a" * 64, default).startswith(
        "reg"
    )
    for bad in ("ghcr.io/loraplane-evil/server:1", "docker.io/loraplane/server", "loraplane-server:0.1.0",
                "evil.io/ghcr.io/loraplane/x", "ghcr.io/loraplane/../x", "ghcr.io/loraplane"):  # fmt: skip
        err = _violation(policy.server_image_for, bad, default)
        assert err.reason == P.IMAGE_NOT_ALLOWED and err.field == "spec.image", bad
    host_only = P.OperatorPolicy(allowed_registries=("Registry.Internal:5000",))
    assert host_only.server_image_for("registry.internal:5000/any/server:1", default)
    assert _violation(host_only.server_image_for, "registry.internal:5001/any/server:1", default)
    pinned = P.OperatorPolicy(server_image="registry.internal:5000/ml/server:2.0")
    assert pinned.server_image_for(None, default) == "registry.internal:5000/ml/server:2.0"
    assert pinned.server_image_for("registry.internal:5000/ml/server:2.0", default).endswith(":2.0")
    assert pinned.server_image_for(default, default).endswith(":2.0"), "the CRD default means unset"
    assert _violation(pinned.server_image_for, "ghcr.io/loraplane/x:1", default).reason == P.IMAGE_NOT_ALLOWED


PLACEMENT = P.OperatorPolicy(
    allowed_tolerations=("nvidia.com/gpu", "dedicated"),
    allowed_node_labels=("nvidia.com/gpu.product", "kubernetes.io/hostname", "topology.kubernetes.io/zone"),
    allowed_priority_classes=("inference-high",),
    allowed_service_accounts=("adapter-reader",),
    allowed_runtime_classes=("nvidia",),
)
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def _node_affinity(key: str, part: str = "matchExpressions") -> dict:
    return {"nodeAffinity": {_REQUIRED: {"nodeSelectorTerms": [{part: [{"key": key, "operator": "In",
                                                                         "values": ["x"]}]}]}}}  # fmt: skip


def _pod_affinity(kind: str, **term) -> dict:
    return {kind: {_PREFERRED: [{"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                                  "labelSelector": {}, **term}}]}}  # fmt: skip


def test_placement_within_the_allow_lists_passes():
    PLACEMENT.check_placement({})
    PLACEMENT.check_placement({
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "affinity": {**_node_affinity("topology.kubernetes.io/zone"),
                     **_pod_affinity("podAntiAffinity")},
        "priorityClassName": "inference-high", "serviceAccountName": "adapter-reader", "runtimeClassName": "nvidia",
    })  # fmt: skip


@pytest.mark.parametrize(
    "spec, field_, says",
    [
        ({"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
         "spec.tolerations[0].key", "allowedTolerations"),
        ({"tolerations": [{"key": "dedicated"}, {"operator": "Exists"}]},
         "spec.tolerations[1].key", "every taint"),
        ({"nodeSelector": {"nvidia.com/gpu.product": "H200", "team": "other"}},
         "spec.nodeSelector.team", "allowedNodeLabels"),
        ({"affinity": _node_affinity("team")},
         f"spec.affinity.nodeAffinity.{_REQUIRED}.nodeSelectorTerms[0].matchExpressions[0].key", "allowedNodeLabels"),
        ({"affinity": _node_affinity("metadata.name", "matchFields")},
         f"spec.affinity.nodeAffinity.{_REQUIRED}.nodeSelectorTerms[0].matchFields[0].key", "allowedNodeLabels"),
        ({"affinity": {"nodeAffinity": {_PREFERRED: [{"weight": 1, "preference": {
            "matchExpressions": [{"key": "team", "operator": "Exists"}]}}]}}},
         f"spec.affinity.nodeAffinity.{_PREFERRED}[0].preference.matchExpressions[0].key", "allowedNodeLabels"),
        ({"affinity": _pod_affinity("podAffinity", namespaces=["victim"])},
         f"spec.affinity.podAffinity.{_PREFERRED}[0].podAffinityTerm.namespaces", "own namespace"),
        ({"affinity": _pod_affinity("podAntiAffinity", namespaceSelector={})},
         f"spec.affinity.podAntiAffinity.{_PREFERRED}[0].podAffinityTerm.namespaceSelector", "own namespace"),
        ({"affinity": {"podAffinity": {_REQUIRED: [{"topologyKey": "kubernetes.io/hostname",
                                                    "namespaces": ["victim"]}]}}},
         f"spec.affinity.podAffinity.{_REQUIRED}[0].namespaces", "own namespace"),
        ({"affinity": {"nodeAfinity": {}}}, "spec.affinity.nodeAfinity", "unknown affinity"),
        ({"priorityClassName": "system-node-critical"}, "spec.priorityClassName", "allowedPriorityClasses"),
        ({"serviceAccountName": "operator-admin"}, "spec.serviceAccountName", "allowedServiceAccounts"),
        ({"runtimeClassName": "privileged-vm"}, "spec.runtimeClassName", "allowedRuntimeClasses"),
    ],
)  # fmt: skip
def test_placement_outside_the_allow_lists_is_refused_by_field(spec, field_, says):
    err = _violation(PLACEMENT.check_placement, spec)
    assert err.reason == P.PLACEMENT_NOT_ALLOWED and err.field == field_
    assert says in err.message


def test_a_bare_operator_allows_no_placement():
    bare = P.OperatorPolicy()
    for spec in ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
                 {"nodeSelector": {"nvidia.com/gpu.present": "true"}}, {"affinity": _node_affinity("kubernetes.io/hostname")},
                 {"priorityClassName": "a"}, {"serviceAccountName": "a"}, {"runtimeClassName": "a"}):  # fmt: skip
        assert _violation(bare.check_placement, spec).reason == P.PLACEMENT_NOT_ALLOWED, spec
    bare.check_placement({"affinity": _pod_affinity("podAntiAffinity")})  # own namespace: no reach borrowed


def test_placement_flags_make_the_policy_and_refuse_malformed_names():
    args = _parser().parse_args(["run", "-n", "a", "--allowed-toleration", "nvidia.com/gpu",
                                 "--allowed-node-label", "topology.kubernetes.io/zone",
                                 "--allowed-priority-class", "high", "--allowed-service-account", "reader",
                                 "--allowed-runtime-class", "nvidia"])  # fmt: skip
    policy = policy_of(args)
    assert policy.allowed_tolerations == ("nvidia.com/gpu",)
    assert policy.allowed_node_labels == ("topology.kubernetes.io/zone",)
    assert (policy.allowed_priority_classes, policy.allowed_service_accounts, policy.allowed_runtime_classes) == (
        ("high",), ("reader",), ("nvidia",))  # fmt: skip
    for flag, bad in (("--allowed-toleration", "a b"), ("--allowed-node-label", "/x"),
                      ("--allowed-priority-class", "High"), ("--allowed-service-account", "a/b"),
                      ("--allowed-runtime-class", "-x")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(["run", "-n", "a", flag, bad])
        assert exit_.value.code == 2, flag


def test_cli_flags_make_the_policy():
    args = _parser().parse_args(["run", "-n", "a", "--allowed-s3-endpoint", "http://minio:9000",
                                 "--host-path-prefix", "/var/cache/lp", "--server-image", "r.io/s:1"])  # fmt: skip
    policy = policy_of(args)
    assert (
        policy.allowed_s3_endpoints == ("http://minio:9000",) and policy.host_path_prefix == "/var/cache/lp"
    )
    assert policy.server_image == "r.io/s:1" and policy.allowed_registries == P.DEFAULT_REGISTRIES
    with pytest.raises(SystemExit) as exit_:
        main(["run", "-n", "a", "--host-path-prefix", "/"])
    assert exit_.value.code == 2


class Listener:
    """A loopback TCP listener that records every connection (it must record none)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(0.5)
                try:
                    self.connections.append(conn.recv(65536))
                except OSError:
                    self.connections.append(b"")

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener():
    lst = Listener()
    yield lst
    lst.close()


def _base_reason(world, name: str, reason: str) -> dict:
    return wait_for(lambda: (b := world.get("LoRABase", name)) and condition(b, "Ready").get("reason") == reason
                    and b, what=f"LoRABase {name} reason {reason}")  # fmt: skip


def _no_deployment(world, name: str) -> bool:
    try:
        world.get("Deployment", name)
    except LookupError:  # 404 only: ControlPlane.get raises RuntimeError for anything else
        return True
    return False


def test_each_rule_against_the_api_server(world, artifacts, listener):
    world.secret("unlabeled", {"AWS_ACCESS_KEY_ID": "AKIAVICTIM", "AWS_SECRET_ACCESS_KEY": "victim-secret"},
                 labeled=False)  # fmt: skip
    world.secret("stolen", {"AWS_ACCESS_KEY_ID": "AKIASTOLEN", "AWS_SECRET_ACCESS_KEY": "stolen-secret"})
    cases = {}

    def base(name, reason, edit):
        manifest = world.base_manifest(name, replicas=1)
        edit(manifest["spec"])
        world.plane.create(manifest)
        cases[name] = reason

    # a listener the policy does not allow, handed a labeled Secret: the operator must never call it
    base("rogue-endpoint", P.ENDPOINT_NOT_ALLOWED, lambda s: s["storage"].update(
        endpoint=listener.url, credentialsSecretRef={"name": "stolen"}))  # fmt: skip
    # an allowed endpoint (moto) with a Secret not labeled for the operator
    base(
        "unlabeled-secret",
        P.SECRET_NOT_LABELED,
        lambda s: s["storage"].update(credentialsSecretRef={"name": "unlabeled"}),
    )
    base(
        "unlabeled-keys",
        P.SECRET_NOT_LABELED,
        lambda s: s["trust"].update(publicKeysSecretRef={"name": "unlabeled"}),
    )
    base(
        "root-hostpath",
        P.HOST_PATH_NOT_ALLOWED,
        lambda s: s.update(hostCache={"type": "hostPath", "path": "/"}),
    )
    base(
        "etc-hostpath",
        P.HOST_PATH_NOT_ALLOWED,
        lambda s: s.update(hostCache={"type": "hostPath", "path": "/etc"}),
    )
    base("foreign-image", P.IMAGE_NOT_ALLOWED, lambda s: s.update(image="evil.example.com/miner:1"))
    base("control-plane-toleration", P.PLACEMENT_NOT_ALLOWED, lambda s: s.update(
        tolerations=[{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]))  # fmt: skip
    base("borrowed-account", P.PLACEMENT_NOT_ALLOWED, lambda s: s.update(serviceAccountName="operator-admin"))
    base("good", "", lambda s: s.update(hostCache={"type": "hostPath", "path": "/var/cache/loraplane/good"},
                                        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                        serviceAccountName="adapter-reader"))  # fmt: skip
    policy = P.OperatorPolicy(
        allowed_s3_endpoints=tuple(sorted(TEST_ENDPOINTS)),
        host_path_prefix="/var/cache/loraplane",
        allowed_tolerations=("nvidia.com/gpu",),
        allowed_service_accounts=("adapter-reader",),
    )
    with OperatorThread(world, policy=policy):
        world.create_adapter("via-rogue", artifacts.uris["v1"], "v1", base="rogue-endpoint")
        world.create_adapter("via-unlabeled", artifacts.uris["v1"], "v1", base="unlabeled-secret")
        good = wait_for(lambda: world.get("Deployment", "good"), what="the compliant base's Deployment")
        volume = next(v for v in good["spec"]["template"]["spec"]["volumes"] if v["name"] == "host-cache")
        assert volume["hostPath"]["path"] == "/var/cache/loraplane/good"
        pod_spec = good["spec"]["template"]["spec"]
        assert (
            pod_spec["serviceAccountName"] == "adapter-reader"
            and pod_spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        )
        for name, reason in cases.items():
            if not reason:
                continue
            refused = _base_reason(world, name, reason)
            assert condition(refused, "Degraded")["status"] == "True"
            assert condition(refused, "Ready")["message"].startswith("spec."), "the message names the field"
            assert _no_deployment(world, name), f"{name}: no Deployment for a LoRABase that breaks a rule"
        for adapter, reason in (
            ("via-rogue", P.ENDPOINT_NOT_ALLOWED),
            ("via-unlabeled", P.SECRET_NOT_LABELED),
        ):
            refused = world.wait_reason(adapter, reason)
            assert condition(refused, "Validated")["status"] != "True"
        assert not _no_deployment(world, "good")
    assert listener.connections == [], "the operator sent something to an endpoint it does not allow"


def test_a_rule_broken_later_changes_no_deployment(world):
    world.create_base("pool", replicas=1)
    pinned = P.OperatorPolicy(
        allowed_s3_endpoints=tuple(sorted(TEST_ENDPOINTS)), server_image="ghcr.io/loraplane/s:9"
    )
    with OperatorThread(world, policy=pinned):
        before = wait_for(lambda: world.get("Deployment", "pool"), what="Deployment")
        assert before["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/loraplane/s:9"
        world.api(
            "PATCH", "LoRABase", "pool", {"spec": {"image": "ghcr.io/loraplane/other:1", "replicas": 3}}
        )
        _base_reason(world, "pool", P.IMAGE_NOT_ALLOWED)
        after = world.get("Deployment", "pool")
        # generation counts spec writes only (the controller manager's status updates change resourceVersion)
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
        assert after["spec"] == before["spec"]
        assert after["spec"]["replicas"] == 1, "nothing of a refused spec reaches the Deployment"
