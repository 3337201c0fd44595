"""The device runtime seam: streams, events, capture state, pinned host memory, fences.

Everything the mirror path asks of CUDA *besides* plain torch ops goes through one
``DeviceRuntime`` object, chosen when ``MTPMetadata.allocate`` runs:

* ``host_empty(shape, dtype)`` -- page-locked host memory for staging (pinned when CUDA
  is present), so ``non_blocking`` copies from it are truly asynchronous;
* ``is_host(tensor)`` / ``is_device(tensor)`` -- whether a tensor lives in host or
  device memory (a host one is staged through pinned memory before an async copy, never
  copied pageable ``non_blocking``; a device one takes the device-op route);
* ``to_host(tensor, out=None)`` -- a host copy of a device tensor (a documented sync),
  into the host tensor ``out`` of its shape and dtype when given (pinned: no
  allocation, and the copy runs at the bus's pinned rate);
* ``record_stream(tensor, device)`` -- tell the caching allocator a caller's device
  tensor is read by work queued on the device's current stream, so freeing it right
  after the call cannot hand its memory to another stream's allocation first;
* ``fence(device)`` -- a ``CopyFence`` that marks when the device stops reading a
  staging slot (the fence factory of the staging rings);
* ``event(device)`` / ``current_stream(device)`` -- what a fence records, and where;
* ``synchronize(device)`` -- block the host until the device ran everything queued on
  every stream (``lifecycle.DeviceLifecycle`` only: buffers born or dropped);
* ``is_capturing(device)`` -- whether a CUDA graph capture is underway on the device,
  as far as the runtime can see (ring-using calls refuse to run then: a capture would
  bake a pinned slot and a host-side decision into the graph, and a fence's event
  query during a global-mode capture invalidates it). ``TorchRuntime`` sees the
  current stream of this thread only: PyTorch has no public query for a capture on
  another thread's stream (see ``TorchRuntime.is_capturing``).

``TorchRuntime`` is the real one. Tests install a CUDA-semantics simulator through
``use_runtime`` (and only through it): the library never looks at test switches.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Sequence

import torch

__all__ = ["DeviceRuntime", "TorchRuntime", "CopyFence", "StreamOrder", "get_runtime",
           "use_runtime"]


class DeviceEvent(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class DeviceRuntime(Protocol):
    """What the mirror path needs from the device beyond torch ops (see module doc)."""

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...
    def is_host(self, tensor: torch.Tensor) -> bool: ...
    def is_device(self, tensor: torch.Tensor) -> bool: ...
    def to_host(self, tensor: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor: ...
    def record_stream(self, tensor: torch.Tensor, device: torch.device) -> None: ...
    def event(self, device: torch.device) -> Optional[DeviceEvent]: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def is_capturing(self, device: torch.device) -> bool: ...
    def synchronize(self, device: torch.device) -> None: ...
    def fence(self, device: torch.device) -> "CopyFence": ...


class CopyFence:
    """Marks the point after which the device no longer reads a staging slot.

    ``record()`` records an event on the current stream of the buffers' device (not the
    current device's), after every op that reads the slot was issued; ``wait()`` blocks
    the host only while that work is still pending (an event query, then an event
    synchronize: never a stream or device sync). A runtime with no event for the device
    (the CPU: copies there are synchronous) makes both calls no-ops. ``blocked`` counts
    the waits that found the work still pending (each one a host stall).
    """

    __slots__ = ("_runtime", "_device", "_event", "_recorded", "blocked")

    def __init__(self, device: torch.device, runtime: Optional[DeviceRuntime] = None) -> None:
        self._runtime = runtime if runtime is not None else get_runtime()
        self._device = device
        self._event = self._runtime.event(device)
        self._recorded = False
        self.blocked = 0

    def record(self) -> None:
        if self._event is not None:
            self._event.record(self._runtime.current_stream(self._device))
        self._recorded = True

    def wait(self) -> None:
        event = self._event
        if event is not None and self._recorded and not event.query():
            self.blocked += 1
            event.synchronize()


class StreamOrder:
    """Orders the writers of shared device buffers across a change of stream.

    The persistent buffers (offsets, block table, query/KV lengths, the carry) are one
    state, written by whichever stream is current. ``enter()`` runs before each call
    that writes (or reads) them: when the current stream differs from the one the last
    such call ran on, it records an event on that previous stream *now* (so the event
    covers the previous writer and every op issued there after it, such as the forward
    that read the buffers) and makes the current stream wait on it. On one stream it
    costs a stream look-up and a comparison; on the CPU (no events) nothing.
    """

    __slots__ = ("_runtime", "_device", "_event", "_stream", "switches")

    def __init__(self, device: torch.device, runtime: Optional[DeviceRuntime] = None) -> None:
        self._runtime = runtime if runtime is not None else get_runtime()
        self._device = device
        self._event = self._runtime.event(device)
        self._stream: Any = None
        self.switches = 0  # stream changes ordered so far

    def enter(self) -> None:
        if self._event is None:
            return
        stream = self._runtime.current_stream(self._device)
        previous = self._stream
        if previous is not None and stream != previous:
            self._event.record(previous)
            stream.wait_event(self._event)
            self.switches += 1
        self._stream = stream

    def enter_unless_capturing(self) -> None:
        """``enter()`` for ops that may also be captured (the captured draft loop,
        contract §12): run eagerly, they are ordered like any other call; inside a
        capture nothing is recorded, waited on or queried (an event from outside the
        capture may not be waited on in it, and the replay runs on the stream the
        caller chooses, which the host never sees)."""
        if self._event is None or self._runtime.is_capturing(self._device):
            return
        self.enter()


#: Whether each device seen is a CUDA device: ``torch.device.type`` builds a string at
#: every read (about 0.4 µs), and the staging calls ask at every call.
_IS_CUDA: Dict[torch.device, bool] = {}


def _is_cuda(device: torch.device) -> bool:
    cuda = _IS_CUDA.get(device)
    if cuda is None:
        cuda = _IS_CUDA[device] = device.type == "cuda"
    return cuda


class TorchRuntime:
    """The real runtime: ``torch.cuda`` events and streams; no-ops for the CPU."""

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())

    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    def is_device(self, tensor: torch.Tensor) -> bool:
        return not tensor.is_cpu

    def to_host(self, tensor: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is None:
            return tensor.cpu()
        return out.copy_(tensor)  # blocking: the host reads ``out`` right after

    def record_stream(self, tensor: torch.Tensor, device: torch.device) -> None:
        if tensor.is_cuda and _is_cuda(device):
            tensor.record_stream(torch.cuda.current_stream(device))

    def event(self, device: torch.device) -> Optional[DeviceEvent]:
        return torch.cuda.Event() if _is_cuda(device) else None

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device) if _is_cuda(device) else None

    def is_capturing(self, device: torch.device) -> bool:
        """Whether this thread's current stream of ``device`` is capturing.

        Limit: a capture on another thread's stream is invisible here (PyTorch exposes
        only ``is_current_stream_capturing``). Under it, in CUDA's default global
        capture mode, a staging call's fence query would invalidate that capture: a
        multithreaded server capturing while another thread stages must capture with
        ``capture_error_mode="thread_local"`` (or "relaxed"). The simulator's runtime
        sees every stream, and tests pin the refusal there.
        """
        if not _is_cuda(device):
            return False
        if device.index is None or device.index == torch.cuda.current_device():
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def fence(self, device: torch.device) -> CopyFence:
        return CopyFence(device, self)


_RUNTIME: DeviceRuntime = TorchRuntime()


def get_runtime() -> DeviceRuntime:
    """The runtime ``allocate`` hands to the buffers it builds now."""
    return _RUNTIME


class use_runtime:  # noqa: N801 (a context manager, named as one)
    """Install ``runtime`` for the objects allocated inside the block (a test seam).

    A class rather than a generator: the bench's engine placement enters it around
    every timed step, where a generator's context manager costs about 2 µs."""

    __slots__ = ("_runtime", "_previous")

    def __init__(self, runtime: DeviceRuntime) -> None:
        self._runtime = runtime
        self._previous: Optional[DeviceRuntime] = None

    def __enter__(self) -> DeviceRuntime:
        global _RUNTIME
        self._previous, _RUNTIME = _RUNTIME, self._runtime
        return self._runtime

    def __exit__(self, *exc: Any) -> None:
        global _RUNTIME
        _RUNTIME = self._previous
