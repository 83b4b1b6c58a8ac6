"""The heuristic launch shape of eager prefill launches (``pick_config`` on 64-row tiles): the shrink splits
K until every SM has a program, but never below two splits nor below four K tiles a program."""

from __future__ import annotations

import pytest
import torch

from loraplane.kernels import LoRABatchMeta, launch_config
from loraplane.kernels.launch_config import num_sms, pick_config, prefill_split_bounds

RANKS = [16] * 8


def _prefill(tokens_per_adapter: int, adapters: int) -> LoRABatchMeta:
    meta = LoRABatchMeta(8192, "cpu", tile_m=64, max_rank=64)
    return meta.build([(s, tokens_per_adapter) for s in range(adapters)], RANKS)


@pytest.mark.parametrize(("tokens", "adapters", "in_dim"), [(10, 1, 4096), (256, 8, 4096), (256, 8, 14336),
                                                           (64, 2, 256), (2048, 2, 4096)])  # fmt: skip
def test_prefill_shrink_splits_until_every_sm_has_a_program(tokens, adapters, in_dim):
    meta = _prefill(tokens, adapters)
    cfg = pick_config(meta, in_dim, (4096,), torch.bfloat16)
    tiles, sms = meta.host_num_tiles, num_sms(meta.device)
    assert cfg.split_k >= 2
    if cfg.split_k > 2:  # it split further only while some SM had no program
        assert tiles * cfg.split_k // 2 < sms
    room = in_dim // (cfg.split_k * 2) >= 4 * cfg.block_k  # one more split keeps 4 K tiles a program
    assert tiles * cfg.split_k >= sms or not room or cfg.split_k == 16


def test_a_prefill_of_one_short_request_splits_more_than_a_long_batch():
    short = pick_config(_prefill(10, 1), 4096, (4096,), torch.bfloat16)
    long = pick_config(_prefill(2048, 2), 4096, (4096,), torch.bfloat16)
    assert short.split_k > long.split_k == 2


@pytest.mark.parametrize("sms", [4, 78, 132])
def test_split_bounds_are_where_the_prefill_split_changes(sms, monkeypatch):
    """``prefill_split_bounds`` (what the warm-up compiles for) lists exactly the tile counts at which
    pick_config's prefill split changes, on a K wide enough never to cap it."""
    monkeypatch.setattr(launch_config, "_num_sms", lambda device: sms)
    split = [pick_config(_prefill(64 * t, 1), 1 << 16, (4096,), torch.bfloat16).split_k for t in range(1, 70)]
    changes = {t + 1 for t in range(1, len(split)) if split[t] != split[t - 1]}
    assert changes == {b for b in prefill_split_bounds(sms) if 1 < b <= len(split)}
