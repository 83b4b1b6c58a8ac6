"""The tensor-parallel process group: who this rank is, and the few collectives the model needs.

One process per device; gloo on CPU, NCCL on CUDA, through the same calls. Rank 0 is the driver (scheduler,
HTTP front, sampling); ranks 1..N-1 are workers that run the same forward on their shard. Every collective
here is issued by all ranks in the same order; that order is the whole protocol.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loraplane.engine.model.model_config import ModelConfig

log = logging.getLogger("loraplane.engine.tp")

# Workers block in a broadcast while the server idles; the group's timeout must outlast any idle period.
# A dead peer is noticed by its closed connection (gloo) or by the driver's worker monitor, not by timeouts.
SERVING_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    size: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------------------------- collectives
    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place (row-parallel outputs, the vocab-parallel embedding)."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n] per rank -> [S, size * n], rank r's columns at [r n, (r+1) n) (vocab-parallel logits)."""
        parts = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)  # [size, S, n]
        dist.all_gather(list(parts.unbind(0)), x.contiguous())
        return parts.permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""
        dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over ranks (KV blocks: every rank must page the same block ids)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(rank: int, size: int, init_method: str, device: torch.device,
               timeout: timedelta = SERVING_TIMEOUT) -> TPGroup:  # fmt: skip
    """Join the default process group as ``rank`` of ``size``; on CUDA, rank r uses device r."""
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    if backend_for(device) == "gloo":  # one host: loopback, whatever the host name resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    return TPGroup(rank, size, device)


def release_graphs(runner, wait: bool = True) -> None:
    """Drop ``runner``'s CUDA graphs (and, with ``wait``, wait for the device). NCCL's destroy waits until
    every graph that captured one of its collectives is gone (the graphs hold references on the
    communicator), so a rank must do this before ``destroy_group``; the runner steps eagerly afterwards."""
    runner.graphs = runner.base_graphs = runner.module_graphs = None
    gc.collect()
    if wait and runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def destroy_group(timeout_s: float = 30.0) -> bool:
    """Leave the group (after ``release_graphs``); True once left. The wait is bounded so that a process on
    its way out never hangs on a communicator something still holds; False then, and the group stays."""
    if not dist.is_initialized():
        return True
    done, errors = threading.Event(), []

    def leave() -> None:
        try:
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001 - reported below, by the caller's thread
            errors.append(error)
        finally:
            done.set()

    threading.Thread(target=leave, name="loraplane-tp-leave", daemon=True).start()
    if not done.wait(timeout_s):
        log.error("leaving the tensor-parallel group took over %.0f s; left as it is", timeout_s)
        return False
    if errors:
        log.error("leaving the tensor-parallel group failed: %r", errors[0])
    return not errors


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a model whose heads or MLP width do not split evenly over ``size`` ranks, naming the field."""
    for field, value in (
        ("num_attention_heads", cfg.num_heads),
        ("num_key_value_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if value % size:
            raise ValueError(
                f"EngineConfig.tensor_parallel_size: {size} does not divide the model's {field} ({value})"
            )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank runs: its heads and its MLP columns. The vocabulary stays whole in the config (the
    logits are gathered); the vocab-parallel modules know their own rows."""
    check_divisible(cfg, size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )
