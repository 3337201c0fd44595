"""``CommitPass``: the varlen commit pass (contract §6): ``stage_prefill_lengths`` and
the fused ``setup_commit_pass``.

Each call validates at the boundary (``mtpmeta.validation.checks``), then hands the work
to the backend; the backend's kernel scans the written blocks and inherited counts
before its first write and reports a refusal, which is raised here with nothing
written.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from torch import Tensor

from mtpmeta.calls.allocation import Allocation
from mtpmeta.calls.state import CallState, raise_unavailable
from mtpmeta.kernels import native
from mtpmeta.types import ForwardRecord, ForwardShape, MTPForwardMode
from mtpmeta.validation.request_rows import leading_length, raise_split_ended
from mtpmeta.validation.bounds import refuse_whole_annotations
from mtpmeta.validation.checks import (check_commit_inputs, check_device_rows,
                                       check_prefill_lengths, raise_commit_block,
                                       refuse_unallocated_inherited)

__all__ = ["CommitPass"]

_record_spans = native.checks.record_commit_spans

_COMMIT = MTPForwardMode.COMMIT


class CommitPass:
    """The commit pass's calls over one allocation.

    Binds the allocation's backend, ``Geometry``, ``ForwardMemo`` (and its ``shapes``),
    ``InheritedCopies`` and the ``[R]`` int32 ``request_matched_prefix_blocks`` (to
    refuse it whole while ``draft_annotation_offset`` is non-zero; ``_rows``, its numpy
    view, is a split's default redirect), and ``_spans``, ``[2, R]`` int64, where a
    split-served pass keeps its spans by context row; all None without an allocation.
    Invariant: a refused pass leaves the view, the buffers, ``forward_mode`` and the
    split as they were.
    """

    __slots__ = ("_state", "_backend", "_geometry", "_memo", "_shapes", "_inherited",
                 "_annotations", "_rows", "_spans")

    def __init__(self, state: CallState) -> None:
        self._state = state
        self.install(None)

    def install(self, allocation: Optional[Allocation]) -> None:
        """Bind ``allocation`` (None: no buffers)."""
        if allocation is None:
            self._backend = self._geometry = self._memo = self._shapes = None
            self._inherited = self._annotations = self._rows = self._spans = None
            return
        self._backend = allocation.backend
        self._geometry = allocation.geometry
        self._memo = allocation.memo
        self._shapes = allocation.memo.shapes
        self._inherited = allocation.inherited
        self._annotations = allocation.buffers.request_matched_prefix_blocks
        self._rows = allocation.buffers.annotations  # its numpy view
        self._spans = np.zeros((2, allocation.geometry.max_requests), dtype=np.int64)

    def stage_prefill_lengths(self, append_counts: Any, pad_tokens: Any) -> Tensor:
        """Stage a varlen commit pass's lengths, absorbing ``pad_tokens`` TP pad rows.

        ``P = len(append_counts)``. The returned view of ``query_lengths`` is
        ``P + 1`` long when ``pad_tokens > 0 and P < R`` (the pad rows get their own
        trailing request), else ``P`` long (a full batch grows its last entry).
        Example: ``[3, 2]``, pad 3 -> ``[3, 2, 3]``; with R = 2 -> ``[3, 5]``.

        One buffer serves as query and KV lengths (a fresh causal prefill), so the
        pass's attention output is a request's true attention only for a span that
        starts at position 0; a span starting later populates KV, and its output is
        not meaningful (a token at ``start + j`` attends over positions ``0..j``).
        """
        backend = self._backend
        if backend is None:
            raise_unavailable(self._state, "stage_prefill_lengths")
        counts, pad, on_device = check_prefill_lengths(self._geometry, append_counts,
                                                       pad_tokens)
        staged = (backend.stage_prefill_lengths_device if on_device
                  else backend.stage_prefill_lengths)(counts, pad)
        return self._memo.prefill_view(staged)

    def setup(self, gpu_view: Any, append_counts: Any, block_table: Any,
              start_positions: Any, inherited_blocks: Any, padded_token_count: Any,
              padded_request_count: Any, block_counts: Any,
              device_block_table: Any = None) -> ForwardShape:
        """The whole varlen commit pass in one call; sets ``forward_mode = COMMIT``.

        Request ``r`` (row ``r`` of ``block_table``) writes ``append_counts[r]``
        consecutive positions from ``start_positions[r]`` (0 when None). Token maps with
        the inherited-block redirect, padded to ``padded_token_count`` (default: the
        total ``T``); ``stage_prefill_lengths`` with ``pad = padded_token_count - T``; MHA
        metadata over ``max(padded_request_count or P, staged)`` slots with one length
        buffer for query and KV.

        append_counts: int [P]; block_table: int [>= P, view width]; start_positions,
        inherited_blocks: int [>= P]. Host inputs are checked in full and cost no sync;
        device tensors are read back to the host with one ``.cpu()`` each, one sync
        each: ``append_counts``, ``block_table``, ``start_positions`` and
        ``inherited_blocks`` (their values decide the staging and the returned shape).
        Keep them on the host to keep the commit pass free of syncs.
        ``inherited_blocks`` is per commit-pass request (entry ``i``: request ``i``'s
        count, in ``[0, max_kv_block_count]``, copied for ``check_invariants`` at the
        call). With a split declared (``set_request_rows``) it defaults to the
        annotation rows ``[paused, paused + P)``, and the whole annotations give those
        rows too. Without one, upstream's: None redirects nothing and an array is read
        from entry 0, so pass the active slice ``request_matched_prefix_blocks[paused:
        total]`` (the whole buffer while ``draft_annotation_offset`` is non-zero is
        refused, a ``ValueError``).
        Block ids: the rows ``block_table[:P]`` must fit ``gpu_view.mha_block_table``,
        and every block a token writes (not redirected) must be ``>= 0`` and fit
        ``gpu_view.token_to_block_idx``; refused before anything is written.

        Attention output: KV length equals query length (a fresh causal prefill), so
        it is meaningful only for spans starting at position 0; later spans populate
        KV. ``ForwardShape.max_seqlen_q == max_seqlen_k`` is the largest staged length
        (at least 1). When ``P == R`` and there is token padding, request ``P - 1``
        absorbs the pad rows and its KV span runs past what it writes: its
        ``mha_block_table`` columns that lie wholly at or past ``start + count`` point at
        the dummy block (upstream copies the caller's row, -1 entries included).
        Example: BS 4, R 2, counts [3, 3], tables [[0, -1], [1, -1]], 8 tokens ->
        lengths [3, 5], request 1 reads row [1, D]. ``block_counts``: opt-in, contract §5.
        ``device_block_table``: the same rows ``[>= P, W]`` already on the buffers'
        device (an engine's ``.to(device)`` copy of ``block_table``, say): the mirror
        path copies the view's ``mha_block_table`` rows from it on the device instead
        of shipping the host rows, so the table's bytes leave the host's cost, while
        ``block_table`` still places and checks every written block. Its rows must
        equal the host rows (not checked: that would read them back); the rows are
        placed as they are (``block_counts`` is then only checked). The direct path
        writes the host rows.
        """
        backend = self._backend
        if backend is None:
            raise_unavailable(self._state, "setup_commit_pass")
        state = self._state
        split = state.split
        if split is not None or state.split_ended:  # validation.request_rows
            if split is None or split.committed:
                raise_split_ended("setup_commit_pass")
            count = leading_length(append_counts)
            (block_table, start_positions, inherited_blocks, block_counts,
             device_block_table) = split.active(
                count, "append_counts", block_table, start_positions, inherited_blocks,
                block_counts, device_block_table)
            if inherited_blocks is None and count is not None:  # prefix hits protected
                inherited_blocks = self._rows[split.paused:split.paused + count]
        if state.annotation_offset and inherited_blocks is not None:
            refuse_whole_annotations("setup_commit_pass", inherited_blocks,
                                     self._annotations, state.annotation_offset)
        target = self._memo.target(gpu_view)
        geometry = self._geometry
        (counts, starts, table, inherited, total, padded_tokens, pad, min_padded,
         padded_requests, used) = check_commit_inputs(
            geometry, target, append_counts, block_table, start_positions,
            inherited_blocks, padded_token_count, padded_request_count, block_counts)
        if inherited is not None:  # before any write, as the kernel's own scan
            refuse_unallocated_inherited(table, inherited, counts, used)
        if device_block_table is not None:  # its rows as they are: counts only checked
            device_block_table = check_device_rows(geometry, device_block_table, table,
                                                   counts.shape[0])
            used = None
        refused, staged, padded_requests, max_len = backend.commit_pass(
            target, counts, starts, table, inherited, padded_tokens, pad, min_padded,
            padded_requests, used, device_block_table)
        if refused < 0:  # a bad written block or inherited count: nothing written
            raise_commit_block(geometry, target, -refused, staged, padded_requests,
                               counts, starts, table, inherited)
        state.mode = _COMMIT
        total = int(total)
        record = state.last_forward = ForwardRecord(
            "commit", gpu_view, total, padded_tokens, staged, padded_requests,
            self._inherited.copy(inherited), None, None if split is None else split.paused)
        if split is not None:  # the spans a draft start must lie past (draft_loop)
            split.committed = True
            _record_spans(counts, counts if starts is None else starts,
                          starts is not None, split.paused, self._spans)
            state.committed = (record, self._spans)
        max_len = int(max_len) if max_len > 1 else 1  # upstream floors an empty one at 1
        fields = (total, padded_tokens, staged, padded_requests, max_len, max_len)
        shape = self._shapes.get(fields)
        return shape if shape is not None else self._memo.shape(*fields)
