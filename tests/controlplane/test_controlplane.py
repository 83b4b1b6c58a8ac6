"""The control plane itself: RBAC is enforced, the garbage collector runs, Deployments become Pods that the
kubelet stand-in runs and replaces."""

from __future__ import annotations

import time

from tests.controlplane.fixtures import control_plane, namespace  # noqa: F401
from tests.controlplane.kubelet import Kubelet


def wait_for(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out: {check}")


class Dummy:
    def __init__(self, pod: dict, ip: str):
        self.ip, self.stopped = ip, False

    def ready(self) -> bool:
        return not self.stopped

    def alive(self) -> bool:
        return not self.stopped

    def stop(self) -> None:
        self.stopped = True


def test_a_fresh_service_account_may_do_nothing(control_plane, namespace):  # noqa: F811
    control_plane.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody", "namespace": namespace}}
    )
    token = control_plane.service_account_token(namespace, "nobody")
    assert control_plane.request("GET", f"/api/v1/namespaces/{namespace}/pods", token=token)[0] == 403
    assert control_plane.request("GET", f"/api/v1/namespaces/{namespace}/pods", token="not-a-token")[0] == 401
    assert control_plane.request("GET", f"/api/v1/namespaces/{namespace}/pods")[0] == 200  # the admin


def test_garbage_collector_deletes_owned_objects(control_plane, namespace):  # noqa: F811
    owner = control_plane.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner", "namespace": namespace}}
    )
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    control_plane.create({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": "owned", "namespace": namespace, "ownerReferences": [ref]}})  # fmt: skip
    assert control_plane.delete("v1", "ConfigMap", "owner", namespace) == 200
    wait_for(
        lambda: (
            control_plane.request("GET", control_plane.path("v1", "ConfigMap", "owned", namespace))[0] == 404
        )
    )


def test_deployment_pods_run_on_the_stand_in_and_are_replaced(control_plane, namespace):  # noqa: F811
    labels = {"app": "web"}
    control_plane.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": namespace},
                          "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
                              "metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}})  # fmt: skip
    with Kubelet(control_plane, namespace, Dummy) as kubelet:
        running = kubelet.wait_running(2)
        assert len({r.ip for r in running}) == 2
        ready = lambda: (
            control_plane.get("apps/v1", "Deployment", "web", namespace)["status"].get("readyReplicas") == 2
        )  # noqa: E731
        wait_for(ready)
        victim = running[0]
        name = next(n for n, r in kubelet.running.items() if r is victim)
        kubelet.kill(name)
        assert victim.handle.stopped
        wait_for(lambda: len(kubelet.running) == 2 and name not in kubelet.running)
        wait_for(ready)
        pods = control_plane.list("v1", "Pod", namespace)
        assert all(
            p["spec"]["nodeName"] == "stand-in" and p["status"]["podIP"].startswith("127.0.0.") for p in pods
        )


def test_a_pod_whose_start_failed_is_started_again(control_plane, namespace):  # noqa: F811
    """A Pod bound to the stand-in whose runtime failed once (a busy address, a spawn error) still runs: the
    stand-in retries it, as a kubelet retries a Pod it has accepted, instead of leaving it Pending for good."""
    starts: list[str] = []

    def flaky(pod: dict, ip: str) -> Dummy:
        starts.append(ip)
        if len(starts) == 1:
            raise OSError("address in use")
        return Dummy(pod, ip)

    control_plane.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": namespace},
                          "spec": {"containers": [{"name": "c", "image": "x"}]}})  # fmt: skip
    with Kubelet(control_plane, namespace, flaky) as kubelet:
        (running,) = kubelet.wait_running(1)
        assert len(starts) == 2 and "address in use" in kubelet.errors[0]
        pod = wait_for(
            lambda: (p := control_plane.get("v1", "Pod", "p", namespace))["status"].get("podIP") and p
        )
        assert pod["status"]["podIP"] == running.ip and pod["spec"]["nodeName"] == "stand-in"
