"""``ViewWriters``: the two standalone writers of the destination view (contract §7),
``write_token_maps`` and ``write_mha_metadata``, the calls upstream's context helpers
make.

Each validates at the boundary (``mtpmeta.validation.writer_inputs``), hands the work
to the backend's host or device route and records the call in ``last_forward`` for
``check_invariants``.
"""

from __future__ import annotations

from typing import Any, Optional

from mtpmeta.calls.allocation import Allocation
from mtpmeta.calls.state import CallState, raise_unavailable
from mtpmeta.types import ForwardRecord
from mtpmeta.validation.bounds import refuse_whole_annotations
from mtpmeta.validation.writer_inputs import check_mha_inputs, check_token_inputs

__all__ = ["ViewWriters"]


class ViewWriters:
    """The view writers over one allocation.

    Binds the allocation's backend, ``Geometry``, ``ForwardMemo``, ``InheritedCopies``
    and the ``[R]`` int32 ``request_matched_prefix_blocks``; all None without an
    allocation. Invariant: a refused write changes nothing; a write in any forward mode
    leaves the mode as it was.
    """

    __slots__ = ("_state", "_backend", "_geometry", "_memo", "_inherited", "_annotations")

    def __init__(self, state: CallState) -> None:
        self._state = state
        self.install(None)

    def install(self, allocation: Optional[Allocation]) -> None:
        """Bind ``allocation`` (None: no buffers)."""
        if allocation is None:
            self._backend = self._geometry = self._memo = None
            self._inherited = self._annotations = None
            return
        self._backend = allocation.backend
        self._geometry = allocation.geometry
        self._memo = allocation.memo
        self._inherited = allocation.inherited
        self._annotations = allocation.buffers.request_matched_prefix_blocks

    def write_token_maps(self, gpu_view: Any, rows: Any, positions: Any, block_table: Any,
                         padded_token_count: Any, inherited_blocks: Any) -> None:
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
        backend = self._backend
        if backend is None:
            raise_unavailable(self._state, "write_token_maps")
        state = self._state
        if state.annotation_offset and inherited_blocks is not None:
            refuse_whole_annotations("write_token_maps", inherited_blocks,
                                     self._annotations, state.annotation_offset)
        target = self._memo.target(gpu_view)
        rows, positions, table, inherited, count, padded, on_device = check_token_inputs(
            self._geometry, target, rows, positions, block_table, padded_token_count,
            inherited_blocks)
        (backend.write_token_maps_device if on_device else backend.write_token_maps)(
            target, rows, positions, table, inherited, padded)
        kept = (backend.device_route.keep_inherited(target, inherited) if on_device
                else self._inherited.copy(inherited))  # the device route's: no allocation
        state.last_forward = ForwardRecord("tokens", gpu_view, count, padded, 0, 0, kept,
                                           table if on_device else None)

    def write_mha_metadata(self, gpu_view: Any, query_lengths: Any, kv_lengths: Any,
                           block_table: Any, padded_request_count: Any) -> None:
        """Write the per-request MHA read metadata for ``n = len(query_lengths)``.

        Lengths and running sums for slots ``< n``; block rows ``< B`` from
        ``block_table`` and ``[B, n)`` all ``D``; padded slots ``[n,
        padded_request_count)`` get zero lengths, flat sums and -1 rows.
        ``kv_lengths`` may be the very same tensor as ``query_lengths``. Host block
        tables must fit ``gpu_view.mha_block_table``'s dtype (``-1`` entries are fine);
        device tensors are not value-checked.
        """
        backend = self._backend
        if backend is None:
            raise_unavailable(self._state, "write_mha_metadata")
        target = self._memo.target(gpu_view)
        q, kv, table, count, padded, on_device = check_mha_inputs(
            self._geometry, target, query_lengths, kv_lengths, block_table,
            padded_request_count)
        (backend.write_mha_metadata_device if on_device else backend.write_mha_metadata)(
            target, q, kv, count, table, padded)
        self._state.last_forward = ForwardRecord("mha", gpu_view, 0, 0, count, padded)
