"""The checks of the chunk carry's calls: ``carry_chunk_boundary``'s hidden and keys,
and ``take_chunk_boundary``'s match against the live carry (``ChunkCarryError``, an
``AssertionError`` raised explicitly, naming what differs).
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np
from torch import Tensor

from mtpmeta.errors import ChunkCarryError
from mtpmeta.kernels import native
from mtpmeta.validation.bounds import CarryStatus
from mtpmeta.validation.geometry import Geometry
from mtpmeta.validation.inputs import INT64_MAX, as_carry_source, as_count

__all__ = ["check_carry", "check_take"]

_check_take = native.carry.check_take
_INT64_MIN = -INT64_MAX - 1


def check_carry(geo: Geometry, hidden: Any, req_id: Any,
                position: Any) -> Tuple[Tensor, int, int]:
    """``(source, req_id, position)``: ``source`` is ``hidden`` shaped to broadcast
    into the ``[1, 1, H]`` carry (detached), the keys are checked ints."""
    if not (type(req_id) is int and type(position) is int and 0 <= req_id <= INT64_MAX
            and 0 <= position <= INT64_MAX):  # plain ints in range: the hot path
        req_id = as_count(req_id, "req_id", high=INT64_MAX, high_name="int64 max")
        position = as_count(position, "position", high=INT64_MAX, high_name="int64 max")
    return (as_carry_source(hidden, geo.hidden_size, geo.hidden_dtype, geo.device),
            req_id, position)


def check_take(carry_state: np.ndarray, req_id: Any, seam_position: Any) -> None:
    """Whether the live carry (``[valid, req_id, position]``) is ``req_id``'s at
    ``seam_position``; raises ``ChunkCarryError`` naming what differs."""
    if not (type(req_id) is int and type(seam_position) is int and
            _INT64_MIN <= req_id <= INT64_MAX and
            _INT64_MIN <= seam_position <= INT64_MAX):  # else: the checked conversion
        req_id = as_count(req_id, "req_id", low=_INT64_MIN, high=INT64_MAX,
                          high_name="int64 max")
        seam_position = as_count(seam_position, "seam_position", low=_INT64_MIN,
                                 high=INT64_MAX, high_name="int64 max")
    code = _check_take(carry_state, req_id, seam_position)
    if not code:
        return
    if code == CarryStatus.NOT_VALID:
        raise ChunkCarryError(
            f"take_chunk_boundary: no live chunk-boundary carry (chunk_boundary_valid "
            f"is False), but request {req_id} asked for one at position {seam_position}")
    if code == CarryStatus.OTHER_REQUEST:
        raise ChunkCarryError(
            f"take_chunk_boundary: the carry belongs to request "
            f"{int(carry_state[1])}, not request {req_id}")
    if code == CarryStatus.OTHER_POSITION:
        raise ChunkCarryError(
            f"take_chunk_boundary: the carry for request {req_id} sits at position "
            f"{int(carry_state[2])}, but the seam is at {seam_position}")
