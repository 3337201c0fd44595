"""The reference's two destination-view writers, upstream's op sequence: one small torch
op per field, pad writes guarded by ``if padded > n`` as upstream guards them.

``ReferenceMTPMetadata.write_token_maps`` / ``write_mha_metadata`` (and its fused
``setup_decode_step`` / ``setup_commit_pass``, through those methods) call these with
the object's block size and dummy block. Terms: ``T`` tokens, ``n`` request slots,
``B`` block-table rows, ``W`` its width, ``D = dummy``.
"""

from __future__ import annotations

from typing import Any

import torch

from mtpmeta.reference.view import ReferenceGPUView

__all__ = ["on_device", "write_token_maps", "write_mha_metadata"]


def on_device(x: Any, device: torch.device) -> torch.Tensor:
    """``torch.as_tensor(x)`` moved to ``device`` (lists, numpy arrays, tensors)."""
    return torch.as_tensor(x).to(device)


_on = on_device


def write_token_maps(
    gpu_view: ReferenceGPUView,
    rows: Any,
    positions: Any,
    block_table: Any,
    padded_token_count: int,
    inherited_blocks: Any,
    block_size: int,
    dummy: int,
) -> None:
    """Write the five per-token maps for ``T = len(positions)`` tokens, then send pad
    tokens ``T <= t < padded_token_count`` to the dummy block at offset 0."""
    device = gpu_view.token_to_pos_ids.device
    rows = _on(rows, device).long()  # [T]
    positions = _on(positions, device)  # [T]
    block_table = _on(block_table, device)  # [R, W]
    T = positions.numel()

    cols = (positions // block_size).to(torch.long)  # [T]
    dest = block_table[rows, cols]  # [T]
    if inherited_blocks is not None:
        inherited = _on(inherited_blocks, device)[rows]  # [T]
        dest = torch.where(cols < inherited, torch.full_like(dest, dummy), dest)

    v = gpu_view
    v.token_to_block_idx[:T] = dest.to(v.token_to_block_idx.dtype)
    v.token_to_local_position_within_kv_block[:T] = (
        positions % block_size
    ).to(v.token_to_local_position_within_kv_block.dtype)
    v.token_to_request_idx[:T] = rows.to(v.token_to_request_idx.dtype)
    v.token_to_position_in_request[:T] = positions.to(v.token_to_position_in_request.dtype)
    v.token_to_pos_ids[:T] = positions.to(v.token_to_pos_ids.dtype)

    if padded_token_count > T:
        v.token_to_block_idx[T:padded_token_count] = dummy
        v.token_to_local_position_within_kv_block[T:padded_token_count] = 0


def write_mha_metadata(
    gpu_view: ReferenceGPUView,
    query_lengths: Any,
    kv_lengths: Any,
    block_table: Any,
    padded_request_count: int,
    dummy: int,
) -> None:
    """Write lengths, cumulative lengths and block table for ``n = len(query_lengths)``
    request slots; slots ``n <= i < padded_request_count`` get zero lengths, flat cu
    entries and a ``-1`` block-table row."""
    device = gpu_view.mha_query_lengths.device
    q = _on(query_lengths, device)  # [n]
    kv = _on(kv_lengths, device)  # [n]
    q = q if q.dim() == 1 else q.reshape(-1)
    kv = kv if kv.dim() == 1 else kv.reshape(-1)
    block_table = _on(block_table, device)  # [B, W]
    n = q.numel()
    B = block_table.shape[0]
    if B > n:
        raise ValueError(
            f"write_mha_metadata: block_table has {B} rows, more than the {n} "
            f"request slots in query_lengths"
        )
    p = padded_request_count
    v = gpu_view

    # Upstream's order: query lengths and their sums, then KV, then the table.
    v.mha_query_lengths[:n] = q.to(v.mha_query_lengths.dtype)
    v.mha_cu_query_seq_lengths[0] = 0
    v.mha_cu_query_seq_lengths[1 : n + 1] = torch.cumsum(q, 0).to(
        v.mha_cu_query_seq_lengths.dtype)
    v.mha_kv_seq_lengths[:n] = kv.to(v.mha_kv_seq_lengths.dtype)
    v.mha_cu_kv_seq_lengths[0] = 0
    v.mha_cu_kv_seq_lengths[1 : n + 1] = torch.cumsum(kv, 0).to(
        v.mha_cu_kv_seq_lengths.dtype)
    v.mha_block_table[:B] = block_table
    if n > B:
        v.mha_block_table[B:n] = dummy

    if p > n:
        v.mha_query_lengths[n:p] = 0
        v.mha_cu_query_seq_lengths[n + 1 : p + 1] = v.mha_cu_query_seq_lengths[n]
        v.mha_kv_seq_lengths[n:p] = 0
        v.mha_cu_kv_seq_lengths[n + 1 : p + 1] = v.mha_cu_kv_seq_lengths[n]
        v.mha_block_table[n:p] = -1
