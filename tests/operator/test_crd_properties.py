"""Property tests: the model and the generated schema agree on every object, not only on a table.

Objects are generated from the committed CRD schema (crd_schema.instances), then, in the second test,
broken in one place (a value at or one past a bound, a pattern's match bent by one character, another
type, a junk string, a field removed or added). For each, the model accepts exactly when the API server (emulated: pruning,
defaults, OpenAPI, CEL) accepts; when both refuse, the model names a field the server names.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from loraplane.operator.crd_models import SpecError
from loraplane.operator.crd_objects import LoRAAdapter, LoRABase
from tests.operator.crd_schema import crd_schema, field_paths, instances, near_misses, node_at, server_errors

MODELS = {"LoRABase": LoRABase, "LoRAAdapter": LoRAAdapter}
# No shrinking: a failing object is small enough to read, and shrinking one can take minutes.
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
NAMES = st.one_of(
    st.from_regex(r"[a-z]([-a-z0-9]{0,70}[a-z0-9])?", fullmatch=True),
    st.text(max_size=70),
    st.just("chat." * 48 + "v1"),
)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=70),
    st.sampled_from(["", "s3://", "s3://b/p/", "hostPath", "gpu", "4Gi", "Bad_Name", "a" * 64, "x" * 1025]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.sampled_from(["name", "type", "uri", "zz"]), st.text(max_size=5), max_size=2),
)


def objects(kind: str) -> st.SearchStrategy:
    spec = instances(crd_schema(kind)["properties"]["spec"])
    return st.fixed_dictionaries(
        {
            "apiVersion": st.just("loraplane.dev/v1alpha1"),
            "kind": st.just(kind),
            "metadata": st.fixed_dictionaries({"name": NAMES}),
            "spec": spec,
        }  # fmt: skip
    )


def paths(value, prefix=()) -> list[tuple]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, sub in value.items():
            found += paths(sub, (*prefix, key))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            found += paths(sub, (*prefix, i))
    return found


def model_verdict(kind: str, obj: dict) -> list[str]:
    """[] when the model accepts ``obj``, else the paths it names."""
    try:
        MODELS[kind].parse(obj)
    except SpecError as exc:
        return [path for path, _ in exc.problems]
    return []


def check_agreement(kind: str, obj: dict) -> None:
    server = server_errors(kind, obj)
    model = model_verdict(kind, obj)
    assert bool(model) == bool(server), f"model says {model}, server says {server} for {obj}"
    if server:
        named = {path or "metadata.name" for path, _ in server}  # root rules are about metadata.name
        assert named & set(model), f"model names {model}, server names {sorted(named)}"


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_object_the_schema_shapes_is_judged_alike(kind):
    @SETTINGS
    @given(objects(kind))
    def run(obj):
        check_agreement(kind, obj)

    run()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_broken_object_is_refused_by_both_or_neither(kind):
    @SETTINGS
    @given(objects(kind), st.data())
    def run(obj, data):
        obj = copy.deepcopy(obj)
        where = data.draw(st.sampled_from(paths(obj)))
        *parents, last = where
        node = obj
        for key in parents:
            node = node[key]
        action = data.draw(st.sampled_from(["replace", "remove", "add"]))
        if action == "remove" and isinstance(node, dict):
            del node[last]
        elif action == "add" and isinstance(node, dict):
            node["zzUnknownField"] = data.draw(JUNK)
        else:
            schema = node_at(crd_schema(kind), where)
            edges = near_misses(schema) if schema else st.nothing()
            node[last] = data.draw(st.one_of(edges, JUNK) if schema else JUNK)
        check_agreement(kind, obj)

    run()


def test_schema_accepted_objects_parse_to_their_values():
    @SETTINGS
    @given(objects("LoRAAdapter"))
    def run(obj):
        if not server_errors("LoRAAdapter", obj):
            spec = LoRAAdapter.parse(obj).spec
            assert spec.uri == obj["spec"]["source"]["uri"] and spec.version == obj["spec"]["version"]

    run()


EXAMPLES = {
    "LoRABase": {"apiVersion": "loraplane.dev/v1alpha1", "kind": "LoRABase", "metadata": {"name": "demo"},
                 "spec": {"model": {"uri": "s3://m/", "sha256": "a" * 64}}},
    "LoRAAdapter": {"apiVersion": "loraplane.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "chat"},
                    "spec": {"baseRef": {"name": "demo"}, "source": {"uri": "s3://b/p/"}, "version": "v1"}},
}  # fmt: skip
FIELDS = [
    (kind, where) for kind in sorted(MODELS) for where in field_paths(crd_schema(kind)["properties"]["spec"])
]


@pytest.mark.parametrize(("kind", "where"), FIELDS, ids=[".".join(map(str, w)) for _, w in FIELDS])
def test_each_field_at_its_edges_is_judged_alike(kind, where):
    """Every field, one at a time: its bounds and one past them, bent patterns, other types, valid values."""
    spec_schema = crd_schema(kind)["properties"]["spec"]
    leaf = node_at(spec_schema, where)

    @settings(SETTINGS, max_examples=20)
    @given(st.data())
    def run(data):
        obj = copy.deepcopy(EXAMPLES[kind])
        node = obj["spec"]
        for depth, key in enumerate(where[:-1]):
            if isinstance(node, dict) and key not in node or isinstance(node, list) and not node:
                value = data.draw(instances(node_at(spec_schema, where[: depth + 1])))
                node.__setitem__(key, value) if isinstance(node, dict) else node.append(value)
            node = node[key]
        value = data.draw(st.one_of(near_misses(leaf), instances(leaf), JUNK))
        if isinstance(node, list):
            node[:] = [value]
        else:
            node[where[-1]] = value
        check_agreement(kind, obj)

    run()
