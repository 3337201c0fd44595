"""Pure-torch reference implementation of the ``MTPMetadata`` contract.

This module is the **oracle and performance baseline** for ``mtpmeta``. It does every
step the way the upstream class does, op for op where upstream's class defines the step
(row ops, lengths staging, ``write_token_maps`` and ``write_mha_metadata``, pad writes
guarded by ``if padded > n`` as upstream guards them): one small torch op per field,
host ints read back with ``.item()`` where upstream reads them (so it syncs with the
device where upstream does). Its torch-op counts per method on the standard step are
asserted against upstream's measured ones (``tests/test_op_budget.py``), so "x times
the reference" in the bench means "x times upstream". It shares no code with the fast (numba) path on purpose, so a bug in one cannot
hide in the other. Readability beats speed here; the only validation is what the
contract's semantics need (docs/contract.md §8's input checks are the fast path's job).

Terms: ``R = max_requests``, ``W = max_kv_block_count``, ``BS = block_size_tokens``,
``D = dummy_block_idx``, ``n = active_request_count``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from mtpmeta.reference.view import ReferenceGPUView
from mtpmeta.reference.writers import on_device as _on, write_mha_metadata, write_token_maps
from mtpmeta.types import ForwardShape, MTPForwardMode

__all__ = ["ReferenceMTPMetadata"]

Index = Union[slice, int, Any]  # slice, int, sequence, numpy array or torch tensor


def _host_index(idx: Index) -> Index:
    """A row index usable on a CPU tensor: slices and ints pass through, the rest become
    a CPU tensor (int64, or bool for a mask)."""
    if isinstance(idx, (slice, int)):
        return idx
    t = torch.as_tensor(idx).cpu()
    return t if t.dtype == torch.bool else t.long()


def _snapshot(x: torch.Tensor, idx: Index) -> torch.Tensor:
    """``x[idx]`` as values read now: advanced indexing (upstream's tensor indices)
    already copies; a slice or an int gives a view, which is cloned."""
    values = x[idx]
    return values.clone() if isinstance(idx, (slice, int)) else values


class ReferenceMTPMetadata:
    """MTP request annotations, chunk carry and KV-cache forward buffers (reference).

    Invariant: after ``allocate`` every buffer has a fixed address; the active views
    (``active_offsets``, ``active_block_table``) are prefixes of the persistent buffers.
    """

    def __init__(
        self,
        enabled: bool,
        max_requests: int,
        max_kv_block_count: int,
        block_size_tokens: int,
        dummy_block_idx: int,
        block_table_dtype: torch.dtype,
        hidden_size: int,
        hidden_dtype: torch.dtype,
    ) -> None:
        self.enabled = enabled
        self.max_requests = max_requests
        self.max_kv_block_count = max_kv_block_count
        self.block_size_tokens = block_size_tokens
        self.dummy_block_idx = dummy_block_idx
        self.block_table_dtype = block_table_dtype
        self.hidden_size = hidden_size
        self.hidden_dtype = hidden_dtype

        self.request_matched_prefix_blocks: Optional[torch.Tensor] = None  # [R] int32, host
        self.offsets: Optional[torch.Tensor] = None  # [R] int32
        self.block_table: Optional[torch.Tensor] = None  # [R, W] block_table_dtype
        self.query_lengths: Optional[torch.Tensor] = None  # [R] int32
        self.kv_lengths: Optional[torch.Tensor] = None  # [R] int32
        self.row_ids: Optional[torch.Tensor] = None  # [R] int64, 0..R-1
        self.chunk_boundary_hidden: Optional[torch.Tensor] = None  # [1, 1, hidden_size] hidden_dtype
        self.active_offsets: Optional[torch.Tensor] = None  # [n] view of offsets
        self.active_block_table: Optional[torch.Tensor] = None  # [n, W] view of block_table

        self.forward_mode = MTPForwardMode.NONE
        self.graphed = False
        self.active_request_count = 0
        self.padded_count = 0
        self.chunk_boundary_valid = False
        self.chunk_boundary_req_id = -1
        self.chunk_boundary_position = -1

    # ------------------------------------------------------------------ state
    @property
    def forward_active(self) -> bool:
        """Whether any MTP forward currently owns the attention metadata."""
        return self.forward_mode is not MTPForwardMode.NONE

    @property
    def is_varlen_forward(self) -> bool:
        """Whether the current MTP forward has ragged per-request query lengths."""
        return self.forward_mode is MTPForwardMode.COMMIT

    def _require_buffers(self, what: str) -> None:
        if not self.enabled:
            raise AssertionError(f"{what}: MTP metadata is disabled (enabled=False)")
        if self.offsets is None:
            raise RuntimeError(f"{what}: buffers are not allocated; call allocate(device) first")

    def allocate(self, device: torch.device, *, mirror: Any = None) -> None:
        """Reserve the persistent buffers (contract §1). ``mirror`` is ignored."""
        if not self.enabled:
            return
        R, W = self.max_requests, self.max_kv_block_count
        self.request_matched_prefix_blocks = torch.zeros(
            R, dtype=torch.int32, pin_memory=torch.cuda.is_available()
        )
        self.offsets = torch.zeros(R, dtype=torch.int32, device=device)
        self.block_table = torch.full(
            (R, W), self.dummy_block_idx, dtype=self.block_table_dtype, device=device
        )
        self.query_lengths = torch.zeros(R, dtype=torch.int32, device=device)
        self.kv_lengths = torch.zeros(R, dtype=torch.int32, device=device)
        self.row_ids = torch.arange(R, dtype=torch.int64, device=device)
        self.chunk_boundary_hidden = torch.zeros(
            1, 1, self.hidden_size, dtype=self.hidden_dtype, device=device
        )
        self.invalidate_chunk_boundary()

    def deallocate(self) -> None:
        """Drop every buffer and active view; leave forward mode; invalidate the carry."""
        self.request_matched_prefix_blocks = self.offsets = self.block_table = None
        self.query_lengths = self.kv_lengths = self.row_ids = None
        self.chunk_boundary_hidden = self.active_offsets = self.active_block_table = None
        self.forward_mode = MTPForwardMode.NONE
        self.invalidate_chunk_boundary()

    # -------------------------------------------------------------- row lifecycle
    def reset_request_rows(self, request_indexes: Index = slice(None)) -> None:
        """``request_matched_prefix_blocks[request_indexes] = 0``."""
        if not self.enabled:
            return
        self._require_buffers("reset_request_rows")
        self.request_matched_prefix_blocks[_host_index(request_indexes)] = 0

    def move_request_rows(self, src_idxs: Index, dst_idxs: Index) -> None:
        """``x[dst] = x[src]``, every source read before any destination is written
        (advanced indexing reads ``x[src]`` into a new tensor first)."""
        if not self.enabled:
            return
        self._require_buffers("move_request_rows")
        x = self.request_matched_prefix_blocks
        src = _host_index(src_idxs)
        x[_host_index(dst_idxs)] = _snapshot(x, src)

    def swap_request_rows(self, src_idxs: Index, dst_idxs: Index) -> None:
        """Read both sides; ``x[dst] = old x[src]``, then ``x[src] = old x[dst]`` (one
        tuple assignment: both right-hand sides are read before either write)."""
        if not self.enabled:
            return
        self._require_buffers("swap_request_rows")
        x = self.request_matched_prefix_blocks
        src, dst = _host_index(src_idxs), _host_index(dst_idxs)
        x[dst], x[src] = _snapshot(x, src), _snapshot(x, dst)

    # ---------------------------------------------------------------- chunk carry
    def invalidate_chunk_boundary(self) -> None:
        """Clear validity and keys; the hidden buffer (and its address) is kept."""
        self.chunk_boundary_valid = False
        self.chunk_boundary_req_id = -1
        self.chunk_boundary_position = -1

    def carry_chunk_boundary(self, hidden: torch.Tensor, req_id: int, position: int) -> None:
        """Copy ``hidden`` (``hidden_size`` elements) into the persistent carry buffer."""
        if not self.enabled:
            return
        self._require_buffers("carry_chunk_boundary")
        self.chunk_boundary_hidden.copy_(hidden.detach().reshape(1, 1, -1))
        self.chunk_boundary_req_id = int(req_id)
        self.chunk_boundary_position = int(position)
        self.chunk_boundary_valid = True

    def take_chunk_boundary(self, req_id: int, seam_position: int) -> torch.Tensor:
        """Return the ``[1, 1, hidden_size]`` carry buffer; raise if it does not match."""
        if not self.chunk_boundary_valid:
            raise AssertionError(
                f"take_chunk_boundary: no valid chunk carry (req_id={req_id}, "
                f"seam_position={seam_position})"
            )
        if self.chunk_boundary_req_id != req_id:
            raise AssertionError(
                f"take_chunk_boundary: carry belongs to req_id={self.chunk_boundary_req_id}, "
                f"not req_id={req_id}"
            )
        if self.chunk_boundary_position != seam_position:
            raise AssertionError(
                f"take_chunk_boundary: carry position {self.chunk_boundary_position} != "
                f"seam_position {seam_position} (req_id={req_id})"
            )
        return self.chunk_boundary_hidden

    def _host_int(self, value: torch.Tensor) -> int:
        """``int(value.item())``: a read-back where upstream reads one (a sync on a
        GPU). A replay on torch's ``meta`` device answers it with the value the host
        knows (``mtpmeta.bench.trace_replay``)."""
        return int(value.item())

    # ----------------------------------------------------------------- draft loop
    def begin_decode(
        self,
        active_request_count: int,
        padded_count: int,
        start_positions: Any,
        block_table_src: Any,
        graphed: bool,
    ) -> None:
        """Copy ``start_positions[:n]`` into ``offsets`` and ``block_table_src[:n]`` into
        ``block_table``, then enter DRAFT."""
        self._require_buffers("begin_decode")
        n = active_request_count
        self.offsets[:n].copy_(torch.as_tensor(start_positions)[:n])
        self.block_table[:n].copy_(torch.as_tensor(block_table_src)[:n])
        self._enter_decode(n, padded_count, graphed)

    def begin_decode_for_capture(self, padded_count: int) -> None:
        """Point ``padded_count`` rows at position 0 of the dummy block; enter DRAFT graphed."""
        if not self.enabled:
            raise AssertionError("begin_decode_for_capture: MTP metadata is disabled")
        self._require_buffers("begin_decode_for_capture")
        p = padded_count
        self.offsets[:p].zero_()
        self.block_table[:p].fill_(self.dummy_block_idx)
        self._enter_decode(p, p, graphed=True)

    def _enter_decode(self, active_request_count: int, padded_count: int, graphed: bool) -> None:
        """Enter DRAFT mode and refresh the active views (prefixes of the buffers)."""
        n = active_request_count
        self.active_request_count = n
        self.padded_count = padded_count
        self.active_offsets = self.offsets[:n]  # [n] int32
        self.active_block_table = self.block_table[:n]  # [n, W]
        self.graphed = graphed
        self.forward_mode = MTPForwardMode.DRAFT

    def advance_decode_step(self) -> None:
        """Advance every active request's write position by one, in place."""
        self.active_offsets += 1

    def end_forward(self) -> None:
        """Leave MTP-forward mode; nothing else changes."""
        self.forward_mode = MTPForwardMode.NONE

    def stage_decode_lengths(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Query lengths all 1, KV lengths ``active_offsets + 1``; both ``[n]`` int32 views."""
        self._require_buffers("stage_decode_lengths")
        n = self.active_request_count
        q = self.query_lengths[:n]
        kv = self.kv_lengths[:n]
        q.fill_(1)
        torch.add(self.active_offsets, 1, out=kv)
        return q, kv

    # ---------------------------------------------------------------- commit pass
    def stage_prefill_lengths(self, append_counts: Any, pad_tokens: int) -> torch.Tensor:
        """Stage commit-pass lengths into ``query_lengths`` and return a ``[P]`` or
        ``[P + 1]`` int32 view (the trailing slot owns the pad rows when ``P < R``).

        One buffer for query and KV lengths (a fresh causal prefill): the pass's
        attention output is meaningful only for spans that start at position 0."""
        self._require_buffers("stage_prefill_lengths")
        counts = torch.as_tensor(append_counts)
        P = counts.numel()
        use_spare = pad_tokens > 0 and P < self.max_requests
        lengths = self.query_lengths[: P + 1 if use_spare else P]
        lengths[:P].copy_(counts.reshape(-1))
        if use_spare:
            lengths[P : P + 1].fill_(pad_tokens)
        elif pad_tokens > 0 and P > 0:  # P == R: the last real request absorbs the pad
            lengths[P - 1 : P] += pad_tokens
        return lengths

    # --------------------------------------------------------- destination writers
    def write_token_maps(
        self,
        gpu_view: ReferenceGPUView,
        rows: Any,
        positions: Any,
        block_table: Any,
        padded_token_count: int,
        inherited_blocks: Any = None,
    ) -> None:
        """Write the five per-token maps for ``T = len(positions)`` tokens, then send pad
        tokens ``T <= t < padded_token_count`` to the dummy block at offset 0
        (``mtpmeta.reference.writers.write_token_maps``)."""
        write_token_maps(gpu_view, rows, positions, block_table, padded_token_count,
                         inherited_blocks, self.block_size_tokens, self.dummy_block_idx)

    def write_mha_metadata(
        self,
        gpu_view: ReferenceGPUView,
        query_lengths: Any,
        kv_lengths: Any,
        block_table: Any,
        padded_request_count: int,
    ) -> None:
        """Write lengths, cumulative lengths and block table for ``n = len(query_lengths)``
        request slots; slots ``n <= i < padded_request_count`` get zero lengths, flat cu
        entries and a ``-1`` block-table row (``mtpmeta.reference.writers``)."""
        write_mha_metadata(gpu_view, query_lengths, kv_lengths, block_table,
                           padded_request_count, self.dummy_block_idx)

    # --------------------------------------------------------- fused step helpers
    def setup_decode_step(self, gpu_view: ReferenceGPUView) -> ForwardShape:
        """Write token maps and MHA metadata for one draft depth (one token per request)."""
        self._require_buffers("setup_decode_step")
        if self.forward_mode is not MTPForwardMode.DRAFT:
            raise RuntimeError(
                f"setup_decode_step: forward_mode is {self.forward_mode}; call begin_decode first"
            )
        n, p = self.active_request_count, self.padded_count
        self.write_token_maps(gpu_view, self.row_ids[:n], self.active_offsets, self.active_block_table, p)
        q, kv = self.stage_decode_lengths()
        self.write_mha_metadata(gpu_view, q, kv, self.active_block_table, p)
        if self.graphed:  # the capture-time bound: a replayed kernel never reads less
            max_k = self.max_kv_block_count * self.block_size_tokens
        else:  # upstream floors the launch bounds of an empty forward at 1
            max_k = self._host_int(self.active_offsets.max() + 1) if n > 0 else 1
        return ForwardShape(
            token_count=n,
            padded_token_count=p,
            request_count=n,
            padded_request_count=p,
            max_seqlen_q=1,
            max_seqlen_k=max_k,
        )

    def setup_commit_pass(
        self,
        gpu_view: ReferenceGPUView,
        append_counts: Any,
        block_table: Any,
        *,
        start_positions: Any = None,
        inherited_blocks: Any = None,
        padded_token_count: Optional[int] = None,
        padded_request_count: Optional[int] = None,
    ) -> ForwardShape:
        """Stage a varlen commit pass: request ``r < P`` writes ``append_counts[r]``
        consecutive positions from ``start_positions[r]`` (0 when None) as row ``r``.

        ``inherited_blocks`` is per request (the active slice of the annotations). When
        ``P == R`` absorbs token padding, the last request's block columns past its
        span read the dummy block (contract §6)."""
        self._require_buffers("setup_commit_pass")
        device = self.offsets.device
        counts = _on(append_counts, device).reshape(-1).long()  # [P]
        P = counts.numel()
        T = self._host_int(counts.sum())

        rows = torch.repeat_interleave(torch.arange(P, device=device), counts,
                                       output_size=T)  # [T] int64
        if start_positions is None:
            starts = torch.zeros(P, dtype=torch.int64, device=device)
        else:
            starts = _on(start_positions, device).reshape(-1)[:P].long()  # [P]
        first_token = torch.cumsum(counts, 0) - counts  # [P] index of each request's 1st token
        token_idx = torch.arange(T, dtype=torch.int64, device=device)  # [T]
        positions = starts[rows] + (token_idx - first_token[rows])  # [T]

        padded = T if padded_token_count is None else padded_token_count
        self.write_token_maps(gpu_view, rows, positions, block_table, padded, inherited_blocks)
        lengths = self.stage_prefill_lengths(counts, padded - T)
        m = lengths.numel()
        mha_padded = max(P if padded_request_count is None else padded_request_count, m)
        self.write_mha_metadata(gpu_view, lengths, lengths, _on(block_table, device)[:P], mha_padded)
        if padded > T and m == P:
            # P == R: request P - 1 absorbed the pad, so it attends over more keys than it
            # writes. Its block columns wholly at or past its span's end read the dummy
            # block, never a -1 or an unwritten block (upstream copies the caller's row).
            span_end = self._host_int(starts[P - 1] + counts[P - 1])
            first = -(-span_end // self.block_size_tokens)  # ceil
            gpu_view.mha_block_table[P - 1, first:] = self.dummy_block_idx
        self.forward_mode = MTPForwardMode.COMMIT
        # Upstream floors the launch bounds of an empty forward at 1.
        max_len = max(self._host_int(lengths.max()), 1) if m > 0 else 1
        return ForwardShape(
            token_count=T,
            padded_token_count=padded,
            request_count=m,
            padded_request_count=mha_padded,
            max_seqlen_q=max_len,
            max_seqlen_k=max_len,
        )
