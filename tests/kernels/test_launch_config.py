"""The heuristic launch shape of eager prefill launches (``pick_config`` on 64-row tiles): the shrink splits
K until every SM has a program, but never below two splits nor below four K tiles a program."""

from __future__ import annotations

import pytest
import torch

from loraplane.kernels import LoRABatchMeta
from loraplane.kernels.launch_config import _num_sms, pick_config

RANKS = [16] * 8


def _prefill(tokens_per_adapter: int, adapters: int) -> LoRABatchMeta:
    meta = LoRABatchMeta(4096, "cpu", tile_m=64, max_rank=64)
    return meta.build([(s, tokens_per_adapter) for s in range(adapters)], RANKS)


@pytest.mark.parametrize(("tokens", "adapters", "in_dim"), [(10, 1, 4096), (256, 8, 4096), (256, 8, 14336),
                                                           (64, 2, 256), (2048, 2, 4096)])  # fmt: skip
def test_prefill_shrink_splits_until_every_sm_has_a_program(tokens, adapters, in_dim):
    meta = _prefill(tokens, adapters)
    cfg = pick_config(meta, in_dim, (4096,), torch.bfloat16)
    tiles, sms = meta.host_num_tiles, _num_sms(meta.device)
    assert cfg.split_k >= 2
    if cfg.split_k > 2:  # it split further only while some SM had no program
        assert tiles * cfg.split_k // 2 < sms
    room = in_dim // (cfg.split_k * 2) >= 4 * cfg.block_k  # one more split keeps 4 K tiles a program
    assert tiles * cfg.split_k >= sms or not room or cfg.split_k == 16


def test_a_prefill_of_one_short_request_splits_more_than_a_long_batch():
    short = pick_config(_prefill(10, 1), 4096, (4096,), torch.bfloat16)
    long = pick_config(_prefill(2048, 2), 4096, (4096,), torch.bfloat16)
    assert short.split_k > long.split_k == 2
