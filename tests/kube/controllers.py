"""What the built-in controllers of a real cluster would do, done synchronously inside the store.

- apiextensions: a created CRD is validated, registered for discovery and serving, and marked
  NamesAccepted + Established at once; a deleted CRD takes its custom objects with it;
- garbage collector: dependents of a removed owner (by ownerReference uid) are deleted, or orphaned
  under propagationPolicy=Orphan; a dependent with another live owner only loses the reference;
  a dependent written with no present owner (wrong uid, name, kind or namespace) is deleted at once;
- namespace controller: a deleted namespace (Terminating) deletes its contents and goes once empty;
- defaulting that clients rely on: namespace phase and labels, pod phase, Secret stringData -> data,
  Service type and clusterIP.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from tests.kube.errors import ApiError, now_rfc3339
from tests.kube.patching import clone
from tests.kube.resources import ResourceType, type_from_crd

if TYPE_CHECKING:
    from tests.kube.store import Store

CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY = ("", "namespaces")


class Controllers:
    """Mixed into Store; every method runs under the store's lock."""

    def _on_create_defaults(
        self: Store, rt: ResourceType, obj: dict[str, Any], dry_run: bool = False
    ) -> None:
        if rt.key == NAMESPACE_KEY:
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        elif rt.key == ("", "pods"):
            obj["status"] = {"phase": "Pending"}
        elif rt.key == ("", "secrets"):
            fold_string_data(obj)
        elif rt.key == ("", "services"):
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if "clusterIP" not in spec:  # a real allocator; the emulator counts from its resourceVersion
                spec["clusterIP"] = (
                    f"10.96.{self.resource_version // 250 % 250}.{self.resource_version % 250 + 1}"
                )
            spec.setdefault("clusterIPs", [spec["clusterIP"]])
        elif rt.key == CRD_KEY:
            self._register_crd(obj, dry_run)

    def _register_crd(self: Store, crd: dict[str, Any], dry_run: bool = False) -> None:
        try:
            new_type = type_from_crd(crd)
        except (KeyError, ValueError, TypeError) as e:
            raise ApiError(
                422, "Invalid", f'CustomResourceDefinition "{crd["metadata"]["name"]}" is invalid: {e}'
            ) from e
        expected = f"{new_type.plural}.{new_type.group}"
        if crd["metadata"]["name"] != expected:
            raise ApiError(
                422,
                "Invalid",
                f'CustomResourceDefinition "{crd["metadata"]["name"]}" is invalid: '
                f'metadata.name: Invalid value: must be spec.names.plural+"."+spec.group ({expected})',
            )
        existing = self.types.get(new_type.key)
        if existing is not None and not existing.is_custom:
            raise ApiError(422, "Invalid", f"{expected} collides with a built-in resource")
        if not dry_run:
            self.types[new_type.key] = new_type
        names = crd["spec"]["names"]
        accepted = {
            **names,
            "singular": new_type.singular,
            "listKind": names.get("listKind", names["kind"] + "List"),
        }
        stamp = now_rfc3339()
        crd["status"] = {
            "acceptedNames": accepted,
            "storedVersions": [new_type.versions[0]],
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": stamp,
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": stamp,
                },
            ],
        }

    def _unregister_crd(self: Store, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        type_key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
        rt = self.types.get(type_key)
        if rt is None or not rt.is_custom:
            return
        for key in [k for k in self.objects if k[0] == type_key]:
            gone = clone(self.objects[key])
            gone["metadata"]["resourceVersion"] = self._next_rv()
            self._remove(rt, key, gone)
        del self.types[type_key]

    def _collect_dependents(self: Store, owner_uid: str, orphan: bool) -> None:
        live_uids = {o["metadata"]["uid"] for o in self.objects.values()}
        for (type_key, ns, name), obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == owner_uid for r in refs):
                continue
            rt = self.types[type_key]
            remaining = [r for r in refs if r.get("uid") != owner_uid]
            if orphan or any(r.get("uid") in live_uids for r in remaining):
                self.update(rt, ns, name, lambda o, rest=remaining: with_owner_refs(o, rest))
            elif (type_key, ns, name) in self.objects:
                self.delete(rt, ns, name, {"propagationPolicy": "Background"})

    def _collect_if_owners_absent(self: Store, rt: ResourceType, namespace: str, name: str) -> None:
        """The GC deletes a dependent whose every owner is absent (wrong uid, name or namespace)."""
        obj = self.objects.get((rt.key, namespace, name))
        refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
        if refs and not any(self._owner_present(ref, namespace) for ref in refs):
            self.delete(rt, namespace, name, {"propagationPolicy": "Background"})

    def _owner_present(self: Store, ref: dict[str, Any], namespace: str) -> bool:
        try:
            owner_type = self.type_by_kind(ref.get("apiVersion", ""), ref.get("kind", ""))
        except KeyError:
            return True  # an unmappable owner kind: the real GC leaves such dependents alone
        if owner_type.namespaced and not namespace:
            return False  # a cluster-scoped dependent cannot have a namespaced owner
        owner = self.objects.get(
            (owner_type.key, namespace if owner_type.namespaced else "", ref.get("name", ""))
        )
        return owner is not None and owner["metadata"]["uid"] == ref.get("uid")

    def _drain_namespace(self: Store, namespace: str) -> None:
        """Namespace deletion: delete its contents; release the namespace once it is empty."""
        for (type_key, ns, name), obj in list(self.objects.items()):
            if (
                ns == namespace
                and (type_key, ns, name) in self.objects
                and not obj["metadata"].get("deletionTimestamp")
            ):
                self.delete(self.types[type_key], ns, name)
        if not any(ns == namespace for (_, ns, _) in self.objects):
            ns_key = (NAMESPACE_KEY, "", namespace)
            if ns_key in self.objects:
                gone = clone(self.objects[ns_key])
                gone["metadata"]["resourceVersion"] = self._next_rv()
                self._remove(self.types[NAMESPACE_KEY], ns_key, gone)


def fold_string_data(secret: dict[str, Any]) -> None:
    """Secrets' write-only stringData is base64-encoded into data, as the API server does."""
    for key, value in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[key] = base64.b64encode(str(value).encode()).decode()
    secret.setdefault("type", "Opaque")


def with_owner_refs(obj: dict[str, Any], refs: list[dict[str, Any]]) -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = refs
    obj["metadata"].pop("resourceVersion", None)
    return obj
