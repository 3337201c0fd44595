"""Counting the bytes the mirror path moves host-to-device, on any device.

Every host-to-device copy of the mirror path reads a host staging tensor that the
runtime seam (``mtpmeta.buffers.device_runtime``) handed out: its rings are born from
``runtime.host_empty``. ``StagingRecorder`` is a ``TorchRuntime`` that remembers those
storages; ``H2DCounter`` (a dispatch mode) sums the bytes of every ``copy_`` whose source
is one of them. So the count is the same on a GPU (pinned -> device) and on the CPU-forced
mirror path the bench runs without one.
"""

from __future__ import annotations

from typing import Any, Sequence, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtpmeta.buffers.device_runtime import TorchRuntime

__all__ = ["StagingRecorder", "H2DCounter"]

_COPY = "aten::copy_"


class StagingRecorder(TorchRuntime):
    """A ``TorchRuntime`` that records the storage of every host tensor it allocates.
    Build an ``MTPMetadata`` under ``use_runtime(recorder)`` to have its staging known."""

    def __init__(self) -> None:
        self.storages: Set[int] = set()

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        tensor = super().host_empty(shape, dtype)
        self.storages.add(tensor.untyped_storage().data_ptr())
        return tensor


class H2DCounter(TorchDispatchMode):
    """While active: ``copies`` and ``nbytes`` of the ``copy_`` ops reading a recorded
    staging storage (the host-to-device copies of the mirror path)."""

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

