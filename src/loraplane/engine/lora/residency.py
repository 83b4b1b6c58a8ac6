"""What the scheduler needs to know of adapter residency (torch-free).

The adapter side (the runner's adapter manager) implements ``AdapterResidency``; the scheduler admits a
sequence only when its adapter is ready on the device, asks for the rest to be loaded in the background,
and holds every adapter a running sequence uses so it is never evicted under it.
"""

from __future__ import annotations

from typing import Protocol


class AdapterResidency(Protocol):
    def is_ready(self, key: str) -> bool:
        """True when ``key`` ("name@version") is resident on the device and usable in this step."""
        ...

    def request(self, key: str) -> None:
        """A waiting request needs ``key``: start loading it in the background. Idempotent; never blocks.
        Called again every step while it is not ready. Raises (e.g. AdapterError) when ``key`` can never be
        ready (unknown, unloaded, failed to load): the requests waiting for it then fail with that error."""
        ...

    def acquire(self, key: str) -> None:
        """A sequence using ``key`` was admitted: it must not be evicted until the matching release()."""
        ...

    def release(self, key: str) -> None:
        """That sequence finished, was aborted or was preempted."""
        ...

    def digest(self, key: str) -> str:
        """The identity that keys prefix-cache blocks (the manifest digest); KeyError when unknown."""
        ...

    @property
    def max_adapters_per_step(self) -> int:
        """The most distinct adapters one step may carry."""
        ...


class NullResidency:
    """No adapters served: nothing to load, everything ready."""

    max_adapters_per_step = 1 << 30

    def is_ready(self, key: str) -> bool:
        return True

    def request(self, key: str) -> None:
        pass

    def acquire(self, key: str) -> None:
        pass

    def release(self, key: str) -> None:
        pass

    def digest(self, key: str) -> str:
        raise KeyError(key)
