"""One CUDA graph of several ``lora_apply`` launches (as a step's layers) over captured metadata, replayed for
new batches: each replay checked against its float64 reference. Shared by the GPU tests of the decode-time
kernels."""

from __future__ import annotations

import torch

from loraplane.kernels import lora_apply
from tests.kernels.lora_case import Case, make_case
from tests.kernels.pdl_producer import late_copy
from tests.kernels.test_ops import BAND, MIXED


def replay_checked(module: str, launches: int, batches: tuple[tuple[int, int], ...],
                   produced: bool = False) -> Case:  # fmt: skip
    """Capture ``launches`` applies of ``module`` over a 64-slot metadata, then replay for each (tokens,
    tokens per request) of ``batches``: every output within the bf16 band. Returns the captured case.
    ``produced``: inside the graph, x and y are written right before each apply by kernels that let the
    kernel after them start before they write (``pdl_producer.late_copy``); before each replay x, y and
    the shrink's scratch hold NaN, so an apply that reads x, y or v before its wait gives NaN."""
    first = make_case(num_tokens=40, num_adapters=30, ranks=MIXED, module=module, capture=True, capacity=64,
                      dtype=torch.bfloat16, device="cuda")  # fmt: skip
    x = first.x.clone()
    ys = [first.y0.clone() for _ in range(launches)]
    x_src, y_src = x.clone(), first.y0.clone()

    def step():
        for i, out in enumerate(ys):
            if produced:  # the write just ahead of the apply is y for even launches (its expand could start
                # before it lands), x for odd ones (its shrink could)
                writes = [(out, y_src), (x, x_src)] if i % 2 else [(x, x_src), (out, y_src)]
                for dst, src in writes:
                    late_copy(dst, src)
            lora_apply(out, x, first.pool, 0, module, first.meta)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n, per_req in batches:
        case = make_case(num_tokens=n, num_adapters=min(n, 40), ranks=MIXED, module=module, capture=True,
                         capacity=64, tokens_per_request=per_req, dtype=torch.bfloat16, device="cuda")  # fmt: skip
        _copy_pool(first.pool, case.pool)  # the new batch's weights into the captured tensors
        first.meta.build(_requests(case), case.pool.host_ranks())
        x.copy_(case.x)
        for out in ys:
            out.copy_(case.y0)
        if produced:
            x_src.copy_(case.x)
            y_src.copy_(case.y0)
            x.fill_(float("nan"))
            for out in ys:
                out.fill_(float("nan"))
            for buf in first.meta.scratch.values():
                buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = case.adapter_rows()
        for out in ys:
            err = ((out.cpu()[rows].double() - case.ref[rows]).norm() / case.ref[rows].norm()).item()
            assert err < BAND[torch.bfloat16], f"seed={case.seed}: rel err {err:.2e}"
    return first


def _copy_pool(dst, src) -> None:
    for key in dst.a:
        dst.a[key].copy_(src.a[key])
        dst.bt[key].copy_(src.bt[key])
    dst.page_table.copy_(src.page_table)
    dst.ranks.copy_(src.ranks)
    dst.scales.copy_(src.scales)


def _requests(case) -> list[tuple[int, int]]:
    """One request a row: the metadata groups rows by slot whatever the requests."""
    slots = case.meta.token_slot[: case.x.shape[0]].cpu().tolist()
    return [(s, 1) for s in slots]
