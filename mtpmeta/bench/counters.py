"""Counting what a path asks of the device: torch ops, read-backs, new storages, the
bytes it copies host-to-device, and its CUDA event and stream calls. Counts, not times:
they are the same on a busy machine, and the same on the CPU-forced or ``meta`` mirror
path as on a GPU.

* :class:`OpCounter` (a dispatch mode) counts every aten op while active; the hygiene
  tests and the bench use it to show that the draft loop and the commit-pass staging
  make no host-device sync and allocate nothing. :class:`DeviceOpCounter` also counts
  the data ops that touch a non-CPU tensor (each a launch or a copy on a GPU).
* :class:`StagingRecorder` (a ``TorchRuntime``) remembers the host staging storages the
  mirror path is born with; :class:`H2DCounter` sums the bytes of every ``copy_`` out of
  them: the mirror path's host-to-device traffic.
* :class:`CountingRuntime` gives ``meta`` a CUDA-like event and stream and counts calls.
* :func:`counted_step` runs one standard step with a counter per call;
  :func:`measure_traffic` counts bytes and data ops per step at the production size
  against upstream's flow (:func:`upstream_h2d_bytes`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mtpmeta.buffers.device_runtime import TorchRuntime, use_runtime

__all__ = ["OpCounter", "DeviceOpCounter", "StagingRecorder", "H2DCounter",
           "recorded_mirror", "CountingRuntime", "CALLS", "counted_step", "upstream_h2d_bytes",
           "measure_traffic"]

_SCALAR_READ = "aten::_local_scalar_dense"
_COPY = "aten::copy_"


def _storages(values: Iterable[Any]) -> List[int]:
    return [value.untyped_storage().data_ptr() for value in values
            if isinstance(value, torch.Tensor)]


class OpCounter(TorchDispatchMode):
    """Counts aten ops while active.

    Attributes:
        ops: Counter of op names (``aten::copy_``, ...).
        view_ops: ops that only make a new view of existing data (``aten::detach``,
            ``aten::slice``, ``aten::view``, ...): no data is read or written, so on a
            GPU no kernel is launched (``tensor.numpy()`` issues one ``detach``).
        scalar_reads: ops that read a tensor's value back to the host
            (``aten::_local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``).
        new_storages: outputs whose storage is not one of the op's inputs' storages,
            i.e. freshly allocated tensors (views and in-place ops never count).
        new_storage_ops: the names of the ops that created them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.view_ops = 0
        self.scalar_reads = 0
        self.new_storages = 0
        self.new_storage_ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops[name] += 1
        if func.is_view:
            self.view_ops += 1
        if name == _SCALAR_READ:
            self.scalar_reads += 1
        inputs, _ = tree_flatten((args, kwargs))
        seen = set(_storages(inputs))
        result = func(*args, **kwargs)
        outputs, _ = tree_flatten(result)
        for pointer in _storages(outputs):
            if pointer not in seen and pointer != 0:
                self.new_storages += 1
                self.new_storage_ops.append(name)
        return result

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def data_ops(self) -> int:
        """Ops that read or write tensor data: ``total`` less ``view_ops``."""
        return self.total - self.view_ops


class DeviceOpCounter(OpCounter):
    """``OpCounter`` that also counts the data ops touching a device tensor
    (``device_data_ops``): on a GPU, each is a kernel launch or a copy. ``is_device``:
    which tensors are on the device (default: every non-CPU tensor; a runtime's
    ``is_device`` also counts the host tensors it stands in for device ones)."""

    def __init__(self, is_device: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
        super().__init__()
        self.device_data_ops = 0
        self.overloads: set = set()  # every OpOverload dispatched
        self.is_device = is_device or (lambda tensor: not tensor.is_cpu)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = super().__torch_dispatch__(func, types, args, kwargs)
        self.overloads.add(func)
        if not func.is_view:
            values, _ = tree_flatten((args, kwargs or {}, result))
            if any(isinstance(v, torch.Tensor) and self.is_device(v) for v in values):
                self.device_data_ops += 1
        return result


class StagingRecorder(TorchRuntime):
    """A ``TorchRuntime`` that records the storage of every host tensor it allocates.
    Build an ``MTPMetadata`` under ``use_runtime(recorder)`` to have its staging known:
    every host-to-device copy of the mirror path reads one of those storages."""

    def __init__(self) -> None:
        self.storages: Set[int] = set()

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        tensor = super().host_empty(shape, dtype)
        self.storages.add(tensor.untyped_storage().data_ptr())
        return tensor


class H2DCounter(TorchDispatchMode):
    """While active: ``copies`` and ``nbytes`` of the ``copy_`` ops reading a recorded
    staging storage into another (the host-to-device copies of the mirror path)."""

    def __init__(self, recorder: StagingRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.copies = 0
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if func._schema.name == _COPY:
            dst, src = args[0], args[1]
            if src.untyped_storage().data_ptr() in self.recorder.storages and \
                    dst.untyped_storage().data_ptr() not in self.recorder.storages:
                self.copies += 1
                self.nbytes += dst.numel() * dst.element_size()
        return func(*args, **(kwargs or {}))


class _Stream:
    def __init__(self, calls: Dict[str, int]) -> None:
        self.calls = calls

    def wait_event(self, event: Any) -> None:
        self.calls["stream.wait_event"] += 1


class _Event:
    def __init__(self, calls: Dict[str, int]) -> None:
        self.calls = calls

    def record(self, stream: Any = None) -> None:
        self.calls["event.record"] += 1

    def query(self) -> bool:
        self.calls["event.query"] += 1
        return True

    def synchronize(self) -> None:
        self.calls["event.synchronize"] += 1


class CountingRuntime(TorchRuntime):
    """``TorchRuntime`` that gives any non-CPU device (``meta``) a CUDA-like event and
    stream and counts every event, stream and ``record_stream`` call."""

    KINDS = ("event", "event.record", "event.query", "event.synchronize",
             "current_stream", "stream.wait_event", "record_stream")

    def __init__(self) -> None:
        self.calls: Dict[str, int] = {kind: 0 for kind in self.KINDS}
        self._stream = _Stream(self.calls)

    def event(self, device: torch.device):
        if device.type == "cpu":
            return None
        self.calls["event"] += 1
        return _Event(self.calls)

    def current_stream(self, device: torch.device):
        if device.type == "cpu":
            return None
        self.calls["current_stream"] += 1
        return self._stream

    def record_stream(self, tensor: torch.Tensor, device: torch.device) -> None:
        if device.type != "cpu":
            self.calls["record_stream"] += 1


#: The calls of a standard step, in step order, that :func:`counted_step` counts apart.
CALLS = ("rows", "carry", "begin_decode", "depth", "advance", "commit")


def counted_step(meta: Any, view: Any, inputs: Any, config: Any,
                 commit_inputs: Any = None) -> Dict[str, List[OpCounter]]:
    """One standard step with an ``OpCounter`` per call: ``{call: [counters]}`` (one
    counter per depth and per advance). ``commit_inputs``: the commit pass's step inputs
    when they differ from the draft loop's (device draft inputs, host commit inputs)."""
    from mtpmeta.bench.workload import run_rows

    calls: Dict[str, List[OpCounter]] = {name: [] for name in CALLS}

    def counted(name, fn, *args, **kwargs):
        with OpCounter() as counter:
            fn(*args, **kwargs)
        calls[name].append(counter)

    counted("rows", run_rows, meta, inputs)
    counted("carry", meta.carry_chunk_boundary, inputs.hidden, inputs.carry_req_id,
            inputs.carry_position)
    meta.take_chunk_boundary(inputs.carry_req_id, inputs.carry_position)
    counted("begin_decode", meta.begin_decode, config.active, config.padded_active,
            inputs.start_positions, inputs.block_table, config.graphed)
    for _ in range(config.depths):
        counted("depth", meta.setup_decode_step, view)
        counted("advance", meta.advance_decode_step)
    meta.end_forward()
    commit = inputs if commit_inputs is None else commit_inputs
    counted("commit", meta.setup_commit_pass, view, commit.append_counts,
            commit.block_table, start_positions=commit.commit_starts,
            inherited_blocks=commit.inherited, padded_token_count=commit.padded_tokens,
            padded_request_count=commit.padded_requests)
    meta.end_forward()
    return calls


def upstream_h2d_bytes(config: Any, steps: List[Any]) -> float:
    """Host-to-device bytes per step of upstream's flow from host inputs: begin_decode's
    ``[n, W]`` table and ``[n]`` starts, the commit pass's ``[P, W]`` table and its three
    ``[P]`` inputs (counts, starts, inherited), and the carried hidden."""
    n, W = config.active, config.block_columns
    table_item = torch.empty((), dtype=config.metadata_kwargs()["block_table_dtype"]
                             ).element_size()
    total = 0
    for step in steps:
        P = step.append_counts.numel()
        total += n * W * table_item + n * 4 + P * W * 4 + 3 * P * 4
        total += step.hidden.numel() * step.hidden.element_size()
    return total / len(steps)


def recorded_mirror(config: Any):
    """``(metadata, view, recorder)``: a mirror-path ``MTPMetadata`` for ``config`` (a
    ``StepConfig``) allocated on the CPU under a ``StagingRecorder``, which sees every
    host-to-device copy it stages, and a ``ContextGPUView`` of the config's shape."""
    from mtpmeta.gpu_view import ContextGPUView
    from mtpmeta.metadata import MTPMetadata

    recorder = StagingRecorder()
    with use_runtime(recorder):
        meta = MTPMetadata(**config.metadata_kwargs())
        meta.allocate("cpu", mirror=True, max_tokens=config.max_tokens)
    view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns)
    return meta, view, recorder


def measure_traffic(config: Any = None, *, steps: int = 2, seed: int = 0
                    ) -> Dict[str, Any]:
    """Device traffic per step at ``config`` (default ``workload.PRODUCTION``, with its
    log-normal context lengths): the mirror path's host-to-device bytes in the standard
    step order (the commit pass follows the draft loop on one table and takes the rows
    the device already holds) and with the commit pass first (where it cannot), beside
    upstream's flow; and the data ops and syncs per step of the mirror path (CPU-forced)
    and of the reference (upstream's equivalent)."""
    from mtpmeta.bench.variants import build
    from mtpmeta.bench.workload import PRODUCTION, production_steps, run_step, \
        run_step_commit_first

    config = PRODUCTION if config is None else config
    inputs = production_steps(config, steps, seed)
    meta, view, recorder = recorded_mirror(config)
    with H2DCounter(recorder) as in_order:
        for x in inputs:
            run_step(meta, view, x, config)
    with OpCounter() as mirror_ops:
        run_step(meta, view, inputs[0], config)
    # A fresh object, so the first commit pass follows no draft loop on its table either.
    meta, view, recorder = recorded_mirror(config)
    with H2DCounter(recorder) as commit_first:
        for x in inputs:
            run_step_commit_first(meta, view, x, config)
    reference, reference_view = build("reference", config, torch.device("cpu"))
    run_step(reference, reference_view, inputs[0], config)
    with OpCounter() as reference_ops:
        run_step(reference, reference_view, inputs[0], config)
    return {"config": {"R": config.max_requests, "N": config.active,
                       "W": config.block_columns, "K": config.depths},
            "h2d_bytes_per_step": {"mirror": in_order.nbytes / len(inputs),
                                   "mirror, commit first": commit_first.nbytes / len(inputs),
                                   "upstream flow": upstream_h2d_bytes(config, inputs)},
            "ops_per_step": {
                "mirror": {"data_ops": mirror_ops.data_ops,
                           "syncs": mirror_ops.scalar_reads},
                "reference": {"data_ops": reference_ops.data_ops,
                              "syncs": reference_ops.scalar_reads}}}
