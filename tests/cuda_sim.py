"""A CUDA-semantics simulator for CPU tests: streams, events, lag, graph capture.

Every tensor stays a CPU tensor; what the simulator adds is CUDA's *ordering*. A
``TorchDispatchMode`` sees every aten op and sorts storages into three kinds:

* pinned host: storages made by the sim runtime's ``host_empty`` (the library's staging);
* device: storages made by factory ops (``zeros``/``empty``/``full``/``arange``...) while
  the sim is active, and outputs of ops that read device storage;
* pageable host: everything else (made before the sim, ``torch.from_numpy``,
  ``torch.tensor``, outputs of host-only ops).

Ops that touch device storage are *queued* on the current ``SimStream`` and run later,
when the "device" gets to them: after each intercepted op and each event/fence call it
runs a seeded random number of pending ops (often none, sometimes many), so the host runs
ahead. View ops run at once (they read nothing). A queued copy reads its source when it
*executes*, so a pinned slot the host rewrote before then is what the device copies (the
pinned-slot reuse race). Ops whose result the host needs (``.item()``, ``equal``,
data-dependent shapes, blocking copies) drain the queues first and count as a sync.

Version counters move as on CUDA: an in-place op bumps its tensor's ``_version`` once,
when the host issues it; executing it later (at a sync, an event wait, inside another
op's tick) and replaying a captured graph bump nothing.

Events, ``stream.wait_event``, ``with sim.capture(graph)`` (ops recorded, not run; a
sync inside raises like CUDA) and ``graph.replay()`` follow CUDA's rules. Captures run
on a side stream, as ``torch.cuda.graph`` does; capturing the legacy default stream is
refused. Captures are global-mode: an event query or sync anywhere invalidates every
capture underway, and work issued on another stream meanwhile is counted
(``uncaptured_during_capture``). The library reaches the simulator only through
``mtpmeta.buffers.device_runtime.use_runtime`` (entered by ``with sim:``): ``host_empty``,
``is_host``/``is_device``/``to_host`` (by storage kind, so simulated device tensors take
the library's device route), ``record_stream``, ``event``, ``current_stream``,
``is_capturing`` (any stream), ``synchronize`` (every stream) and ``fence``, the last returning the library's own
``CopyFence`` unless ``disable_fences`` (the negative control) asks for a no-op fence.
Nothing inside the library is patched.

Allocator model: each device storage remembers the stream current when it was made.
``sim.free(tensor)`` is its owner dropping it: the caching allocator may hand the block
to the next allocation on that stream at once, so a queued op on *another* stream that
still reads it, with no ``record_stream`` for that stream, is a use after free
(``unsafe_frees``).

An op that raises when it executes is a device-side fault: recorded, and re-raised as
``SimDeviceError`` at every later sync (CUDA's sticky error). Copies are modelled
pessimistically: an async copy from *pageable* memory is counted
(``pageable_async_copies``) and, like a pinned one, reads its source when it executes
(real CUDA would hide a stream sync in it instead; either is a hazard).

H2D copies that are strided, dtype-converting or broadcasting are counted
(``staged_h2d_copies``): on CUDA they go through a pageable ``.contiguous()`` temporary
and a device ``empty_like``, a hidden sync and an allocation.

Device scans (``cumsum``) that allocate on CUDA are counted (``scan_workspaces``): a scan
over a whole tensor (one dimension holds every element) is a cub scan, whose temporary
storage comes from the caching allocator at every call; a strided input or output, or
one of another dtype, is staged through a new tensor. A row scan (the last dimension of
a contiguous tensor with more than one row) into a contiguous output of its dtype
allocates nothing (ATen's ``scan_dim``).

Device searches (``bucketize``, ``searchsorted``) that stage an operand on CUDA are
counted (``staged_searches``): a strided input, bounds or output, or an input and
bounds of two dtypes, goes through a new tensor (ATen's
``searchsorted_maybe_trim_input_tensors``).

A device ``_foreach_copy_`` that CUDA would run pair by pair is counted
(``unfused_foreach_copies``): its fused multi-tensor path (ATen's ``ForeachUtils.h``)
needs every tensor of both lists to have one dtype, be non-overlapping and dense, and
each pair to share sizes and strides (size-1 dimensions aside); otherwise each pair is
its own copy launch, and a placement the op counters score as one op is a dozen
launches on the GPU.

Not simulated: "device" tensors are CPU tensors, so library code that branches on
``tensor.is_cpu`` (rather than the runtime) takes its host route for them, and
``.cpu()``/``.numpy()``/``.tolist()`` read them without any aten op (no sync is seen,
and the value may be one the device has not written yet).
"""

from __future__ import annotations

import contextlib
import random
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from mtpmeta.buffers.device_runtime import TorchRuntime, use_runtime

__all__ = ["CudaSim", "SimStream", "SimEvent", "SimGraph", "SimDeviceError",
           "CaptureSyncError", "PINNED", "DEVICE", "PAGEABLE"]

PINNED, DEVICE, PAGEABLE = "pinned", "device", "pageable"
_TENSOR_RETURNS = ("Tensor", "Tensor[]", "Tensor?", "Tensor?[]")
_COPY = torch.ops.aten.copy_.default
# In-place ops that change only a tensor's metadata: they run at once, like views.
_METADATA_OPS = frozenset(f"aten::{name}_" for name in (
    "as_strided", "transpose", "t", "unsqueeze", "squeeze", "swapdims", "swapaxes",
    "detach", "resize", "set"))


#: The sync reason of the library's own device synchronize (``DeviceRuntime.synchronize``:
#: buffers born or dropped, ``mtpmeta.buffers.lifecycle``).
RUNTIME_SYNC = "runtime synchronize"


class SimDeviceError(RuntimeError):
    """A queued op raised when it executed (CUDA: a device-side assert). Sticky."""


class CaptureSyncError(RuntimeError):
    """A sync, event query or blocking copy while a stream is capturing."""


class _Item:
    __slots__ = ("run", "label", "wait_for", "reads_pinned", "storages")

    def __init__(self, run: Optional[Callable[[], Any]], label: str,
                 wait_for: Optional[tuple] = None, reads_pinned: bool = False,
                 storages: frozenset = frozenset()) -> None:
        self.run = run
        self.label = label
        self.wait_for = wait_for  # (stream, target): runnable once stream.executed >= target
        self.reads_pinned = reads_pinned
        self.storages = storages  # ids of the storages the op touches


class SimStream:
    """An ordered queue of pending device ops."""

    def __init__(self, sim: "CudaSim", name: str) -> None:
        self.sim = sim
        self.name = name
        self.queue: Deque[_Item] = deque()
        self.issued = 0  # items ever enqueued
        self.executed = 0  # items ever executed (a prefix of the issued ones)
        self.capture: Optional["SimGraph"] = None

    def wait_event(self, event: "SimEvent") -> None:
        """Later work on this stream runs only after the event's recorded work."""
        self.sim._wait_event(self, event)

    def synchronize(self) -> None:
        self.sim._host_sync(f"stream {self.name} synchronize", streams=[self])

    def __repr__(self) -> str:
        return f"SimStream({self.name}, pending={len(self.queue)})"


class SimEvent:
    """CUDA event semantics: ``record`` marks a queue position of a stream."""

    def __init__(self, sim: "CudaSim") -> None:
        self.sim = sim
        self.stream: Optional[SimStream] = None
        self.target = 0
        self.captured = False  # last recorded inside a capture (cudaErrorCapturedEvent)

    def record(self, stream: Optional[SimStream] = None) -> None:
        sim = self.sim
        sim._tick()
        stream = stream if stream is not None else sim.current_stream
        if stream.capture is not None:
            self.captured = True
            self.stream = None
            sim.captured_event_records += 1
            return
        self.captured = False
        self.stream = stream
        self.target = stream.issued
        sim._note_record(self)

    def _done(self) -> bool:
        return self.stream is None or self.stream.executed >= self.target

    def _check_usable(self, what: str) -> None:
        self.sim._refuse_if_capturing(f"event {what}")
        if self.captured:
            raise RuntimeError(f"event {what}: operation not permitted on an event last "
                               "recorded in a capturing stream (cudaErrorCapturedEvent)")

    def query(self) -> bool:
        self.sim._tick()
        self._check_usable("query")
        self.sim.event_queries += 1
        return self._done()

    def synchronize(self) -> None:
        self.sim._tick()
        self._check_usable("synchronize")
        if not self._done():
            self.sim.stalls += 1
            self.sim._run_until(self._done, "event synchronize")
        self.sim._raise_device_error()

    def wait(self, stream: Optional[SimStream] = None) -> None:
        (stream if stream is not None else self.sim.current_stream).wait_event(self)


class SimGraph:
    """Ops recorded by ``sim.capture``; ``replay`` re-issues them on the current stream
    against the same tensors, with whatever those tensors hold then."""

    def __init__(self) -> None:
        self.sim: Optional["CudaSim"] = None
        self.items: List[_Item] = []
        self.invalidated = False

    @property
    def pinned_reads(self) -> int:
        """Recorded copies whose source is pinned host memory."""
        return sum(item.reads_pinned for item in self.items)

    def replay(self) -> None:
        sim = self.sim
        if sim is None:
            raise RuntimeError("replay: this graph was never captured")
        if self.invalidated:
            raise RuntimeError("replay: the capture was invalidated")
        stream = sim.current_stream
        if stream.capture is not None:
            raise CaptureSyncError("replay: graph launch inside a capture is not simulated")
        for item in self.items:
            sim._push(stream, item)
        sim.replays += 1
        sim._tick()


class _NoOpFence:
    """The negative control's fence: records nothing, never waits."""

    blocked = 0

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


class SimRuntime(TorchRuntime):
    """The ``mtpmeta.buffers.device_runtime.DeviceRuntime`` the simulator installs: ``TorchRuntime``
    with the CUDA primitives replaced (memory kinds, events, streams, capture state);
    the fence factory is the real one."""

    def __init__(self, sim: "CudaSim") -> None:
        self.sim = sim

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self.sim.host_empty(shape, dtype)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return self.sim.kind(tensor) != DEVICE

    def is_device(self, tensor: torch.Tensor) -> bool:
        return self.sim.kind(tensor) == DEVICE

    def to_host(self, tensor: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A blocking D2H copy: a sync, then a pageable host copy (into the host
        ``out`` when given)."""
        sim = self.sim
        sim._host_sync("to_host (blocking D2H copy)")
        with sim.bypass():
            if out is None:
                return tensor.clone()
            if sim.kind(out) == DEVICE or out.shape != tensor.shape or \
                    out.dtype != tensor.dtype:
                raise AssertionError("to_host: out must be a host tensor of the "
                                     "source's shape and dtype")
            return out.copy_(tensor)

    def record_stream(self, tensor: torch.Tensor, device: torch.device) -> None:
        sim = self.sim
        sim.record_streams += 1
        sim._recorded_streams.setdefault(tensor.untyped_storage()._cdata, set()).add(
            sim.current_stream)

    def event(self, device: torch.device) -> SimEvent:
        return SimEvent(self.sim)

    def current_stream(self, device: torch.device) -> SimStream:
        return self.sim.current_stream

    def is_capturing(self, device: torch.device) -> bool:
        return self.sim.capturing()  # any stream: the device's capture is global

    def synchronize(self, device: torch.device) -> None:
        self.sim._host_sync(RUNTIME_SYNC)

    def fence(self, device: torch.device) -> Any:
        self.sim._tick()
        self.sim.fences_made += 1
        if self.sim.disable_fences:
            return _NoOpFence()
        return super().fence(device)  # TorchRuntime's: the library's CopyFence


class _SimMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled: do not wrap __torch_dispatch__ in dynamo's disable
        # (its first call would import torch._dynamo, ~2 s of CPU per process).
        return False

    def __init__(self, sim: "CudaSim") -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.sim._dispatch(func, args, kwargs or {})


def _poison(tensor: torch.Tensor) -> None:
    """Fill not-yet-initialised device memory with a value no test expects."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).max // 3)


def _dense(tensor: torch.Tensor) -> bool:
    """ATen's ``is_non_overlapping_and_dense``: some order of the dimensions is a
    contiguous layout (size-1 dimensions ignored)."""
    if tensor.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal sizes, and equal strides wherever a size is not 1."""
    return a.shape == b.shape and all(size == 1 or x == y for size, x, y in
                                      zip(a.shape, a.stride(), b.stride()))


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


class CudaSim:
    """The simulator. ``with sim:`` installs its runtime and dispatch mode.

    Args:
        seed: seeds the device's lag and the interleaving of streams.
        idle: probability that the device runs nothing after a host op.
        burst: probability that it then runs a burst (1..``burst_max`` ops) rather than
            one or two.
        disable_fences: hand the library no-op fences (the negative control).
    """

    def __init__(self, seed: int = 0, *, idle: float = 0.85, burst: float = 0.1,
                 burst_max: int = 32, disable_fences: bool = False) -> None:
        self.rng = random.Random(seed)
        self.idle = idle
        self.burst = burst
        self.burst_max = burst_max
        self.disable_fences = disable_fences
        self.runtime = SimRuntime(self)
        self.default_stream = SimStream(self, "default")
        self.streams: List[SimStream] = [self.default_stream]
        self.current_stream = self.default_stream
        self._kinds: Dict[int, str] = {}
        self._made_on: Dict[int, SimStream] = {}  # device storage id -> allocating stream
        self._recorded_streams: Dict[int, set] = {}  # storage id -> record_stream streams
        self._keep: List[Any] = []  # registered storages stay alive: ids never reused
        self._executing = False
        self._stack: Optional[contextlib.ExitStack] = None
        self._recorded: "weakref.WeakSet[SimEvent]" = weakref.WeakSet()
        self.device_error: Optional[BaseException] = None
        # Counters.
        self.syncs = 0
        self.sync_reasons: List[str] = []
        self.pageable_async_copies = 0
        self.pageable_log: List[str] = []
        self.h2d_copies = 0  # host-to-device copies issued
        self.h2d_bytes = 0  # bytes they move
        self.strided_h2d_copies = 0  # of them, with a non-contiguous side (CUDA stages
        #                              those through a temporary: an allocation)
        self.stalls = 0  # event synchronize calls that had to wait for the device
        self.event_queries = 0
        self.fences_made = 0
        self.captured_event_records = 0
        self.replays = 0
        self.issued = 0
        self.executed = 0
        self.max_pending = 0
        self.max_inflight_events = 0
        self.staged_h2d_copies = 0  # strided / converting H2D copies (hidden temporaries)
        self.staged_log: List[str] = []
        self.unsafe_frees: List[str] = []  # frees a queued op on another stream still reads
        self.record_streams = 0
        self.uncaptured_during_capture = 0  # ops issued elsewhere during a global capture
        self.scan_workspaces = 0  # device cumsums that allocate on CUDA (module docstring)
        self.scan_log: List[str] = []
        self.staged_searches = 0  # device bucketize/searchsorted staging an operand
        self.search_log: List[str] = []
        self.foreach_copies = 0  # device _foreach_copy_ calls
        self.unfused_foreach_copies = 0  # ... that CUDA runs pair by pair
        self.foreach_log: List[str] = []

    # ------------------------------------------------------------ activation
    def __enter__(self) -> "CudaSim":
        if self._stack is not None:
            raise RuntimeError("CudaSim is not re-entrant")
        stack = contextlib.ExitStack()
        stack.enter_context(use_runtime(self.runtime))
        stack.enter_context(_SimMode(self))
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        stack.__exit__(*exc)

    # ----------------------------------------------------------------- memory
    def kind(self, tensor: torch.Tensor) -> str:
        """``PINNED``, ``DEVICE`` or ``PAGEABLE`` for the tensor's storage."""
        return self._kinds.get(tensor.untyped_storage()._cdata, PAGEABLE)

    def _register(self, tensor: torch.Tensor, kind: str) -> None:
        storage = tensor.untyped_storage()
        self._kinds[storage._cdata] = kind
        if kind == DEVICE:
            self._made_on[storage._cdata] = self.current_stream
        self._keep.append(storage)

    def free(self, tensor: torch.Tensor) -> None:
        """The owner drops a device tensor (its allocating stream may reuse the block at
        once): flag every queued op on another stream that still touches it without a
        ``record_stream`` for that stream."""
        key = tensor.untyped_storage()._cdata
        owner = self._made_on.get(key)
        recorded = self._recorded_streams.get(key, set())
        for stream in self.streams:
            if stream is owner or stream in recorded:
                continue
            for item in stream.queue:
                if key in item.storages:
                    self.unsafe_frees.append(
                        f"freed a {tuple(tensor.shape)} {tensor.dtype} tensor made on "
                        f"{owner.name if owner else '?'} while {item.label} queued on "
                        f"{stream.name} still reads it (no record_stream)")
                    break

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory (what the sim runtime hands the library)."""
        with self.bypass():
            tensor = torch.empty(tuple(shape), dtype=dtype)
        self._register(tensor, PINNED)
        return tensor

    def peek(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the memory holds right now, without a sync (a test-only look)."""
        with self.bypass():
            return tensor.clone()

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        """Torch ops inside run plainly: nothing queued, nothing registered (for the
        reference and for test bookkeeping)."""
        previous = self._executing
        self._executing = True
        try:
            yield
        finally:
            self._executing = previous

    # ---------------------------------------------------------------- streams
    def Stream(self, name: Optional[str] = None) -> SimStream:
        stream = SimStream(self, name or f"s{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def Event(self) -> SimEvent:
        return SimEvent(self)

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[SimStream]:
        previous = self.current_stream
        self.current_stream = stream
        try:
            yield stream
        finally:
            self.current_stream = previous

    @contextlib.contextmanager
    def capture(self, graph: SimGraph,
                stream: Optional[SimStream] = None) -> Iterator[SimGraph]:
        """Capture on ``stream`` (default: a new side stream, as ``torch.cuda.graph``
        uses), made current inside the block: its ops are recorded into ``graph``.
        Capturing the legacy default stream is refused, as CUDA refuses it."""
        stream = stream if stream is not None else self.Stream("capture")
        if stream is self.default_stream:
            raise RuntimeError("capture: the legacy default stream cannot be captured "
                               "(cudaErrorStreamCaptureUnsupported)")
        if stream.capture is not None:
            raise RuntimeError("capture: the stream is already capturing")
        graph.sim = self
        stream.capture = graph
        try:
            with self.stream(stream):
                yield graph
        finally:
            stream.capture = None
        if graph.invalidated:
            raise CaptureSyncError("capture: invalidated by an operation not permitted "
                                   "while capturing (cudaErrorStreamCaptureInvalidated)")

    def capturing(self) -> bool:
        return any(s.capture is not None for s in self.streams)

    def pending(self) -> int:
        return sum(len(s.queue) for s in self.streams)

    def synchronize(self) -> None:
        """Drain every stream (a device sync)."""
        self._host_sync("synchronize")

    # -------------------------------------------------------------- execution
    def _push(self, stream: SimStream, item: _Item) -> None:
        if stream.capture is not None:
            stream.capture.items.append(item)
            return
        if self.capturing():
            self.uncaptured_during_capture += 1
        stream.queue.append(item)
        stream.issued += 1
        self.issued += 1
        pending = self.pending()
        if pending > self.max_pending:
            self.max_pending = pending

    def _enqueue(self, run: Callable[[], Any], label: str, reads_pinned: bool = False,
                 tensors: Sequence[torch.Tensor] = ()) -> None:
        storages = frozenset(t.untyped_storage()._cdata for t in tensors)
        self._push(self.current_stream, _Item(run, label, None, reads_pinned, storages))

    def _wait_event(self, stream: SimStream, event: SimEvent) -> None:
        if event.captured:
            if stream.capture is None:
                raise RuntimeError("wait_event: the event was last recorded in a capture "
                                   "(cudaErrorCapturedEvent)")
            return  # a dependency inside one capture: the graph is already sequential
        if event.stream is None or event._done():
            return
        if stream.capture is not None:
            raise CaptureSyncError("wait_event: waiting on an event from outside the "
                                   "capture (cudaErrorStreamCaptureIsolation)")
        self._push(stream, _Item(None, "wait_event", (event.stream, event.target)))

    def _ready(self, stream: SimStream) -> bool:
        if not stream.queue:
            return False
        wait_for = stream.queue[0].wait_for
        return wait_for is None or wait_for[0].executed >= wait_for[1]

    def _step(self, streams: Optional[List[SimStream]] = None) -> bool:
        """Execute the head of one random ready stream; False when none is ready."""
        ready = [s for s in (streams or self.streams) if self._ready(s)]
        if not ready:
            return False
        stream = ready[0] if len(ready) == 1 else self.rng.choice(ready)
        item = stream.queue.popleft()
        if item.run is not None and self.device_error is None:
            # Below ADInplaceOrView: executing a queued op moves no version counter
            # (CUDA bumps it once, when the host issues the op; a replay, none).
            with self.bypass(), torch._C._AutoDispatchBelowADInplaceOrView():
                try:
                    item.run()
                except Exception as error:  # a device-side fault: sticky
                    self.device_error = SimDeviceError(
                        f"device-side fault in queued op {item.label}: {error}")
        stream.executed += 1
        self.executed += 1
        return True

    def _tick(self) -> None:
        """The device runs a random number of pending ops (it lags behind the host)."""
        if self._executing:
            return
        rng = self.rng
        if rng.random() < self.idle:
            return
        count = rng.randint(1, self.burst_max) if rng.random() < self.burst else \
            rng.randint(1, 2)
        for _ in range(count):
            if not self._step():
                return

    def _run_until(self, done: Callable[[], bool], reason: str,
                   streams: Optional[List[SimStream]] = None) -> None:
        while not done():
            if not self._step(streams) and not self._step():
                raise RuntimeError(f"{reason}: deadlock, pending ops can never run")

    def _note_record(self, event: SimEvent) -> None:
        self._recorded.add(event)
        inflight = sum(1 for e in self._recorded if not e._done())
        if inflight > self.max_inflight_events:
            self.max_inflight_events = inflight

    def _refuse_if_capturing(self, what: str) -> None:
        for stream in self.streams:
            if stream.capture is not None:
                stream.capture.invalidated = True
                raise CaptureSyncError(f"{what}: operation not permitted when stream is "
                                       "capturing")

    def _raise_device_error(self) -> None:
        if self.device_error is not None:
            raise self.device_error

    def _host_sync(self, reason: str, streams: Optional[List[SimStream]] = None) -> None:
        self._refuse_if_capturing(reason)
        self.syncs += 1
        self.sync_reasons.append(reason)
        targets = streams or self.streams
        self._run_until(lambda: not any(s.queue for s in targets), reason, targets)
        self._raise_device_error()

    # --------------------------------------------------------------- dispatch
    def _dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if self._executing:
            return func(*args, **kwargs)
        try:
            return self._route(func, args, kwargs)
        finally:
            self._tick()

    def _route(self, func, args: tuple, kwargs: dict) -> Any:
        if func.is_view or func._schema.name in _METADATA_OPS:  # reads no data
            return func(*args, **kwargs)
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if not tensors:
            return self._factory(func, args, kwargs)
        kinds = [self.kind(t) for t in tensors]
        if func is _COPY:
            return self._copy(args, kwargs)
        if DEVICE not in kinds:
            return func(*args, **kwargs)  # host only: runs now
        for tensor, kind in zip(tensors, kinds):
            if kind != DEVICE and tensor.dim() > 0:
                raise RuntimeError(f"{func}: expected all tensors on the device, got a "
                                   f"{kind} host tensor of shape {tuple(tensor.shape)}")
        schema = func._schema
        if schema.name == "aten::cumsum":
            self._note_scan(args, kwargs)
        elif schema.name in ("aten::bucketize", "aten::searchsorted"):
            self._note_search(schema.name, args, kwargs)
        elif schema.name == "aten::_foreach_copy_":
            self._note_foreach(args[0], args[1])
        if any(str(r.type) not in _TENSOR_RETURNS for r in schema.returns):
            self._host_sync(f"{func} (the host needs the result)")
            return func(*args, **kwargs)
        if schema.is_mutable:
            self._enqueue(lambda: func(*args, **kwargs), str(func), tensors=tensors)
            return self._mutated(func, args, kwargs)
        try:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except Exception:  # data-dependent shape (nonzero, masked_select...): a sync
            self._host_sync(f"{func} (data-dependent output shape)")
            result = func(*args, **kwargs)
            for out in tree_flatten(result)[0]:
                if isinstance(out, torch.Tensor):
                    self._register(out, DEVICE)
            return result
        flat_meta, spec = tree_flatten(meta)
        outs = []
        for m in flat_meta:
            if isinstance(m, torch.Tensor):
                out = torch.empty_strided(m.size(), m.stride(), dtype=m.dtype)
                _poison(out)
                self._register(out, DEVICE)
                outs.append(out)
            else:
                outs.append(m)

        def run() -> None:
            values = tree_flatten(func(*args, **kwargs))[0]
            for out, value in zip(outs, values):
                if isinstance(out, torch.Tensor):
                    out.copy_(value)

        self._enqueue(run, str(func), tensors=tensors)
        return spec.unflatten(outs)

    def _note_scan(self, args: tuple, kwargs: dict) -> None:
        """Count a device ``cumsum`` that takes a workspace or a staging tensor on CUDA."""
        src, dim = args[0], args[1]
        out = kwargs.get("out")
        dtype = kwargs.get("dtype") or (out.dtype if out is not None else None)
        if dtype is None and not (src.dtype.is_floating_point or src.dtype.is_complex):
            dtype = torch.int64  # an integer scan promotes: the input is converted
        if src.dim() == 0:
            return
        dim %= src.dim()
        reasons = []
        if src.numel() == src.size(dim):
            reasons.append("a whole-tensor scan (cub: temporary storage)")
        if not src.is_contiguous():
            reasons.append("a strided input")
        if out is not None and not out.is_contiguous():
            reasons.append("a strided output")
        if dtype is not None and dtype != src.dtype:
            reasons.append(f"a {src.dtype} input scanned as {dtype}")
        if reasons:
            self.scan_workspaces += 1
            self.scan_log.append(f"cumsum of {tuple(src.shape)} over dim {dim}: "
                                 + ", ".join(reasons))

    def _note_search(self, name: str, args: tuple, kwargs: dict) -> None:
        """Count a device search that stages an operand through a new tensor on CUDA."""
        values, bounds = (args[0], args[1]) if name == "aten::bucketize" else \
            (args[1], args[0])
        out = kwargs.get("out")
        reasons = [f"a strided {what}" for what, t in (("input", values),
                                                       ("bounds", bounds), ("output", out))
                   if isinstance(t, torch.Tensor) and not t.is_contiguous()]
        if isinstance(values, torch.Tensor) and values.dtype != bounds.dtype:
            reasons.append(f"a {values.dtype} input against {bounds.dtype} bounds")
        if reasons:
            self.staged_searches += 1
            self.search_log.append(f"{name} of {tuple(bounds.shape)} bounds: "
                                   + ", ".join(reasons))

    def _note_foreach(self, dsts: Sequence[torch.Tensor],
                      srcs: Sequence[torch.Tensor]) -> None:
        """Count a ``_foreach_copy_`` that misses CUDA's fused path (module docstring)."""
        self.foreach_copies += 1
        tensors = list(dsts) + list(srcs)
        reasons = []
        if len({t.dtype for t in tensors}) > 1:
            reasons.append("dtypes " + ", ".join(sorted({str(t.dtype) for t in tensors})))
        sparse = [tuple(t.shape) for t in tensors if not _dense(t)]
        if sparse:
            reasons.append(f"not dense: {sparse[:3]}")
        unlike = [tuple(d.shape) for d, s in zip(dsts, srcs) if not _same_layout(d, s)]
        if unlike:
            reasons.append(f"pairs of other sizes or strides: {unlike[:3]}")
        if reasons:
            self.unfused_foreach_copies += 1
            self.foreach_log.append(f"_foreach_copy_ of {len(dsts)} pairs: "
                                    + "; ".join(reasons))

    @staticmethod
    def _mutated(func, args: tuple, kwargs: dict) -> Any:
        written = []
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written.append(args[index] if index < len(args) else kwargs[argument.name])
        count = len(func._schema.returns)
        if count == 0:
            return None
        return written[0] if count == 1 else tuple(written[:count])

    def _factory(self, func, args: tuple, kwargs: dict) -> Any:
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            return result
        self._register(result, DEVICE)
        if func._schema.name.startswith("aten::empty"):
            _poison(result)
        else:  # the initialisation is device work: queued, memory poisoned until then
            init = result.clone()
            _poison(result)
            self._enqueue(lambda: result.copy_(init), str(func))
        return result

    def _copy(self, args: tuple, kwargs: dict) -> torch.Tensor:
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        dst_kind, src_kind = self.kind(dst), self.kind(src)
        if dst_kind != DEVICE and src_kind != DEVICE:
            return _COPY(dst, src, non_blocking)  # host to host: runs now
        crosses = (dst_kind == DEVICE) != (src_kind == DEVICE)
        to_device = src_kind != DEVICE
        if crosses and non_blocking and to_device and src_kind == PAGEABLE:
            self.pageable_async_copies += 1
            self.pageable_log.append(f"non_blocking copy of {tuple(src.shape)} "
                                     f"{src.dtype} from pageable host memory")
        if crosses and to_device and (src.dtype != dst.dtype or src.shape != dst.shape
                                      or not src.is_contiguous() or not dst.is_contiguous()):
            self.staged_h2d_copies += 1
            self.staged_log.append(f"H2D copy of {tuple(src.shape)} {src.dtype} "
                                   f"(strides {src.stride()}) into {tuple(dst.shape)} "
                                   f"{dst.dtype} (strides {dst.stride()})")
        label = "H2D copy" if crosses and to_device else "D2H copy" if crosses else "D2D copy"
        if crosses and to_device:
            self.h2d_copies += 1
            self.h2d_bytes += dst.numel() * dst.element_size()
            if not (dst.is_contiguous() and src.is_contiguous()):
                self.strided_h2d_copies += 1
        self._enqueue(lambda: _COPY(dst, src, non_blocking), label,
                      reads_pinned=crosses and to_device and src_kind == PINNED,
                      tensors=(dst, src))
        if crosses and not non_blocking:
            self._host_sync(f"blocking {label}", streams=[self.current_stream])
        return dst
