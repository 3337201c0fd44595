"""The checks of the row-lifecycle calls' index pairs (``move_request_rows``,
``swap_request_rows``) and the decoding of a row kernel's refusal.

A single index argument (``reset_request_rows``) is ``inputs.as_row_indices`` alone.
The range of every index is checked by the row kernel before its first write;
``raise_refused_row_pair`` names the index it refused.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from mtpmeta.validation.geometry import Geometry
from mtpmeta.validation.inputs import as_row_indices, raise_row_out_of_range

__all__ = ["check_row_pair", "raise_refused_row_pair"]


def check_row_pair(geo: Geometry, method: str, src_idxs: Any,
                   dst_idxs: Any) -> Tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` index arrays of equal length for a move or swap. Their range is
    checked by the row kernel (``raise_refused_row_pair`` decodes its refusal)."""
    num_rows = geo.max_requests
    src = as_row_indices(src_idxs, num_rows, "src_idxs")
    dst = as_row_indices(dst_idxs, num_rows, "dst_idxs")
    if type(src) is slice:
        src = np.arange(num_rows)[src]
    if type(dst) is slice:
        dst = np.arange(num_rows)[dst]
    if len(src) != len(dst):
        raise ValueError(f"{method}: src_idxs has {len(src)} rows but dst_idxs "
                         f"has {len(dst)}; they must have the same length")
    return src, dst


def raise_refused_row_pair(geo: Geometry, src: np.ndarray, dst: np.ndarray,
                           bad: int) -> None:
    """``bad`` from a pair kernel: the index it refused (nothing written), -1 for none;
    ``[0, len(src))`` counts into ``src``, the rest into ``dst``."""
    if bad >= 0:
        count = src.shape[0]
        if bad < count:
            raise_row_out_of_range(src, bad, geo.max_requests, "src_idxs")
        raise_row_out_of_range(dst, bad - count, geo.max_requests, "dst_idxs")
