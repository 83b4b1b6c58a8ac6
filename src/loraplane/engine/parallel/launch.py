"""The process model: rank 0 (this process) hosts the scheduler, the HTTP front and sampling; N-1 spawned
workers each own one device and run the same forward on their shard.

Startup is symmetric: every rank builds its ModelRunner (load, KV sizing, kernel warm-up, graph capture) and
so issues the same collectives in the same order. Then rank 0 broadcasts each step's prepared inputs and the
workers loop on ``receive -> forward``. Workers die with the driver: each watches its parent's sentinel and
exits when the parent is gone, however it ended (a SIGKILL included); ``close`` (also at exit) stops them.
``kill -USR1`` on a worker prints its Python stacks to its stderr (where a group is stuck, and on which call).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from datetime import timedelta
from multiprocessing.connection import wait

import torch

from loraplane.engine.core.errors import EngineFault
from loraplane.engine.model.runner import ModelRunner, resolve_device
from loraplane.engine.parallel import lora_sync, step_sync
from loraplane.engine.parallel.group import (
    SERVING_TIMEOUT,
    TPGroup,
    destroy_group,
    init_group,
    release_graphs,
)

log = logging.getLogger("loraplane.engine.tp")

# Joining the group and loading a shard; afterwards the group waits as long as the server idles.
STARTUP_TIMEOUT = timedelta(minutes=10)
_STOP_GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving_timeout() -> None:
    from torch.distributed import distributed_c10d

    if hasattr(distributed_c10d, "_set_pg_timeout"):
        distributed_c10d._set_pg_timeout(SERVING_TIMEOUT)


class TPDriver:
    """Rank 0's side: sends each step to the workers, watches them, stops them."""

    def __init__(self, tp: TPGroup, workers: list[mp.Process]) -> None:
        self.tp, self.workers = tp, workers
        self.lock = threading.Lock()  # one sender at a time: the collectives' order is the protocol
        self.failed: str | None = None  # why the group can no longer step
        self.closed = False
        self.sent = False  # the current forward was sent to the workers
        self.runner: ModelRunner | None = None  # rank 0's, once built: its graphs go before the group
        threading.Thread(target=self._watch, name="loraplane-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        ready = wait([w.sentinel for w in self.workers])
        if not self.closed:
            gone = [w for w in self.workers if w.sentinel in ready]
            for w in gone:
                w.join(1.0)  # reap it, for its exit code
            dead = [f"{w.name} (exit code {w.exitcode})" for w in gone]
            self.failed = f"tensor-parallel worker died: {', '.join(dead)}"
            log.error("%s; the engine cannot step any more", self.failed)
            if (
                self.tp.device.type == "cuda"
            ):  # an NCCL collective waiting for the dead peer would never return
                from torch.distributed import distributed_c10d

                try:
                    distributed_c10d._abort_process_group()
                except Exception:  # noqa: BLE001 - best effort; the engine is failed either way
                    log.exception("aborting the NCCL group failed")

    def guard(self, forward):
        """Wrap a runner method that sends a step and runs it. A failure before the send is the step's own
        (the engine may retry parts of it); after the send the workers are inside a forward rank 0 left, so
        the group is out of step for good: EngineFault stops the engine."""

        def run(*args, **kwargs):
            self.sent = False
            try:
                return forward(*args, **kwargs)
            except Exception as error:
                if not self.sent or isinstance(error, EngineFault):
                    raise
                self.failed = f"rank 0 failed inside a tensor-parallel step: {error!r}"
                raise EngineFault(self.failed) from error

        return run

    def _check(self) -> None:
        if self.failed is not None or self.closed:
            raise EngineFault(self.failed or "tensor-parallel group is closed")

    def send_step(self, inp, batch, kind: str, lora) -> None:
        """The step's inputs and, with adapters, each chunk's adapter slots (after prepare_step)."""
        self._check()
        lora_kind, table = lora_sync.step_slots(lora, batch, kind)
        header, payload = step_sync.encode_step(inp, len(batch.chunks), lora_kind, table)
        with self.lock:
            self.sent = True
            step_sync.send(self.tp, header, payload)

    def send_op(self, op: int, info: list[int], tensors) -> None:
        self._check()
        with self.lock:
            try:
                step_sync.send_op(self.tp, op, info, tensors)
            except Exception as error:  # a move half sent: the pools of the ranks may differ now
                self.failed = f"adapter move to the tensor-parallel workers failed: {error!r}"
                raise EngineFault(self.failed) from error

    def close(self) -> None:
        """Stop the workers and leave the group: rank 0 drops its graphs, sends stop and leaves the group
        while the workers do the same (a communicator destroy may wait for its peers), then joins them,
        terminating (then killing) any still alive after a grace period."""
        if self.closed:
            return
        self.closed = True
        if self.runner is not None:  # a failed group may never finish its last step: do not wait for it
            release_graphs(self.runner, wait=self.failed is None)
        if self.failed is None:
            try:
                with self.lock:
                    step_sync.send(self.tp, step_sync.stop_header())
            except (RuntimeError, EngineFault) as exc:  # a worker already gone: fall through to terminate
                log.warning("tensor-parallel stop message failed: %s", exc)
        destroy_group()
        for w in self.workers:
            w.join(_STOP_GRACE_S)
            if w.is_alive():
                w.terminate()
                w.join(_STOP_GRACE_S)
            if w.is_alive():
                w.kill()
                w.join()


def start_tp_runner(config) -> ModelRunner:
    """Spawn ranks 1..N-1, join as rank 0 and build this rank's ModelRunner; its ``tp_driver`` sends steps."""
    size = config.tensor_parallel_size
    if torch.distributed.is_initialized():
        raise RuntimeError(
            "EngineConfig.tensor_parallel_size: this process already drives a tensor-parallel group"
        )
    device = resolve_device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"EngineConfig.tensor_parallel_size: {size} needs {size} GPUs, {torch.cuda.device_count()} visible"
        )
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")  # never fork a process that holds torch threads or a CUDA context
    workers = [
        ctx.Process(
            target=worker_main,
            args=(config, rank, size, init_method, torch.get_num_threads()),
            name=f"loraplane-tp-rank{rank}",
            daemon=True,
        )  # fmt: skip
        for rank in range(1, size)
    ]
    for w in workers:
        w.start()
    driver = None
    try:
        tp = init_group(0, size, init_method, device, STARTUP_TIMEOUT)
        driver = TPDriver(tp, workers)
        runner = ModelRunner(config, tp=tp)
        _serving_timeout()
    except BaseException:
        if driver is not None:
            driver.closed = True  # the watcher must not report the workers killed below
        for w in workers:
            w.kill()
            w.join()
        gc.collect()  # a half-built runner's graphs hold the communicator (see release_graphs)
        destroy_group()
        raise
    runner.tp_driver, driver.runner = driver, runner
    runner.forward_logits = driver.guard(runner.forward_logits)
    runner.warm_adapter = driver.guard(runner.warm_adapter)
    if runner.lora is not None:
        runner.lora.gpu.mirror = lora_sync.AdapterMirror(driver, runner.lora.model_config)
    atexit.register(driver.close)
    return runner


def _exit_with_parent() -> None:
    parent = mp.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(0)  # the driver is gone; nothing here is worth finishing


def worker_main(config, rank: int, size: int, init_method: str, num_threads: int) -> None:
    """Rank ``rank``: build the shard, then run every step rank 0 sends until it says stop."""
    threading.Thread(target=_exit_with_parent, name="loraplane-tp-parent", daemon=True).start()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(num_threads)
    tp = init_group(rank, size, init_method, resolve_device(config.device), STARTUP_TIMEOUT)
    runner = ModelRunner(config, tp=tp)
    _serving_timeout()
    with torch.inference_mode():
        while True:
            header, payload = step_sync.receive(tp)
            op = header[0]
            if op == step_sync.OP_STOP:
                break
            if op == step_sync.OP_COPY:
                lora_sync.apply_copy(runner, tp, runner.lora.model_config, payload.tolist())
            elif op == step_sync.OP_EVICT:
                lora_sync.apply_evict(runner, payload.tolist())
            else:
                inp, num_chunks, table = step_sync.decode_step(header, payload)
                lora_sync.set_step_metas(runner, header[-1], table)
                run_step(runner, inp, num_chunks, header[-1])
    release_graphs(runner)
    if not destroy_group():
        os._exit(0)  # the group is stuck; nothing in this process is worth finishing


def run_step(runner: ModelRunner, inp, num_chunks: int, lora_kind: int) -> torch.Tensor:
    """The forward rank 0 runs for the same inputs (ModelRunner.forward_logits' choice of path)."""
    graphs, meta = runner.graphs, inp.meta
    if inp.decode_only and graphs is not None and num_chunks <= graphs.max_batch_size:
        if lora_kind == 0 and runner.base_graphs is not None:
            graphs = runner.base_graphs  # a step without adapters: the graphs without LoRA launches
        return graphs.run(inp.input_ids, inp.positions, meta.slot_mapping, meta.seq_lens, meta.block_tables)
    return runner.model(inp.input_ids, inp.positions, meta, inp.logits_indices)
