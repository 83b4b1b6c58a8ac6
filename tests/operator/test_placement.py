"""spec.placement: an adapter on fewer than all pods of its base. The choice (pure), the spec's rules, and the
real operator against the real control plane moving an adapter as its placement grows and shrinks."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import pytest

from loraplane.operator import placement
from loraplane.operator.crd_models import AdapterSpec, Placement, SpecError
from tests.operator.harness import OperatorThread, wait_for


@dataclass(frozen=True)
class Pod:
    name: str


PODS = [Pod(f"demo-{i}") for i in range(8)]


def test_counts_from_replicas_or_share():
    assert Placement.parse({}).pods(5) == 5  # default: every ready pod
    assert Placement.parse({"replicas": 2}).pods(5) == 2
    assert Placement.parse({"replicas": 9}).pods(5) == 5  # never more than there are
    assert Placement.parse({"share": 50}).pods(5) == 3  # rounded up
    assert Placement.parse({"share": 1}).pods(5) == 1  # at least one
    assert Placement.parse({"share": 100}).pods(0) == 0


@pytest.mark.parametrize(
    ("placement_", "field"),
    [({"replicas": 0}, "spec.placement.replicas"), ({"share": 101}, "spec.placement.share"),
     ({"replicas": 1, "share": 50}, "spec.placement")],
)  # fmt: skip
def test_bad_placements_name_the_field(placement_, field):
    spec = {
        "baseRef": {"name": "demo"},
        "source": {"uri": "s3://a/b/"},
        "version": "v1",
        "placement": placement_,
    }
    with pytest.raises(SpecError) as caught:
        AdapterSpec.parse(spec)
    assert caught.value.field == field, caught.value


def test_choice_is_stable_and_grows_by_adding():
    two = placement.choose("chat", PODS, 2)
    assert placement.choose("chat", list(reversed(PODS)), 2) == two  # the order pods are listed in is moot
    assert placement.choose("chat", PODS, 4)[:2] == two  # a more popular adapter keeps its first pods
    gone = [p for p in PODS if p != two[1]]
    assert two[0] in placement.choose("chat", gone, 2)  # a pod leaving moves only what ranked it


def test_adapters_spread_evenly_and_few_move_when_a_pod_joins():
    names = [f"adapter-{i}" for i in range(2000)]
    load = collections.Counter(p.name for n in names for p in placement.choose(n, PODS, 2))
    assert max(load.values()) < 1.15 * (2000 * 2 / len(PODS))  # within 15% of an even share
    before = {n: set(placement.choose(n, PODS, 2)) for n in names}
    after = {n: set(placement.choose(n, [*PODS, Pod("demo-new")], 2)) for n in names}
    moved = sum(len(before[n] - after[n]) for n in names)
    assert moved < 1.2 * 2000 * 2 / (len(PODS) + 1)  # only what the new pod now ranks first: 2 in 9


def test_operator_loads_where_placed_and_moves_with_the_spec(world, artifacts):  # noqa: F811
    world.create_base(replicas=2)
    with OperatorThread(world):
        pods = [world.add_pod(), world.add_pod()]
        world.create_adapter("chat", artifacts.uris["v1"], "v1", placement={"replicas": 1})
        adapter = world.wait_ready("chat", version="v1")
        holders = [p for p in pods if p.serving("chat") == "v1"]
        assert len(holders) == 1
        status = adapter["status"]
        assert status["desiredPods"] == 1 and status["readyPods"] == 1 and len(status["pods"]) == 1
        world.api("PATCH", "LoRAAdapter", "chat", {"spec": {"placement": {"replicas": 2}}})
        wait_for(lambda: sum(p.serving("chat") == "v1" for p in pods) == 2, what="a second pod serves chat")
        assert holders[0].serving("chat") == "v1"  # the first pod keeps it
        wait_for(lambda: world.adapter("chat")["status"].get("desiredPods") == 2, what="status says 2 pods")
        world.api("PATCH", "LoRAAdapter", "chat", {"spec": {"placement": {"replicas": 1}}})
        wait_for(
            lambda: [p for p in pods if p.versions("chat")] == holders, what="back on the first pod only"
        )
        wait_for(
            lambda: len(world.adapter("chat")["status"].get("pods", [])) == 1, what="status lists one pod"
        )
