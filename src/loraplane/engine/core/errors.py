"""The engine's failures, sorted by whom they stop: one request, or the whole engine.

Torch-free and importing nothing of ours, so the engine loop, the tensor-parallel driver and the HTTP side can
all name them without importing each other.
"""

from __future__ import annotations

_DEVICE_FAULT_TYPES = {"AcceleratorError", "CudaError", "OutOfMemoryError", "DeferredCudaCallError"}
_DEVICE_FAULT_TEXT = ("CUDA error", "CUDA out of memory", "device-side assert", "CUBLAS_STATUS", "cuDNN")


class RequestError(RuntimeError):
    """One request failed inside an engine step; the engine went on with the others."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r} failed in the engine: {message}")
        self.request_id = request_id


class EngineFault(RuntimeError):
    """A failure of the engine itself (a broken invariant), never blamed on a request: it stops the engine."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it failed, or the engine was closed); no more outputs will come."""


def is_device_fault(error: BaseException) -> bool:
    """A fault of the accelerator itself (its context is no longer trustworthy): it stops the engine."""
    if any(cls.__name__ in _DEVICE_FAULT_TYPES for cls in type(error).__mro__):
        return True
    return any(text in str(error) for text in _DEVICE_FAULT_TEXT)
