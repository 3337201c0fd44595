"""The checks of ``MTPMetadata``'s construction and of ``allocate``'s arguments.

Each raises ``ValueError`` or ``InvalidDtypeError`` naming the argument and the bound
before anything is built; explicit raises, never ``assert``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from mtpmeta.buffers.layout import dtype_range, is_int_dtype
from mtpmeta.errors import InvalidDtypeError
from mtpmeta.validation.inputs import INT32_LIMIT, INT64_MAX, as_count

__all__ = ["check_config", "check_allocate"]


def check_config(max_requests: Any, max_kv_block_count: Any, block_size_tokens: Any,
                 dummy_block_idx: Any, block_table_dtype: Any, hidden_size: Any,
                 hidden_dtype: Any) -> None:
    """The constructor's arguments of an enabled ``MTPMetadata``."""
    for name, value in (("max_requests", max_requests),
                        ("max_kv_block_count", max_kv_block_count),
                        ("block_size_tokens", block_size_tokens),
                        ("hidden_size", hidden_size)):
        as_count(value, name, low=1)
    dummy = as_count(dummy_block_idx, "dummy_block_idx", low=-INT64_MAX - 1)
    if dummy < 0:
        raise ValueError(f"dummy_block_idx: {dummy} < 0; pad tokens write the dummy "
                         "block, so it must be a real scratch block index (>= 0)")
    if not isinstance(block_table_dtype, torch.dtype) or \
            not is_int_dtype(block_table_dtype):
        raise InvalidDtypeError(f"block_table_dtype: expected an integer torch "
                                f"dtype, got {block_table_dtype!r}")
    high = dtype_range(block_table_dtype)[1]
    if dummy > high:
        raise ValueError(f"dummy_block_idx: {dummy} does not fit block_table_dtype "
                         f"{block_table_dtype} (max {high})")
    if not isinstance(hidden_dtype, torch.dtype) or not hidden_dtype.is_floating_point:
        raise InvalidDtypeError(f"hidden_dtype: expected a floating torch dtype, "
                                f"got {hidden_dtype!r}")


def check_allocate(device: Any, mirror: Optional[bool], max_tokens: Any,
                   staging_slots: Any) -> Tuple[torch.device, bool]:
    """``allocate``'s arguments; returns ``(device, mirror)`` with mirror decided."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"allocate: device {device!r} is not a torch device "
                         f"({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"allocate: device {device} requested, but CUDA is not "
                         "available on this machine (a CPU-only torch build or no GPU); "
                         "use allocate('cpu')")
    if mirror is None:
        mirror = device.type != "cpu"
    elif not mirror and device.type != "cpu":
        raise ValueError(f"allocate: mirror=False needs a CPU device, got {device}")
    as_count(max_tokens, "max_tokens", low=1, high=INT32_LIMIT - 1,
             high_name="int32 token index limit")
    as_count(staging_slots, "staging_slots", low=2, high=64, high_name="slot limit")
    return device, mirror
