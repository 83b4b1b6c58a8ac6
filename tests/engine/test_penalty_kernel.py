"""The fused penalty kernel against its plain-torch reference (logits.apply_penalties), row by row."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from loraplane.engine.model.logits import apply_penalties  # noqa: E402
from loraplane.engine.model.penalty_kernel import penalize_  # noqa: E402

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
# Triton runs on CPU tensors only in its interpreter (tests/conftest.py turns it on where there is no GPU).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1"
)


def _case(S: int, R: int, V: int, rows: list[int], device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, V, generator=g) * 4  # both signs, so both repetition branches run
    prompt_mask = torch.rand(R, V, generator=g) < 0.1
    counts = torch.randint(0, 4, (R, V), generator=g, dtype=torch.int32) * (
        torch.rand(R, V, generator=g) < 0.1
    )
    slots = torch.randperm(R, generator=g)[: len(rows)]
    params = torch.rand(len(rows), 3, generator=g) * 2 - 0.5  # presence, frequency in [-0.5, 1.5)
    params[:, 2] = params[:, 2].abs() + 0.5  # repetition > 0, below and above 1
    table = torch.cat(
        [torch.tensor(rows, dtype=torch.float32)[:, None], slots.float()[:, None], params], dim=1
    )
    to = dict(device=device)
    return logits.to(**to), table.to(**to), prompt_mask.to(**to), counts.to(dtype=torch.int32, **to), slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "S,R,V,rows",
    [
        (4, 6, 300, [0, 1, 2, 3]),  # every row; V not a multiple of the block
        (5, 8, 2048 + 17, [4, 1]),  # some rows, out of order; two vocabulary blocks and a ragged tail
        (3, 3, 64, [2]),  # one row
    ],
)
def test_kernel_equals_reference_row_by_row(device, S, R, V, rows):
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU Triton needs TRITON_INTERPRET=1")
    logits, table, prompt_mask, counts, slots = _case(S, R, V, rows, device)
    want = logits.clone()
    for i, row in enumerate(rows):
        slot = int(slots[i])
        presence, frequency, repetition = table[i, 2:].unbind()
        want[row] = apply_penalties(want[row : row + 1], prompt_mask[slot : slot + 1], counts[slot : slot + 1],
                                    presence[None], frequency[None], repetition[None])[0]  # fmt: skip
    got = penalize_(logits.clone(), table, prompt_mask, counts, triton_=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    untouched = [r for r in range(S) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])  # rows without penalties keep their logits exactly


@needs_interpreter
def test_reference_path_equals_kernel_on_cpu():
    logits, table, prompt_mask, counts, _ = _case(5, 8, 500, [3, 0, 4], "cpu", seed=1)
    kernel = penalize_(logits.clone(), table, prompt_mask, counts, triton_=True)
    plain = penalize_(logits.clone(), table, prompt_mask, counts, triton_=False)
    torch.testing.assert_close(kernel, plain, rtol=1e-6, atol=1e-6)
    assert not torch.equal(plain, logits)  # the case really penalises something


@needs_interpreter
def test_empty_table_leaves_logits_alone():
    logits = torch.randn(2, 10)
    out = penalize_(logits.clone(), torch.zeros(0, 5), torch.zeros(1, 10, dtype=torch.bool),
                    torch.zeros(1, 10, dtype=torch.int32), triton_=True)  # fmt: skip
    assert torch.equal(out, logits)
