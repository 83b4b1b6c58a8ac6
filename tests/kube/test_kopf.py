"""A real kopf operator, in-process, end to end against the emulator."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time

import kopf
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.kube.operators import eventually, running_operator
from tests.kube.samples import GROUP, PLURAL, VERSION, widget, widget_crd


@pytest.mark.timeout(120)
async def test_kopf_handles_create_update_delete_with_finalizers_and_status(kube_emulator):
    api = kube_emulator.api_client()
    client.ApiextensionsV1Api(api).create_custom_resource_definition(widget_crd())
    custom = client.CustomObjectsApi(api)
    args = (GROUP, VERSION, "default", PLURAL, "w1")
    seen: list[tuple[str, object]] = []
    registry = kopf.OperatorRegistry()

    @kopf.on.create(GROUP, VERSION, PLURAL, id="created", registry=registry)
    def created(spec, patch, body, **_):
        seen.append(("create", spec["size"]))
        patch.status["phase"] = "Created"
        kopf.info(body, reason="Created", message="a widget")
        return {"size": spec["size"]}

    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec.size", registry=registry)
    def resized(old, new, patch, **_):
        seen.append(("update", (old, new)))
        patch.status["phase"] = f"Resized to {new}"

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    async def deleted(name, **_):
        seen.append(("delete", name))

    def get():
        try:
            return custom.get_namespaced_custom_object(*args)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async with running_operator(kube_emulator, registry):
        await asyncio.to_thread(
            custom.create_namespaced_custom_object, GROUP, VERSION, "default", PLURAL, widget("w1", size=2)
        )
        obj = await eventually(
            lambda: (o := get()) and (o.get("status") or {}).get("phase") == "Created" and o
        )
        assert obj["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        assert obj["status"]["created"] == {
            "size": 2
        }  # the handler's result, stored by kopf  # the handler's result, stored by kopf

        await asyncio.to_thread(custom.patch_namespaced_custom_object, *args, {"spec": {"size": 5}})
        await eventually(lambda: (get() or {}).get("status", {}).get("phase") == "Resized to 5")

        await asyncio.to_thread(custom.delete_namespaced_custom_object, *args)
        await eventually(lambda: get() is None)

    assert seen == [("create", 2), ("update", (2, 5)), ("delete", "w1")]
    events = client.CoreV1Api(api).list_namespaced_event("default").items
    assert any(e.reason == "Created" and e.involved_object.name == "w1" for e in events)
    api.close()


OPERATOR_SCRIPT = """
import kopf

@kopf.on.create("example.dev", "v1", "widgets")
def created(spec, patch, **_):
    patch.status["phase"] = f"seen size {spec['size']}"
"""


@pytest.mark.timeout(120)
def test_kopf_run_cli_with_the_emulators_kubeconfig(kube_emulator, tmp_path):
    """``kopf run`` as a process, logging in through $KUBECONFIG like a deployed operator would."""
    api = kube_emulator.api_client()
    client.ApiextensionsV1Api(api).create_custom_resource_definition(widget_crd())
    custom = client.CustomObjectsApi(api)
    (tmp_path / "handlers.py").write_text(OPERATOR_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
    env["KUBECONFIG"] = str(kube_emulator.kubeconfig_path)
    kopf_bin = str(pathlib.Path(sys.executable).with_name("kopf"))
    process = subprocess.Popen([kopf_bin, "run", "--standalone", "--namespace=default", "handlers.py"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1", size=4))
        deadline = time.monotonic() + 60
        while (
            custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "w1").get("status") or {}
        ).get("phase") != "seen size 4":
            assert time.monotonic() < deadline and process.poll() is None, process.stdout.read().decode()[
                -3000:
            ]
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)
    api.close()
