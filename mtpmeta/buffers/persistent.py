"""The persistent buffers contract §1 names, born in ``allocate``.

Host truth, device snapshot: the host arrays (the annotations, the host copy of the
draft offsets) are the source of truth for bookkeeping and validation; the device
buffers are fixed-address snapshots that GPU code (and captured CUDA graphs) read. On
the direct path the device is the CPU and the two are the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import numpy as np
import torch

from mtpmeta.buffers.device_runtime import DeviceRuntime, get_runtime

__all__ = ["PersistentBuffers", "BUFFER_NAMES", "PLANNED_DEPTHS", "head_offset", "stage_count"]

#: Draft depths the device-input route precomputes at ``begin_decode``
#: (``mtpmeta.mirror.device_draft_plan``); its int32 rows share one allocation with ``draft_head``.
PLANNED_DEPTHS = 8

def head_offset(max_requests: int) -> int:
    """Index of ``draft_head`` (``draft_count``, then ``offsets``) in ``draft_plan``: the
    last entry of the ``[PLANNED_DEPTHS + 1, R + 1]`` sums that start the block."""
    return (PLANNED_DEPTHS + 1) * (max_requests + 1) - 1


# The buffers contract §1 names, as MTPMetadata exposes them (None when not allocated).
BUFFER_NAMES = ("request_matched_prefix_blocks", "offsets", "block_table", "query_lengths",
                "kv_lengths", "row_ids", "chunk_boundary_hidden")


@dataclass
class PersistentBuffers:
    """Every buffer contract §1 lists, with the numpy views the host kernels use."""

    request_matched_prefix_blocks: torch.Tensor  # [R] int32, host (pinned with CUDA)
    offsets: torch.Tensor  # [R] int32, device: draft write position per request
    block_table: torch.Tensor  # [R, W] block_table_dtype, device: draft-loop table
    query_lengths: torch.Tensor  # [R] int32, device: MHA query lengths staging
    kv_lengths: torch.Tensor  # [R] int32, device: MHA KV lengths staging
    row_ids: torch.Tensor  # [R] int64, device: constant 0..R-1
    chunk_boundary_hidden: torch.Tensor  # [1, 1, H] hidden_dtype, device: the carry
    annotations: np.ndarray  # numpy view of request_matched_prefix_blocks
    row_scratch: np.ndarray  # [2R] int32: move/swap snapshot space
    # [1] int32, device: the captured draft loop's real request count (contract §12). It
    # sits right before ``offsets`` in one allocation, so ``draft_head[:n + 1]`` (count
    # then offsets[:n]) is one copy.
    draft_count: Optional[torch.Tensor] = None
    draft_head: Optional[torch.Tensor] = None  # [R + 1] int32: draft_count, offsets
    # Flat int32 device block of the device-input route's depth plan (mtpmeta.mirror.device_draft_plan):
    # the [PLANNED_DEPTHS + 1, R + 1] cumulative sums (each depth's KV sums, then the
    # query sums), whose last entry is draft_count, overlapping the
    # [2, PLANNED_DEPTHS + 2, R + 1] position and local-offset rows whose row [0, 0] is
    # draft_head (``head_offset``). So one scan writes draft_count with every cumulative
    # sum, and one op writes offsets with the planned positions and local offsets.
    draft_plan: Optional[torch.Tensor] = None
    # [2, R] int32, device: query_lengths and kv_lengths as its rows (one row scan
    # gives both cumulative sums).
    lengths: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, *, max_requests: int, max_kv_block_count: int, dummy_block_idx: int,
                 block_table_dtype: torch.dtype, hidden_size: int,
                 hidden_dtype: torch.dtype, device: torch.device,
                 runtime: Optional[DeviceRuntime] = None,
                 annotations: Optional[torch.Tensor] = None) -> "PersistentBuffers":
        """The buffers; ``annotations``: an ``[R]`` int32 host tensor of an earlier
        allocation under ``runtime`` to take over (zeroed), else a new one."""
        runtime = runtime if runtime is not None else get_runtime()
        # [R] int32 host, pinned when CUDA is present.
        if annotations is None or tuple(annotations.shape) != (max_requests,) or \
                annotations.dtype != torch.int32:
            annotations = runtime.host_empty((max_requests,), torch.int32)
        annotations.zero_()
        # [2, R] int32: query and KV length staging side by side, so a copy of both
        # rows of a prefix is one strided op.
        lengths = torch.zeros((2, max_requests), dtype=torch.int32, device=device)
        row, start = max_requests + 1, head_offset(max_requests)
        plan = torch.zeros(start + row * 2 * (PLANNED_DEPTHS + 2), dtype=torch.int32,
                           device=device)
        head = plan[start:start + row]
        return cls(
            request_matched_prefix_blocks=annotations,
            offsets=head[1:],
            block_table=torch.full((max_requests, max_kv_block_count), dummy_block_idx,
                                   dtype=block_table_dtype, device=device),
            query_lengths=lengths[0],
            kv_lengths=lengths[1],
            row_ids=torch.arange(max_requests, dtype=torch.int64, device=device),
            chunk_boundary_hidden=torch.zeros((1, 1, hidden_size), dtype=hidden_dtype,
                                              device=device),
            annotations=annotations.numpy(),
            row_scratch=np.zeros(2 * max_requests, dtype=np.int32),
            draft_count=head[:1],
            draft_head=head,
            draft_plan=plan,
            lengths=lengths,
        )


def stage_count(head: np.ndarray, count: int) -> None:
    """Write a draft loop's real request count ``n`` where the device count comes from:
    ``head`` is ``[>= 1]`` int32, a begin slot's head (mirror: copied with the offsets)
    or ``buffers.draft_count`` itself (direct). Every ``begin_decode`` and
    ``begin_decode_for_capture`` of both backends calls it through this module (the
    negative-control seam of the tests), so a graph captured with ``capture_setup``
    replayed after any begin masks rows ``[n, padded)`` as pad rows."""
    head[0] = count
