"""Boundary checks of ``MTPMetadata`` that depend on its geometry and on the
destination view: counts, padded extents, block columns, shapes of device inputs.

``InputChecks`` is a mixin: every method reads the geometry attributes of the object
(``max_requests``, ``max_kv_block_count``, ``block_size_tokens``, ``device``) and raises
``ValueError``/``IndexError``/``InvalidDtypeError`` naming the argument and the bound,
before anything is written. Raw-input conversion lives in ``mtpmeta.inputs``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from . import native
from .errors import InvalidDtypeError
from .gpu_view import ViewTarget
from .inputs import as_count, as_host_ints

__all__ = ["InputChecks", "INT32_LIMIT", "INT64_MAX", "is_int_dtype"]

INT32_LIMIT = 2**31  # lengths and token indices are int32 in the view
INT64_MAX = 2**63 - 1
_TOKEN_CODES = native.staging
_first_outside = native.checks.first_outside


def is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


class InputChecks:
    """Validation mixin of ``MTPMetadata`` (see the module docstring)."""

    max_requests: int
    max_kv_block_count: int
    block_size_tokens: int
    device: Optional[torch.device]

    def _padded_request_slots(self, padded_count: Any, count: int) -> int:
        padded = as_count(padded_count, "padded_count", high=self.max_requests,
                          high_name="max_requests")
        if padded < count:
            raise ValueError(f"padded_count: {padded} < active_request_count {count}")
        return padded

    def _check_decode_shapes(self, starts: Any, table: Any, count: int) -> None:
        """Shapes of draft inputs (host arrays or device tensors). Host values are
        checked by the copy kernel; device values are not read (that would sync)."""
        if starts.shape[0] < count:
            raise ValueError(f"start_positions: {starts.shape[0]} entries < "
                             f"active_request_count {count}")
        if table.shape[0] < count or table.shape[1] != self.max_kv_block_count:
            raise ValueError(f"block_table_src: shape {tuple(table.shape)}, expected "
                             f"[>= {count}, max_kv_block_count {self.max_kv_block_count}]")

    def _raise_position_error(self, name: str, positions: np.ndarray, count: int) -> None:
        """Name the bad position in ``positions[:count]`` that a kernel refused."""
        low, high = native.checks.min_max(positions, count)
        if low < 0:
            raise ValueError(f"{name}: negative position {low}")
        self._check_block_column(name, high)
        raise ValueError(f"{name}: a position lies outside the block table")

    def _check_device_decode_inputs(self, starts: Tensor, table: Tensor,
                                    count: int) -> None:
        self._check_device_tensors((("start_positions", starts, 1),
                                    ("block_table_src", table, 2)))
        self._check_decode_shapes(starts, table, count)

    def _check_block_column(self, name: str, position: int,
                            columns: Optional[int] = None) -> None:
        columns = self.max_kv_block_count if columns is None else columns
        column = position // self.block_size_tokens
        if column >= columns:
            bound = ("max_kv_block_count" if columns == self.max_kv_block_count
                     else "block_table width")
            raise ValueError(f"{name}: block column {column} >= {bound} {columns} "
                             f"(position {position}, block_size {self.block_size_tokens})")

    def _host_counts(self, value: Any, name: str) -> np.ndarray:
        counts = as_host_ints(value, name)
        if len(counts) > self.max_requests:
            raise ValueError(f"{name}: {len(counts)} requests > max_requests "
                             f"{self.max_requests}")
        bad = _first_outside(counts, 0, INT32_LIMIT)
        if bad >= 0:
            kind = "negative count" if counts[bad] < 0 else "count beyond int32"
            raise ValueError(f"{name}: {kind} {int(counts[bad])} at index {bad}")
        return counts

    def _check_device_counts(self, counts: Tensor) -> Tensor:
        self._check_device_tensors((("append_counts", counts, 1),))
        if counts.shape[0] > self.max_requests:
            raise ValueError(f"append_counts: shape {tuple(counts.shape)}, expected "
                             f"[P <= max_requests {self.max_requests}]")
        return counts

    def _optional_per_request(self, value: Any, name: str,
                              count: int) -> Optional[np.ndarray]:
        if value is None:
            return None
        array = as_host_ints(value, name)
        if len(array) < count:
            raise ValueError(f"{name}: {len(array)} entries < {count} requests "
                             "(append_counts)")
        return array

    @staticmethod
    def _check_view_capacity(target: ViewTarget, *, tokens: int = 0,
                             requests: int = 0) -> None:
        if tokens > target.max_tokens:
            raise ValueError(f"padded token count {tokens} > max_tokens "
                             f"{target.max_tokens} of gpu_view")
        if requests > target.max_requests:
            raise ValueError(f"padded request count {requests} > max_requests "
                             f"{target.max_requests} of gpu_view")

    @staticmethod
    def _check_view_width(target: ViewTarget, width: int, name: str) -> None:
        if width != target.width:
            raise ValueError(f"{name} {width} != gpu_view.mha_block_table width "
                             f"{target.width}")

    def _padded_tokens(self, padded_token_count: Any, count: int,
                       target: ViewTarget) -> int:
        if count > target.max_tokens:
            raise ValueError(f"positions: {count} tokens > max_tokens {target.max_tokens} "
                             "of gpu_view")
        padded = as_count(padded_token_count, "padded_token_count", high=target.max_tokens,
                          high_name="gpu_view max_tokens")
        if padded < count:
            raise ValueError(f"padded_token_count: {padded} < number of tokens {count}")
        return padded

    def _raise_token_error(self, code: int, t: int, rows: np.ndarray,
                           positions: np.ndarray, table: np.ndarray,
                           inherited: Optional[np.ndarray], columns: int) -> None:
        if code == _TOKEN_CODES.ROW_OUT_OF_TABLE:
            raise IndexError(f"rows: row {int(rows[t])} (token {t}) out of range for "
                             f"block_table with {table.shape[0]} rows")
        if code == _TOKEN_CODES.ROW_OUT_OF_INHERITED:
            raise IndexError(f"rows: row {int(rows[t])} (token {t}) out of range for "
                             f"inherited_blocks with {inherited.shape[0]} entries")
        if code == _TOKEN_CODES.NEGATIVE_POSITION:
            raise ValueError(f"positions: negative position {int(positions[t])} "
                             f"(token {t})")
        self._check_block_column(f"positions (token {t})", int(positions[t]), columns)

    def _check_device_tensors(self, named: Tuple[Tuple[str, Any, int], ...]) -> None:
        """Each ``(name, tensor, ndim)``: an integer tensor of ``ndim`` dims on the
        buffers' device (the device-op route takes nothing else)."""
        for name, tensor, ndim in named:
            if not isinstance(tensor, torch.Tensor) or tensor.device != self.device:
                raise ValueError(f"{name}: with device inputs every input must be a "
                                 f"tensor on {self.device}")
            if not is_int_dtype(tensor.dtype):
                raise InvalidDtypeError(f"{name}: dtype {tensor.dtype} is not an integer "
                                        "dtype")
            if tensor.dim() != ndim:
                raise ValueError(f"{name}: expected {ndim}-D, got shape "
                                 f"{tuple(tensor.shape)}")

    def _check_device_token_inputs(self, rows: Any, positions: Any, block_table: Any,
                                   inherited: Any) -> int:
        named = (("rows", rows, 1), ("positions", positions, 1),
                 ("block_table", block_table, 2), ("inherited_blocks", inherited, 1))
        self._check_device_tensors(named[:3] if inherited is None else named)
        if rows.shape[0] != positions.shape[0]:
            raise ValueError(f"rows: {rows.shape[0]} entries, positions: "
                             f"{positions.shape[0]}; they must have the same length")
        return positions.shape[0]

    def _check_mha_shapes(self, target: ViewTarget, count: int, kv_count: int,
                          table_shape: Tuple[int, ...]) -> None:
        if kv_count != count:
            raise ValueError(f"kv_lengths: {kv_count} entries, query_lengths: {count}; "
                             "they must have the same length")
        if table_shape[0] > count:
            raise ValueError(f"block_table: {table_shape[0]} rows > {count} requests "
                             "(query_lengths)")
        self._check_view_width(target, table_shape[1], "block_table width")

    def _padded_requests(self, padded_request_count: Any, count: int,
                         target: ViewTarget) -> int:
        if count > target.max_requests:
            raise ValueError(f"query_lengths: {count} requests > max_requests "
                             f"{target.max_requests} of gpu_view")
        padded = as_count(padded_request_count, "padded_request_count",
                          high=target.max_requests, high_name="gpu_view max_requests")
        if padded < count:
            raise ValueError(f"padded_request_count: {padded} < number of requests "
                             f"{count}")
        return padded

    def _check_device_mha_inputs(self, target: ViewTarget, query_lengths: Any,
                                 kv_lengths: Any, block_table: Any) -> int:
        named = (("query_lengths", query_lengths, 1), ("kv_lengths", kv_lengths, 1),
                 ("block_table", block_table, 2))
        self._check_device_tensors(named)
        count = query_lengths.shape[0]
        self._check_mha_shapes(target, count, kv_lengths.shape[0], tuple(block_table.shape))
        return count
