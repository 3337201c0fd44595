"""``DeviceLifecycle``: the one rule for device memory that outlives a call.

Persistent buffers, staging rings, device stages, the landing zone and a view's scratch
are created, re-sized and dropped on whatever stream is current then, while other
streams may use them before or after (an engine's copy stream beside its compute
stream, a resume on another stream after a suspend). Each of those moments goes through
this object, and both directions follow one rule:

* ``born()``, after a set of buffers was created and initialised (``allocate``, a
  staging re-size): the host waits until the device ran the initialisation, so a first
  use on *any* stream, stream-ordered or not, sees initialised memory;
* ``retire()``, before a set of buffers is dropped (``deallocate``, a re-``allocate``, a
  staging re-size, a view's scratch leaving the view cache): the host waits until the
  device ran every op queued so far, so the caching allocator can never hand the memory
  to a new allocation while a queued op on another stream still reads or writes it.

Both are one device synchronize (``DeviceRuntime.synchronize``), at moments that are
rare by construction: never inside the draft loop or a commit pass's staging (the
forward staging re-sizes O(log n) times over a process, only in a writer or commit pass
larger than ``allocate``'s ``max_tokens``). On the CPU both are no-ops. ``syncs``
counts them.

``drop(held)`` is ``retire()`` for an object that may be dropped during a CUDA graph
capture (a view's scratch leaving the view cache when a captured depth resolves a new
view), where a synchronize is illegal and breaks the capture: there it keeps ``held``
alive instead, and the next synchronize outside a capture (any ``born``, ``retire`` or
``drop``) covers it and lets it go.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from mtpmeta.buffers.device_runtime import DeviceRuntime, get_runtime

__all__ = ["DeviceLifecycle"]


class DeviceLifecycle:
    """Orders buffer creation and dropping on ``device`` against every stream's use
    (module docstring)."""

    __slots__ = ("_runtime", "_device", "_held", "syncs")

    def __init__(self, device: torch.device,
                 runtime: Optional[DeviceRuntime] = None) -> None:
        self._runtime = runtime if runtime is not None else get_runtime()
        self._device = device
        self._held: List[Any] = []  # dropped during a capture, released by the next sync
        self.syncs = 0

    def born(self) -> None:
        """Buffers were just created and initialised on the current stream: make every
        later use, on any stream, come after their initialisation."""
        self._settle()

    def retire(self) -> None:
        """Buffers are about to be dropped: make the drop come after every queued use,
        on any stream."""
        self._settle()

    def drop(self, held: Any) -> None:
        """``held`` (an object holding device buffers) is being dropped: ``retire()``
        now; inside a capture, keep it until the next synchronize outside one."""
        if self._runtime.is_capturing(self._device):
            self._held.append(held)
            return
        self.retire()

    @property
    def holding(self) -> int:
        """How many objects dropped during a capture still wait for a synchronize."""
        return len(self._held)

    def _settle(self) -> None:
        self._runtime.synchronize(self._device)  # a no-op for the CPU
        self.syncs += 1
        self._held.clear()  # the synchronize covered every use of what they hold
