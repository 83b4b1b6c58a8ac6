"""The captured decode launches' table (``DECODE_TABLE``) and the capture policy's switches: which
launches take the measured fields and which keep the occupancy rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplane.kernels import LoRABatchMeta
from loraplane.kernels.launch_config import (
    DECODE_TABLE,
    DECODE_TABLE_MIN_CAPACITY,
    CapturePolicy,
    capture_policy,
    pick_config,
    set_capture_policy,
)

SHAPES = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


@pytest.fixture
def policy():
    """Set capture-policy fields for one test, over the general kernels (the table shapes them, not the
    decode kernels); the old policy comes back after it."""
    old = capture_policy()

    def set_fields(**fields):
        set_capture_policy(**{**dataclasses.asdict(old), "decode": False, **fields})

    yield set_fields
    set_capture_policy(**dataclasses.asdict(old))


def _cfg(shape, *, capture=True, capacity=64):
    meta = LoRABatchMeta(capacity, "cpu", tile_m=16, capture=capture, max_rank=64)
    return pick_config(meta, shape[0], shape[1], torch.bfloat16)


@pytest.mark.parametrize("name", list(SHAPES))
def test_captured_launches_take_the_table(policy, name):
    shape = SHAPES[name]
    policy(table=False)
    rule = _cfg(shape)
    policy(table=True)
    tuned = _cfg(shape)
    want = DECODE_TABLE.get(shape, {})
    for field in ("n_chunk", "block_n"):
        assert getattr(tuned, field) == want.get(field, getattr(rule, field)), field
    assert tuned.split_k == rule.split_k and tuned.block_k == rule.block_k


def test_the_table_changes_what_it_lists(policy):
    """Each entry differs from the occupancy rule at the measured capacity (else it would be dead)."""
    for shape in DECODE_TABLE:
        policy(table=False)
        rule = _cfg(shape)
        policy(table=True)
        assert _cfg(shape) != rule, shape


@pytest.mark.parametrize(
    "kwargs",
    [dict(capture=False), dict(capacity=DECODE_TABLE_MIN_CAPACITY // 4)],
    ids=["uncaptured", "small"],
)
def test_other_launches_keep_the_occupancy_rule(policy, kwargs):
    shape = SHAPES["qkv"]
    policy(table=False)
    rule = _cfg(shape, **kwargs)
    policy(table=True)
    assert _cfg(shape, **kwargs) == rule


def test_a_policy_chunk_wins_over_the_table(policy):
    policy(n_chunk=512)
    assert _cfg(SHAPES["qkv"]).n_chunk == 512


def test_fused_policy_turns_on_one_launch_for_captured_launches_only(policy):
    policy(fused=True)
    assert _cfg(SHAPES["o"]).one_launch
    assert not _cfg(SHAPES["o"], capture=False).one_launch
    policy(fused=False)
    assert not _cfg(SHAPES["o"]).one_launch


@pytest.mark.parametrize("field", ["table", "fused"])
def test_switches_must_be_bools(field):
    with pytest.raises(ValueError, match=f"CapturePolicy.{field}"):
        CapturePolicy(**{field: 1})


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1"])
def test_expand_beside_is_a_size(bad):
    with pytest.raises(ValueError, match="CapturePolicy.expand_beside"):
        CapturePolicy(expand_beside=bad)
