"""``MTPMetadata``'s two standalone writers of the destination view (contract §7):
``write_token_maps`` and ``write_mha_metadata``, the calls upstream's context helpers
make. A mixin of ``MTPMetadata`` (``mtpmeta.metadata``): each validates at the
boundary (``mtpmeta.validation.checks``), hands the work to the backend's host or device route
and records the call in ``last_forward`` for ``check_invariants``.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from mtpmeta.validation.writer_inputs import check_mha_inputs, check_token_inputs
from mtpmeta.types import ForwardRecord

__all__ = ["ViewWriters"]


class ViewWriters:
    """The writer half of ``MTPMetadata`` (see the module docstring)."""

    def write_token_maps(self, gpu_view: Any, rows: Tensor, positions: Tensor,
                         block_table: Tensor, padded_token_count: int,
                         inherited_blocks: Optional[Tensor] = None) -> None:
        """Write the per-token KV destination maps for ``T = len(positions)`` tokens.

        ``col = positions // BS``; block ``D`` when ``col < inherited_blocks[rows]``,
        else ``block_table[rows, col]``; local ``positions % BS``; request ``rows``;
        both position fields ``positions``. Pad rows ``[T, padded_token_count)`` get
        block ``D`` and local 0 and nothing else. rows, positions: int [T];
        block_table: int [B, >= cols]; inherited_blocks: int [> max(rows)], each in
        ``[0, max_kv_block_count]``, refused when it is ``request_matched_prefix_blocks``
        from row 0 while ``draft_annotation_offset`` is non-zero (pass the active
        slice). On the host every block a token writes (one not redirected to ``D``)
        must be ``>= 0`` and fit ``gpu_view.token_to_block_idx``;
        device tensors (mirror path) are not value-checked (a sync): a block column
        outside the table sends the token to ``D``, a block id is converted as torch
        converts it.
        """
        backend = self._require("write_token_maps")
        self._refuse_whole_annotations("write_token_maps", inherited_blocks)
        target = self._memo.target(gpu_view)
        rows, positions, table, inherited, count, padded, on_device = check_token_inputs(
            self._geometry, target, rows, positions, block_table, padded_token_count,
            inherited_blocks)
        (backend.write_token_maps_device if on_device else backend.write_token_maps)(
            target, rows, positions, table, inherited, padded)
        self.last_forward = ForwardRecord("tokens", gpu_view, count, padded, 0, 0,
                                          self._record_inherited(inherited),
                                          table if on_device else None)

    def write_mha_metadata(self, gpu_view: Any, query_lengths: Tensor, kv_lengths: Tensor,
                           block_table: Tensor, padded_request_count: int) -> None:
        """Write the per-request MHA read metadata for ``n = len(query_lengths)``.

        Lengths and running sums for slots ``< n``; block rows ``< B`` from
        ``block_table`` and ``[B, n)`` all ``D``; padded slots ``[n,
        padded_request_count)`` get zero lengths, flat sums and -1 rows.
        ``kv_lengths`` may be the very same tensor as ``query_lengths``. Host block
        tables must fit ``gpu_view.mha_block_table``'s dtype (``-1`` entries are fine);
        device tensors are not value-checked.
        """
        backend = self._require("write_mha_metadata")
        target = self._memo.target(gpu_view)
        q, kv, table, count, padded, on_device = check_mha_inputs(
            self._geometry, target, query_lengths, kv_lengths, block_table,
            padded_request_count)
        (backend.write_mha_metadata_device if on_device else backend.write_mha_metadata)(
            target, q, kv, count, table, padded)
        self.last_forward = ForwardRecord("mha", gpu_view, 0, 0, count, padded)
