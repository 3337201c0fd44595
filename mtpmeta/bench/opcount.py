"""Counting torch ops, device read-backs and new tensor storage under a dispatch mode.

``OpCounter`` watches every aten op dispatched while it is active. The hygiene tests
and the bench command use it to prove (and report) that the draft loop and the
commit-pass staging make no host-device sync and allocate nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["OpCounter"]

_SCALAR_READ = "aten::_local_scalar_dense"


def _storages(values: Iterable[Any]) -> List[int]:
    pointers = []
    for value in values:
        if isinstance(value, torch.Tensor):
            pointers.append(value.untyped_storage().data_ptr())
    return pointers


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
