"""Megatron's client placement, for the trace bench's engine-placement rows.

Upstream's client (``MTPControllerMixin``) calls the context's MTP helpers every step
with its inputs placed so:

- ``_mtp_setup_prefill_step(append_counts, block_table_prefill, padded_token_count=...,
  padded_request_count=..., request_start_positions=..., total=...)``: device int64
  ``[A]`` counts, a fresh ``.to(device)`` copy of the context table's active rows
  (int32 ``[A, W]``), device int64 ``[A]`` start positions, and ``total`` (the caller
  has read it already);
- ``mtp_metadata.carry_chunk_boundary(prefill_hidden[last_row], req_id, position)``
  for a request whose prefill continues in the next chunk: the hidden is a row of the
  forward's packed hidden states, a device tensor;
- ``_mtp_begin_decode(A, padded, start_positions, graphed=True)`` with device int64
  start positions; the helper reads the context's host
  (pinned) table ``request_to_kv_block_ids`` and its per-row host arrays;
- the depths through ``_mtp_setup_decode_step`` and ``advance_decode_step``.

:class:`EnginePlacement` builds each step's inputs that way (untimed: the client's own
work, the same on every row) and makes the step's calls through an engine context:
upstream's helpers on the reference (``UpstreamEngineContext``, the baseline) or the
helpers ``patch()`` installs (``megatron.helpers``).

Read-backs. Torch's ``meta`` device holds no values, so a read-back there has to be
answered from the trace, and is counted as it is answered:

- upstream's go through the reference's ``_host_int`` (``HostKnownReference``);
- the patched helpers read the client's device inputs back only through the runtime's
  ``to_host`` (a blocking copy on a GPU). On ``meta`` the inputs are real ``meta``
  tensors, as on a GPU they are real device tensors, and :class:`PlacementRuntime`
  answers each ``to_host`` of a meta tensor with the next of the values the same read
  returned on the CPU, for that step, in order (``expect``): its shape and dtype must
  be the recorded ones, and a read with none left, or a step that leaves one unread,
  raises. Any other read-back of a meta tensor (``.item()``, ``.tolist()``, ...)
  cannot run and stops the replay, so none goes uncounted.
- On the CPU (the agreement check, and the pass that records those values:
  ``trace_replay.known_syncs``) the inputs are :class:`DeviceHeld` tensors: device
  tensors to the library (``PlacementRuntime.is_device``; contract §8), held in host
  memory with the trace's values. Each read-back of one, through ``to_host`` (whose
  values the runtime records, ``recorded``) or any tensor method (``.item()``,
  ``.cpu()``, ``.tolist()``, ``.numpy()``, a copy into the host), is answered with
  those values and counted with its bytes.

A held tensor's Python ``__torch_function__`` runs on every op on it, which a GPU's
device tensor does not pay; the timed rows run on ``meta`` and pay none of it.
"""

from __future__ import annotations

import types
from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Set

import torch

from mtpmeta.bench.engine_context import EngineContext
from mtpmeta.buffers.device_runtime import use_runtime
from mtpmeta.integrations.megatron import helpers

__all__ = ["DeviceHeld", "PlacementRuntime", "EnginePlacement",
           "patched_engine"]

#: The tensor methods that read a tensor's values into the host.
_READS = frozenset((torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy,
                    torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
                    torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__array__))


def _reads_back(func: Any, args: tuple, kwargs: dict, host: Set[int]) -> bool:
    """Whether ``func(*args, **kwargs)`` reads a held device tensor into the host. A
    copy does when its destination is host memory: on a CPU replay the library's
    device buffers are CPU tensors too, so that is memory the runtime's ``host_empty``
    made (``host``: their storages' addresses)."""
    if func in _READS:
        return True
    if func is torch.Tensor.to:
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
    if func is torch.Tensor.copy_:
        dst = args[0]
        return not isinstance(dst, DeviceHeld) and dst.is_cpu and \
            dst.untyped_storage().data_ptr() in host
    return False


class DeviceHeld(torch.Tensor):
    """A device input held in host memory: what the host can only read back. Every
    read (``.cpu()``, ``.tolist()``, ``.numpy()``, ``.item()``, ``int()``, a copy or
    ``.to`` into the host) is counted by the class's ``runtime`` and answered with the
    values; every other op keeps the result a held device tensor."""

    runtime: "PlacementRuntime"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _reads_back(func, args, kwargs, cls.runtime.host_storages):
            return super().__torch_function__(func, types, args, kwargs)
        held = next(a for a in args if isinstance(a, DeviceHeld))
        cls.runtime.count(held)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            return result.as_subclass(torch.Tensor) if isinstance(result, torch.Tensor) \
                else result


#: The runtime calls a ``PlacementRuntime`` leaves to its inner runtime.
_INNER_CALLS = ("record_stream", "event", "current_stream", "is_capturing",
                "synchronize", "fence")


class PlacementRuntime:
    """A device runtime (``mtpmeta.buffers.device_runtime``) over ``inner`` that also
    takes the tensors made by :meth:`mark` (``DeviceHeld``) as device tensors, and
    answers and counts each read-back (``syncs``, ``read_bytes``): of a held tensor,
    through ``to_host`` or any tensor method, with its values (a ``to_host`` one also
    appended to ``recorded``); of a ``meta`` tensor, through ``to_host``, with the
    next value :meth:`expect` was given (module docstring).

    ``holds``: whether it takes held tensors; without them (a replay on meta) which
    tensors are the device's is ``inner``'s answer, asked directly, and every call but
    ``to_host`` costs what it costs on ``inner``, so a timed row pays no more for its
    runtime than on a GPU."""

    def __init__(self, inner: Any, holds: bool = True) -> None:
        self.inner = inner
        self.holds = holds
        self.syncs = 0
        self.read_bytes = 0
        self.recorded: List[torch.Tensor] = []
        self.host_storages: Set[int] = set()  # host_empty's
        self._known: Optional[Deque[torch.Tensor]] = None
        self.held = type("DeviceHeld", (DeviceHeld,), {"runtime": self})
        for name in _INNER_CALLS:  # bound once: no look-up through this object per call
            setattr(self, name, getattr(inner, name))
        if not holds:
            self.is_device, self.is_host = inner.is_device, inner.is_host

    def __getattr__(self, name: str) -> Any:  # anything else inner has
        return getattr(self.inner, name)

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``inner``'s host memory, its storage noted as the host's (``_reads_back``)."""
        tensor = self.inner.host_empty(shape, dtype)
        self.host_storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a device tensor held in host memory; ``ValueError`` on a runtime
        that holds none."""
        if not self.holds:
            raise ValueError("mark: this runtime takes no held tensors (holds=False)")
        return tensor.as_subclass(self.held)

    def count(self, tensor: torch.Tensor) -> None:
        """One read-back of ``tensor``: a sync, and its bytes."""
        self.syncs += 1
        self.read_bytes += tensor.numel() * tensor.element_size()

    def expect(self, values: Optional[Sequence[torch.Tensor]]) -> None:
        """The values of the next ``to_host`` reads of meta tensors, in order (a step's:
        ``recorded`` by the same step on the CPU); None: none. ``RuntimeError`` when the
        values expected before are not all read."""
        if self._known:
            raise RuntimeError(f"meta read-backs: {len(self._known)} known read-back(s) "
                               f"left unread, the next of shape "
                               f"{tuple(self._known[0].shape)} {self._known[0].dtype}")
        self._known = None if values is None else deque(values)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, DeviceHeld) or self.inner.is_device(tensor)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return not self.is_device(tensor)

    def to_host(self, tensor: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A host copy of a device tensor (a blocking copy on a GPU), into ``out``
        when given."""
        if isinstance(tensor, DeviceHeld):
            self.count(tensor)
            with torch._C.DisableTorchFunctionSubclass():
                value = tensor.as_subclass(torch.Tensor).clone()
            self.recorded.append(value.clone())
        elif tensor.is_meta:  # the known value is kept for the next pass: copied out
            value = self._answer(tensor)
            return value.clone() if out is None else out.copy_(value)
        else:
            return self.inner.to_host(tensor, out=out)
        return value if out is None else out.copy_(value)

    def _answer(self, tensor: torch.Tensor) -> torch.Tensor:
        """The next expected value for a read of the meta ``tensor``; ``RuntimeError``
        when none is left or it is not of ``tensor``'s shape and dtype."""
        if not self._known:
            raise RuntimeError(f"{_read(tensor)}: no known value left for it")
        value = self._known.popleft()
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            raise RuntimeError(f"{_read(tensor)}: the known value is "
                               f"{tuple(value.shape)} {value.dtype}")
        self.count(tensor)
        return value


def _read(tensor: torch.Tensor) -> str:
    return f"a read-back of a meta {tuple(tensor.shape)} {tensor.dtype} tensor"


def patched_engine(metadata: Any, gpu_view: Any, block_table: torch.Tensor,
                   graph_max_seqlen: int, block_counts: bool) -> EngineContext:
    """An engine context whose helpers are those ``patch()`` installs with its
    ``block_counts`` setting."""
    engine = EngineContext(metadata, gpu_view, block_table, graph_max_seqlen)
    for name, helper in helpers(block_counts).items():
        setattr(engine, name, types.MethodType(helper, engine))
    return engine


class EnginePlacement:
    """Drives ``engine`` with the client's placement on ``device``; ``runtime``: the
    patched helpers' :class:`PlacementRuntime` (None for upstream's)."""

    def __init__(self, engine: Any, device: torch.device,
                 runtime: Optional[PlacementRuntime]) -> None:
        self.engine, self.device, self.runtime = engine, device, runtime
        self.counts = self.table = self.starts = self.draft_starts = self.carry = None
        self.total = 0

    def _device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the client's device input: a real device (``meta``) tensor, or
        on the CPU a held one for the patched helpers (a plain one for upstream's)."""
        if self.device.type == "cpu" and self.runtime is not None:
            return self.runtime.mark(tensor.clone())
        return tensor.to(self.device)

    def prepare(self, step: Any) -> None:
        """The step's context state and client inputs (untimed)."""
        engine = self.engine
        requests = step.inherited.numel()
        engine.paused_request_count, engine.total_request_count = 0, requests
        engine.request_matched_prefix_blocks[:requests] = step.inherited
        engine.request_kv_block_counts.copy_(step.block_counts)
        active = engine.request_to_kv_block_ids[0:requests][:step.append_counts.numel()]
        self.counts = self._device(step.append_counts.to(torch.int64))
        self.table = self._device(active)
        self.starts = self._device(step.commit_starts.to(torch.int64))
        self.total = int(step.append_counts.sum())
        self.draft_starts = self._device(step.start_positions.to(torch.int64))
        # The carried hidden is a row of the forward's packed hidden states, a device
        # tensor (on the CPU replays, where the library cannot tell, a host one).
        self.carry = None if step.carry is None else (
            step.carry[0].view(-1).to(self.device), *step.carry[1:])

    def run(self, step: Any, meta: Any, depths: int) -> None:
        """The step's commit pass and graphed draft loop through the engine's helpers;
        the patched helpers see this placement's runtime, as the one the metadata was
        allocated under (the helpers ask ``get_runtime()`` which tensors are device
        ones)."""
        if self.runtime is None:
            self._run(step, meta, depths)
            return
        with use_runtime(self.runtime):
            self._run(step, meta, depths)

    def _run(self, step: Any, meta: Any, depths: int) -> None:
        engine = self.engine
        engine._mtp_setup_prefill_step(self.counts, self.table,
                                       padded_token_count=step.padded_tokens,
                                       padded_request_count=step.padded_requests,
                                       request_start_positions=self.starts,
                                       total=self.total)
        meta.end_forward()
        if self.carry is not None:
            meta.carry_chunk_boundary(*self.carry)
        engine._mtp_begin_decode(step.active, step.padded, self.draft_starts, graphed=True)
        for _ in range(depths):
            engine._mtp_setup_decode_step()
            meta.advance_decode_step()
        meta.end_forward()

