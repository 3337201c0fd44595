"""The device runtime seam: streams, events, capture state, pinned host memory, fences.

Everything the mirror path asks of CUDA *besides* plain torch ops goes through one
``DeviceRuntime`` object, chosen when ``MTPMetadata.allocate`` runs:

* ``host_empty(shape, dtype)`` -- page-locked host memory for staging (pinned when CUDA
  is present), so ``non_blocking`` copies from it are truly asynchronous;
* ``is_host(tensor)`` -- whether a tensor lives in host memory (then the mirror path
  stages it through pinned memory before an async copy, never copying pageable memory
  ``non_blocking``);
* ``fence(device)`` -- a ``CopyFence`` that marks when the device stops reading a
  staging slot (the fence factory of the staging rings);
* ``event(device)`` / ``current_stream(device)`` -- what a fence records, and where;
* ``is_capturing(device)`` -- whether the device's current stream is capturing a CUDA
  graph (ring-using calls refuse to run then: a capture would bake a pinned slot and
  a host-side decision into the graph).

``TorchRuntime`` is the real one. Tests install a CUDA-semantics simulator through
``use_runtime`` (and only through it): the library never looks at test switches.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

__all__ = ["DeviceRuntime", "TorchRuntime", "CopyFence", "get_runtime", "use_runtime"]


class DeviceEvent(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class DeviceRuntime(Protocol):
    """What the mirror path needs from the device beyond torch ops (see module doc)."""

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...
    def is_host(self, tensor: torch.Tensor) -> bool: ...
    def event(self, device: torch.device) -> Optional[DeviceEvent]: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def is_capturing(self, device: torch.device) -> bool: ...
    def fence(self, device: torch.device) -> "CopyFence": ...


class CopyFence:
    """Marks the point after which the device no longer reads a staging slot.

    ``record()`` records an event on the current stream of the buffers' device (not the
    current device's), after every op that reads the slot was issued; ``wait()`` blocks
    the host only while that work is still pending (an event query, then an event
    synchronize: never a stream or device sync). A runtime with no event for the device
    (the CPU: copies there are synchronous) makes both calls no-ops.
    """

    __slots__ = ("_runtime", "_device", "_event", "_recorded")

    def __init__(self, device: torch.device, runtime: Optional[DeviceRuntime] = None) -> None:
        self._runtime = runtime if runtime is not None else get_runtime()
        self._device = device
        self._event = self._runtime.event(device)
        self._recorded = False

    def record(self) -> None:
        if self._event is not None:
            self._event.record(self._runtime.current_stream(self._device))
        self._recorded = True

    def wait(self) -> None:
        event = self._event
        if event is not None and self._recorded and not event.query():
            event.synchronize()


class TorchRuntime:
    """The real runtime: ``torch.cuda`` events and streams; no-ops for the CPU."""

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())

    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    def event(self, device: torch.device) -> Optional[DeviceEvent]:
        return torch.cuda.Event() if device.type == "cuda" else None

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def is_capturing(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        if device.index is None or device.index == torch.cuda.current_device():
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def fence(self, device: torch.device) -> CopyFence:
        return CopyFence(device, self)


_RUNTIME: DeviceRuntime = TorchRuntime()


def get_runtime() -> DeviceRuntime:
    """The runtime ``allocate`` hands to the buffers it builds now."""
    return _RUNTIME


@contextlib.contextmanager
def use_runtime(runtime: DeviceRuntime) -> Iterator[DeviceRuntime]:
    """Install ``runtime`` for the objects allocated inside the block (a test seam)."""
    global _RUNTIME
    previous = _RUNTIME
    _RUNTIME = runtime
    try:
        yield runtime
    finally:
        _RUNTIME = previous
