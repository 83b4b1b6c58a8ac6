"""A real kopf operator, in-process, end to end against the emulator."""

from __future__ import annotations

import asyncio

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
