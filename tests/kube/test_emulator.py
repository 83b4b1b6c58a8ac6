"""The emulator against the official ``kubernetes`` client: semantics the operator relies on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import kmock
import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.kube.samples import API_VERSION, GROUP, KIND, PLURAL, VERSION, gadget_crd, widget, widget_crd


@pytest.fixture
def kube(kube_emulator):
    api = kube_emulator.api_client()
    client.ApiextensionsV1Api(api).create_custom_resource_definition(widget_crd())
    yield kube_emulator
    api.close()


@pytest.fixture
def custom(kube):
    with kube.api_client() as api:
        yield client.CustomObjectsApi(api)


@pytest.fixture
def core(kube):
    with kube.api_client() as api:
        yield client.CoreV1Api(api)


JSON_PATCH = "application/json-patch+json"  # the client sends merge patches to custom objects by default


def http_get(kube, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(kube.url + path) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status_of(error: ApiException) -> dict:
    return json.loads(error.body)


# --- discovery -----------------------------------------------------------------------------------


def test_discovery_core_groups_and_crd_registration(kube, custom):
    assert http_get(kube, "/api")[1]["versions"] == ["v1"]
    core = {r["name"]: r for r in http_get(kube, "/api/v1")[1]["resources"]}
    assert core["pods"]["namespaced"] and not core["namespaces"]["namespaced"] and "pods/status" in core
    groups = {g["name"] for g in http_get(kube, "/apis")[1]["groups"]}
    assert {"apps", "apiextensions.k8s.io", "coordination.k8s.io", "events.k8s.io", GROUP} <= groups
    assert "rbac.authorization.k8s.io" in groups and "monitoring.coreos.com" not in groups
    names = {r["name"] for r in http_get(kube, f"/apis/{GROUP}/{VERSION}")[1]["resources"]}
    assert names == {PLURAL, f"{PLURAL}/status", f"{PLURAL}/scale"}

    crd = client.ApiextensionsV1Api(kube.api_client()).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions == {"Established": "True", "NamesAccepted": "True"}

    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1"))
    client.ApiextensionsV1Api(kube.api_client()).delete_custom_resource_definition(f"{PLURAL}.{GROUP}")
    assert http_get(kube, f"/apis/{GROUP}/{VERSION}")[0] == 404
    assert http_get(kube, f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}")[0] == 404
    assert GROUP not in {g["name"] for g in http_get(kube, "/apis")[1]["groups"]}


def test_unknown_paths_and_objects_give_status_bodies(kube, custom):
    code, body = http_get(kube, "/apis/monitoring.coreos.com/v1/servicemonitors")
    assert code == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"
    with pytest.raises(ApiException) as e:
        custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "nope")
    assert e.value.status == 404
    assert status_of(e.value) | {"details": None} == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "reason": "NotFound",
        "message": f'{PLURAL}.{GROUP} "nope" not found',
        "code": 404,
        "details": None,
    }


# --- CRUD and metadata ---------------------------------------------------------------------------


def test_create_returns_201_with_server_metadata_and_duplicates_conflict(kube, custom):
    body, code, _ = custom.create_namespaced_custom_object_with_http_info(
        GROUP, VERSION, "default", PLURAL, widget("w1")
    )
    meta = body["metadata"]
    assert code == 201 and meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > 0
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1"))
    assert e.value.status == 409 and status_of(e.value)["reason"] == "AlreadyExists"
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)
    assert listed["kind"] == f"{KIND}List" and listed["apiVersion"] == API_VERSION
    assert int(listed["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])


def test_resource_versions_are_global_and_monotonic(kube, custom, core):
    a = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("a"))
    cm = core.create_namespaced_config_map("default", {"metadata": {"name": "cm"}})
    b = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("b"))
    versions = [
        int(a["metadata"]["resourceVersion"]),
        int(cm.metadata.resource_version),
        int(b["metadata"]["resourceVersion"]),
    ]
    assert versions == sorted(set(versions))


def test_generation_bumps_on_spec_changes_only(kube, custom):
    args = (GROUP, VERSION, "default", PLURAL, "w1")
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1"))
    labelled = custom.patch_namespaced_custom_object(*args, {"metadata": {"labels": {"x": "y"}}})
    assert labelled["metadata"]["generation"] == 1
    statused = custom.patch_namespaced_custom_object_status(*args, {"status": {"phase": "Ok"}})
    assert statused["metadata"]["generation"] == 1
    changed = custom.patch_namespaced_custom_object(*args, {"spec": {"size": 2}})
    assert changed["metadata"]["generation"] == 2
    same = custom.patch_namespaced_custom_object(*args, {"spec": {"size": 2}})
    assert same["metadata"]["resourceVersion"] == changed["metadata"]["resourceVersion"]  # a no-op write


def test_stale_resource_version_conflicts_on_put_and_patch(kube, custom):
    args = (GROUP, VERSION, "default", PLURAL, "w1")
    old = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1"))
    fresh = custom.replace_namespaced_custom_object(*args, {**old, "spec": {"size": 5}})
    assert fresh["spec"] == {"size": 5} and fresh["metadata"]["generation"] == 2
    stale_rv = old["metadata"]["resourceVersion"]
    for attempt in (
        lambda: custom.replace_namespaced_custom_object(*args, {**old, "spec": {"size": 6}}),
        lambda: custom.patch_namespaced_custom_object(
            *args, {"metadata": {"resourceVersion": stale_rv}, "spec": {"size": 7}}
        ),
    ):
        with pytest.raises(ApiException) as e:
            attempt()
        assert e.value.status == 409 and status_of(e.value)["reason"] == "Conflict", e.value.body
    # kopf guards its JSON patches with a ``test`` op; the real server answers a failed test with 422
    stale_test = [{"op": "test", "path": "/metadata/resourceVersion", "value": stale_rv},
                  {"op": "replace", "path": "/spec/size", "value": 8}]  # fmt: skip
    with pytest.raises(ApiException) as e:
        custom.patch_namespaced_custom_object(*args, stale_test, _content_type=JSON_PATCH)
    assert e.value.status == 422 and status_of(e.value)["reason"] == "Invalid"
    ok = custom.patch_namespaced_custom_object(
        *args,
        [
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": fresh["metadata"]["resourceVersion"],
            },
            {"op": "add", "path": "/metadata/finalizers", "value": ["example.dev/x"]},
        ],
        _content_type=JSON_PATCH,
    )
    assert ok["metadata"]["finalizers"] == ["example.dev/x"]
    unversioned = {k: v for k, v in fresh.items() if k != "metadata"} | {"metadata": {"name": "w1"}}
    with pytest.raises(ApiException) as e:  # custom resources need a resourceVersion on PUT
        custom.replace_namespaced_custom_object(*args, unversioned)
    assert e.value.status == 422


def test_invalid_names_and_labels_are_rejected(kube, core):
    for meta in ({"name": "Bad_Name"}, {"name": "ok", "labels": {"k": "x" * 64}}):
        with pytest.raises(ApiException) as e:
            core.create_namespaced_config_map("default", {"metadata": meta})
        assert e.value.status == 422 and status_of(e.value)["reason"] == "Invalid"


def test_generate_name_and_strategic_merge_patch_of_builtins(kube):
    with kube.api_client() as api:
        apps = client.AppsV1Api(api)
        deployment = apps.create_namespaced_deployment(
            "default",
            {
                "metadata": {"generateName": "web-"},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"app": "web"}},
                    "template": {
                        "metadata": {"labels": {"app": "web"}},
                        "spec": {
                            "containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]
                        },
                    },
                },
            },
        )
        name = deployment.metadata.name
        assert name.startswith("web-") and len(name) > 4
        patched = apps.patch_namespaced_deployment(
            name, "default", {"spec": {"template": {"spec": {"containers": [{"name": "b", "image": "b:2"}]}}}}
        )
        assert [(c.name, c.image) for c in patched.spec.template.spec.containers] == [
            ("a", "a:1"),
            ("b", "b:2"),
        ]
        assert patched.metadata.generation == 2


# --- subresources --------------------------------------------------------------------------------


def test_status_subresource_separates_spec_and_status(kube, custom):
    args = (GROUP, VERSION, "default", PLURAL, "w1")
    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, {**widget("w1"), "status": {"ignored": True}}
    )
    assert "status" not in created
    custom.patch_namespaced_custom_object_status(*args, {"status": {"phase": "Ready"}, "spec": {"size": 99}})
    custom.patch_namespaced_custom_object(*args, {"status": {"phase": "Hacked"}, "spec": {"size": 3}})
    final = custom.get_namespaced_custom_object(*args)
    assert final["status"] == {"phase": "Ready"} and final["spec"]["size"] == 3
    replaced = custom.replace_namespaced_custom_object_status(*args, {**final, "status": {"phase": "Gone"}})
    assert replaced["status"] == {"phase": "Gone"}


def test_scale_subresource_maps_to_spec_replicas(kube, custom):
    args = (GROUP, VERSION, "default", PLURAL, "w1")
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1"))
    custom.patch_namespaced_custom_object_status(*args, {"status": {"replicas": 1}})
    scale = custom.get_namespaced_custom_object_scale(*args)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
    custom.patch_namespaced_custom_object_scale(*args, {"spec": {"replicas": 4}})
    assert custom.get_namespaced_custom_object(*args)["spec"]["replicas"] == 4


# --- selectors and lists -------------------------------------------------------------------------


def test_label_and_field_selectors(kube, custom, core):
    for name, labels in (("a", {"tier": "gpu", "zone": "x"}), ("b", {"tier": "cpu"}), ("c", {})):
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget(name, labels=labels))

    def names(**kwargs) -> list[str]:
        items = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, **kwargs)["items"]
        return [i["metadata"]["name"] for i in items]

    assert names(label_selector="tier=gpu") == ["a"]
    assert names(label_selector="tier==cpu") == ["b"]
    assert names(label_selector="tier!=gpu") == ["b", "c"]
    assert names(label_selector="tier in (gpu, cpu),zone") == ["a"]
    assert names(label_selector="tier notin (gpu)") == ["b", "c"]
    assert names(label_selector="!tier") == ["c"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.name!=b,metadata.namespace=default") == ["a", "c"]
    with pytest.raises(ApiException) as e:
        names(field_selector="spec.size=1")
    assert e.value.status == 400
    kube.make_pod("p1", {"app": "x"})
    kube.make_pod("p2", {"app": "x"}, ready=False)
    core.patch_namespaced_pod_status("p2", "default", {"status": {"phase": "Failed"}})
    running = core.list_pod_for_all_namespaces(field_selector="status.phase=Running")
    assert [p.metadata.name for p in running.items] == ["p1"]


def test_lists_across_namespaces_and_pagination(kube, custom, core):
    core.create_namespace({"metadata": {"name": "other"}})
    for ns in ("default", "other"):
        for index in range(3):
            custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, widget(f"w{index}", namespace=ns)
            )
    everything = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    assert len(everything["items"]) == 6
    page = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=4)
    rest = custom.list_cluster_custom_object(
        GROUP, VERSION, PLURAL, limit=4, _continue=page["metadata"]["continue"]
    )
    assert len(page["items"]) == 4 and len(rest["items"]) == 2 and "continue" not in rest["metadata"]


def test_namespaces_gate_creation_and_cascade_on_delete(kube, custom, core):
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, "missing", PLURAL, widget("w", namespace="missing")
        )
    assert e.value.status == 404 and status_of(e.value)["details"]["kind"] == "namespaces"
    assert {"default", "kube-system"} <= {n.metadata.name for n in core.list_namespace().items}
    core.create_namespace({"metadata": {"name": "team"}})
    custom.create_namespaced_custom_object(GROUP, VERSION, "team", PLURAL, widget("w", namespace="team"))
    core.delete_namespace("team")
    assert custom.list_namespaced_custom_object(GROUP, VERSION, "team", PLURAL)["items"] == []
    with pytest.raises(ApiException):
        core.read_namespace("team")


# --- deletion ------------------------------------------------------------------------------------


def test_finalizers_hold_deletion_until_removed(kube, custom):
    args = (GROUP, VERSION, "default", PLURAL, "w1")
    custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, widget("w1", finalizers=["example.dev/hold"])
    )
    deleting = custom.delete_namespaced_custom_object(*args)
    assert deleting["metadata"]["deletionTimestamp"] and deleting["metadata"]["generation"] == 2
    assert custom.get_namespaced_custom_object(*args)["metadata"]["deletionTimestamp"]
    custom.patch_namespaced_custom_object(*args, {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as e:
        custom.get_namespaced_custom_object(*args)
    assert e.value.status == 404


def test_owner_references_cascade_by_uid(kube, custom, core):
    owner = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("owner"))
    other = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("other"))
    ref = {"apiVersion": API_VERSION, "kind": KIND, "name": "owner", "uid": owner["metadata"]["uid"],
           "controller": True}  # fmt: skip
    other_ref = {**ref, "name": "other", "uid": other["metadata"]["uid"], "controller": False}
    core.create_namespaced_config_map("default", {"metadata": {"name": "dep", "ownerReferences": [ref]}})
    core.create_namespaced_config_map("default", {"metadata": {"name": "shared", "ownerReferences": [
        ref, other_ref]}})  # fmt: skip
    kube.make_pod("pod", {"app": "x"}, owner=ref)
    custom.delete_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "owner", propagation_policy="Background"
    )
    remaining = {c.metadata.name: c for c in core.list_namespaced_config_map("default").items}
    assert "dep" not in remaining and core.list_namespaced_pod("default").items == []
    assert [r.name for r in remaining["shared"].metadata.owner_references] == ["other"]

    # the real GC deletes a dependent none of whose owners exist (a wrong uid, say) right away
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "stranger", "ownerReferences": [{**other_ref, "uid": "wrong"}]}}
    )
    assert "stranger" not in {c.metadata.name for c in core.list_namespaced_config_map("default").items}

    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "kept", "ownerReferences": [other_ref]}}
    )
    custom.delete_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "other", propagation_policy="Orphan"
    )
    assert core.read_namespaced_config_map("kept", "default").metadata.owner_references is None


# --- watch ---------------------------------------------------------------------------------------


def test_watch_replays_from_resource_version_and_times_out(kube, custom):
    first = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("a"))
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("b"))
    custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "a", {"spec": {"size": 3}})
    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "b")
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        "default",
        PLURAL,
        resource_version=first["metadata"]["resourceVersion"],
        timeout_seconds=1,
    )
    seen = [(e["type"], e["object"]["metadata"]["name"]) for e in stream]  # ends by the server's timeout
    assert seen == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    initial = watch.Watch().stream(
        custom.list_namespaced_custom_object, GROUP, VERSION, "default", PLURAL, timeout_seconds=1
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in initial] == [("ADDED", "a")]


def test_watch_bookmarks_and_selector_transitions(kube, custom):
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("a"))
    rv = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)["metadata"][
        "resourceVersion"
    ]
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "a", {"metadata": {"labels": {"on": "1"}}}
    )
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "a", {"metadata": {"labels": None}}
    )
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        "default",
        PLURAL,
        resource_version=rv,
        label_selector="on=1",
        timeout_seconds=2,
        allow_watch_bookmarks=True,
    )
    events = [(e["type"], e["object"]["metadata"].get("name")) for e in stream]
    assert events[:2] == [("ADDED", "a"), ("DELETED", "a")]
    assert ("BOOKMARK", None) in events[2:]  # the fixture's bookmark interval is 1 s


def test_watch_with_an_expired_resource_version_gets_410(kube, custom):
    kube.store.history = type(kube.store.history)(kube.store.history, maxlen=2)
    for index in range(4):
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget(f"w{index}"))
    with pytest.raises(ApiException) as e:
        for _ in watch.Watch().stream(
            custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            "default",
            PLURAL,
            resource_version="1",
            timeout_seconds=1,
        ):
            pass
    assert e.value.status == 410


# --- pods, requests, failure injection -----------------------------------------------------------


def test_create_pods_for_deployment_plays_the_controllers(kube):
    with kube.api_client() as api:
        client.AppsV1Api(api).create_namespaced_deployment(
            "default",
            {
                "metadata": {"name": "srv"},
                "spec": {
                    "replicas": 2,
                    "selector": {"matchLabels": {"app": "srv"}},
                    "template": {
                        "metadata": {"labels": {"app": "srv"}},
                        "spec": {"containers": [{"name": "server", "image": "s:1"}]},
                    },
                },
            },
        )
        pods = kube.create_pods_for_deployment("srv", ip="127.0.0.1", port=8081)
        assert len(pods) == 2 and all(p["status"]["podIP"] == "127.0.0.1" for p in pods)
        listed = client.CoreV1Api(api).list_namespaced_pod("default", label_selector="app=srv").items
        assert {p.status.phase for p in listed} == {"Running"}
        assert listed[0].spec.containers[0].ports[0].container_port == 8081
        status = client.AppsV1Api(api).read_namespaced_deployment_status("srv", "default").status
        assert (status.replicas, status.ready_replicas) == (2, 2)
        assert kube.create_pods_for_deployment("srv") == pods  # converged: nothing to do

        client.AppsV1Api(api).patch_namespaced_deployment("srv", "default", {"spec": {"replicas": 3, "template": {
            "spec": {"containers": [{"name": "server", "image": "s:2"}]}}}})  # fmt: skip
        rolled = kube.create_pods_for_deployment("srv", ip=lambda index: f"127.0.0.{10 + index}")
        assert sorted(p["status"]["podIP"] for p in rolled) == ["127.0.0.10", "127.0.0.11", "127.0.0.12"]
        names = {p.metadata.name for p in client.CoreV1Api(api).list_namespaced_pod("default").items}
        assert names == {p["metadata"]["name"] for p in rolled}  # the old template's pods are gone
        client.AppsV1Api(api).delete_namespaced_deployment("srv", "default")
        assert client.CoreV1Api(api).list_namespaced_pod("default").items == []


def test_requests_are_logged_and_kmock_reactions_inject_failures(kube, custom):
    before = len(kube.requests)
    custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)
    assert [(r.method, r.path) for r in kube.requests[before:]] == [
        ("GET", f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}")
    ]
    kube.emulator["post", kmock.resource(GROUP, VERSION, PLURAL)][:1] << 503  # noqa: B015
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1"))
    assert e.value.status == 503
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("w1"))  # depleted

    mark = len(kube.requests)
    kube.fail("patch", rf".*/{PLURAL}/w1/status", 409, times=2, reason="Conflict", message="storm")
    for _ in range(2):
        with pytest.raises(ApiException) as e:
            custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, "default", PLURAL, "w1", {"status": {}}
            )
        assert e.value.status == 409 and status_of(e.value)["message"] == "storm"
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "w1", {"status": {"a": 1}}
    )
    assert kube.count_requests("PATCH", "/w1/status", since=mark) == 3
    assert [r.status for r in kube.requests[mark:]] == [409, 409, 200]
    assert kube.count_requests("GET", since=mark) == 0


def http(kube, method: str, path: str, body=None, headers=None) -> tuple[int, list[dict] | dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(kube.url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request) as response:
            text = response.read().decode()
            code = response.status
    except urllib.error.HTTPError as e:
        text, code = e.read().decode(), e.code
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    return code, lines if len(lines) != 1 else lines[0]


def test_initial_events_bookmark_tables_dry_run_and_deletecollection(kube, custom):
    base = f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}"
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, widget("a", size=7))
    code, events = http(kube, "GET", f"{base}?watch=1&sendInitialEvents=true&allowWatchBookmarks=true"
                        "&resourceVersionMatch=NotOlderThan&timeoutSeconds=1")  # fmt: skip
    assert code == 200 and [e["type"] for e in events[:2]] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    code, legacy = http(
        kube, "GET", f"/apis/{GROUP}/{VERSION}/watch/namespaces/default/{PLURAL}/a?timeoutSeconds=1"
    )
    assert (legacy["type"], legacy["object"]["metadata"]["name"]) == ("ADDED", "a")

    code, table = http(kube, "GET", base, headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    assert table["kind"] == "Table" and [c["name"] for c in table["columnDefinitions"]] == [
        "Name", "Ready", "Size", "Age"]  # fmt: skip
    assert table["rows"][0]["cells"][:3] == ["a", None, 7]

    code, dry = http(kube, "POST", f"{base}?dryRun=All", widget("b"), {"Content-Type": "application/json"})
    assert code == 201 and "resourceVersion" not in dry["metadata"]
    assert [i["metadata"]["name"] for i in custom.list_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL)["items"]] == ["a"]  # fmt: skip

    code, gone = http(kube, "DELETE", base)
    assert code == 200 and [i["metadata"]["name"] for i in gone["items"]] == ["a"]
    assert custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)["items"] == []


def test_builtin_delete_answers_a_success_status(kube, core):
    core.create_namespaced_config_map("default", {"metadata": {"name": "cm"}})
    status = core.delete_namespaced_config_map("cm", "default")
    assert status.status == "Success" and status.details.name == "cm"
    assert http(kube, "GET", "/api/v1/namespaces/default/configmaps/cm")[0] == 404


def test_custom_resources_are_pruned_defaulted_and_validated(kube, custom):
    client.ApiextensionsV1Api(kube.api_client()).create_custom_resource_definition(gadget_crd())
    args = (GROUP, VERSION, "default", "gadgets")
    body = {"apiVersion": API_VERSION, "kind": "Gadget", "metadata": {"name": "g1"},
            "spec": {"size": 2, "unknown": 1, "name": None, "extra": {"free": {"form": True}}}}  # fmt: skip
    created = custom.create_namespaced_custom_object(*args, body)
    assert created["spec"] == {"size": 2, "mode": "fast", "name": None, "extra": {"free": {"form": True}}}
    status = custom.patch_namespaced_custom_object_status(
        *args, "g1", {"status": {"phase": "Up", "bogus": 1}}
    )
    assert status["status"] == {"phase": "Up"}  # an undeclared status field is dropped, as a cluster does
    fast = custom.list_namespaced_custom_object(*args, field_selector="spec.mode=fast")["items"]
    assert [g["metadata"]["name"] for g in fast] == ["g1"]  # a CRD selectableField
    for spec, field in (({"size": 0}, "spec.size"), ({"mode": "slow"}, "spec.size"),
                        ({"size": 1, "mode": "warp"}, "spec.mode")):  # fmt: skip
        with pytest.raises(ApiException) as e:
            custom.create_namespaced_custom_object(*args, {**body, "metadata": {"name": "bad"}, "spec": spec})
        assert e.value.status == 422 and status_of(e.value)["details"]["causes"][0]["field"] == field
    with pytest.raises(ApiException) as e:
        custom.patch_namespaced_custom_object(*args, "g1", {"spec": {"size": "big"}})
    assert e.value.status == 422 and "spec.size" in status_of(e.value)["message"]
