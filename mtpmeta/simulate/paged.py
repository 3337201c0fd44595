"""The paged MTP KV cache and the two kernels that use the library's metadata.

``PagedKVCache`` holds keys and values as ``[num_blocks + 1, BS, heads, head_dim]``; the
last block is the dummy block ``D`` that pad rows write and pad requests read. Both
kernels take everything they know about the batch from the destination view, exactly
as a fused attention kernel would:

* ``write`` (the KV append): token ``t`` goes to block ``token_to_block_idx[t]``, slot
  ``token_to_local_position_within_kv_block[t]``, for every token row the forward runs
  (pad rows included: the library points them at ``D``);
* ``attend`` (varlen paged attention): request slot ``i`` owns query rows
  ``cu_q[i]:cu_q[i+1]`` and ``cu_kv[i+1] - cu_kv[i]`` keys; its keys are the first
  that many entries of the blocks ``mha_block_table[i, :ceil(kv / BS)]`` laid end to
  end; query ``j`` of ``q`` sits at key position ``kv - q + j`` and attends causally.

``write_rows`` / ``attend_decode`` are the same two kernels in fixed shapes with no
read-back and no check (they cannot raise), so they can be captured in a CUDA graph
with the captured draft loop (contract §12): ``attend_decode`` gathers every slot's
``W * BS`` key positions through its block row (``-1`` clamped into the cache) and
masks those at or past the slot's KV length.

Unwritten cache entries hold NaN, so reading a slot nobody wrote poisons the output.
A block id outside ``[0, D]`` (say ``-1``) is an out-of-bounds access on a GPU; here
it raises ``Mismatch`` instead.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import math

import torch
from torch import Tensor

from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.mismatch import Mismatch
from mtpmeta.simulate.model import causal_attention

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Keys and values of the MTP layer, paged; see the module docstring."""

    def __init__(self, config: SimConfig, device: torch.device) -> None:
        shape = (config.num_blocks + 1, config.block_size, config.heads, config.head_dim)
        self.block_size = config.block_size
        self.dummy = config.dummy_block
        self.k = torch.full(shape, float("nan"), dtype=config.dtype, device=device)
        self.v = torch.full(shape, float("nan"), dtype=config.dtype, device=device)

    def snapshot(self) -> Tuple[Tensor, Tensor]:
        return self.k.clone(), self.v.clone()

    def changed_slots(self, before: Tuple[Tensor, Tensor]) -> Tensor:
        """``[num_blocks + 1, BS]`` bool: slots whose key or value differs from
        ``before`` (NaN equal to NaN)."""
        out = None
        for now, old in ((self.k, before[0]), (self.v, before[1])):
            differs = (now != old) & ~(torch.isnan(now) & torch.isnan(old))
            differs = differs.flatten(2).any(dim=2)
            out = differs if out is None else out | differs
        return out

    def write(self, view: Any, k: Tensor, v: Tensor, rows: int) -> None:
        """Append ``k, v [rows, heads, head_dim]`` through the view's token maps."""
        if rows == 0:
            return
        blocks = view.token_to_block_idx[:rows].long()
        slots = view.token_to_local_position_within_kv_block[:rows].long()
        bad = ((blocks < 0) | (blocks > self.dummy) | (slots < 0)
               | (slots >= self.block_size)).nonzero()
        if bad.numel():
            t = int(bad[0, 0])
            raise Mismatch("paged write", f"token row {t} of {rows} would write outside "
                           f"the cache (blocks 0..{self.dummy}, slots "
                           f"0..{self.block_size - 1})", expected="a block in range",
                           got=(int(blocks[t]), int(slots[t])))
        self.k[blocks, slots] = k
        self.v[blocks, slots] = v

    def attend(self, q: Tensor, view: Any, slots: int) -> Tuple[Tensor, List[List[int]]]:
        """Varlen paged causal attention for request slots ``0..slots-1`` of the view.

        Returns the output ``[q rows, heads, head_dim]`` (zero for rows no slot owns)
        and, per slot, the block ids it read (the checker compares them with what the
        request owns). Reads the metadata back to the host: a simulation, not a kernel.
        """
        out = torch.zeros_like(q)
        cu_q = view.mha_cu_query_seq_lengths[:slots + 1].tolist()
        cu_kv = view.mha_cu_kv_seq_lengths[:slots + 1].tolist()
        table = view.mha_block_table[:slots].tolist()
        reads: List[List[int]] = []
        for i in range(slots):
            q_len, kv_len = cu_q[i + 1] - cu_q[i], cu_kv[i + 1] - cu_kv[i]
            if q_len == 0 and kv_len == 0:
                reads.append([])
                continue
            if q_len < 0 or kv_len < q_len or cu_q[i + 1] > q.shape[0]:
                raise Mismatch("paged read", f"request slot {i}: {q_len} query rows "
                               f"(cu_q {cu_q[i]}..{cu_q[i + 1]} of {q.shape[0]} rows) and "
                               f"{kv_len} keys cannot be attended",
                               expected="0 <= q <= kv, rows in range",
                               got=(q_len, kv_len))
            columns = -(-kv_len // self.block_size)
            if columns > len(table[i]):
                raise Mismatch("paged read", f"request slot {i}: {kv_len} keys need "
                               f"{columns} block columns, the table has {len(table[i])}")
            blocks = table[i][:columns]
            for column, block in enumerate(blocks):
                if not 0 <= block <= self.dummy:
                    raise Mismatch("paged read", f"request slot {i} reads block {block} "
                                   f"at column {column} (kv length {kv_len}): outside "
                                   f"the cache, an out-of-bounds read on a GPU",
                                   expected=f"a block in 0..{self.dummy}", got=block)
            reads.append(blocks)
            index = torch.tensor(blocks, device=q.device)
            keys = self.k[index].flatten(0, 1)[:kv_len]
            values = self.v[index].flatten(0, 1)[:kv_len]
            positions = torch.arange(kv_len - q_len, kv_len, device=q.device)
            rows = slice(cu_q[i], cu_q[i + 1])
            out[rows] = causal_attention(q[rows], keys, values, positions)
        return out, reads

    # ------------------------------------------------------------ capturable twins
    def write_rows(self, view: Any, k: Tensor, v: Tensor, rows: int) -> None:
        """``write`` with no bounds check or read-back (capturable): token rows
        ``[0, rows)`` of the view, pad rows included, get ``k, v [rows, heads, dim]``."""
        blocks = view.token_to_block_idx[:rows].long()
        slots = view.token_to_local_position_within_kv_block[:rows].long()
        self.k.index_put_((blocks, slots), k)
        self.v.index_put_((blocks, slots), v)

    def attend_decode(self, q: Tensor, view: Any, slots: int) -> Tensor:
        """One draft depth's paged attention for request slots ``0..slots-1``, query row
        ``i`` of ``q [slots, heads, dim]`` in slot ``i``, in fixed shapes (capturable).

        Reads ``cu_q``/``cu_kv`` (a slot with no query row outputs 0), the KV lengths
        implied by ``cu_kv`` and ``mha_block_table``; the last query of a slot sits at
        its last key, so a draft query attends over all ``kv`` keys. Returns
        ``[slots, heads, dim]``.
        """
        block_size = self.block_size
        table = view.mha_block_table[:slots].long().clamp(0, self.dummy)  # [s, W]
        span = table.shape[1] * block_size
        positions = torch.arange(span, device=q.device)  # [L]
        cu_q = view.mha_cu_query_seq_lengths[:slots + 1].long()
        cu_kv = view.mha_cu_kv_seq_lengths[:slots + 1].long()
        has_query = (cu_q[1:] - cu_q[:-1]) > 0  # [s]
        valid = positions[None, :] < (cu_kv[1:] - cu_kv[:-1])[:, None]  # [s, L]
        blocks = table[:, positions // block_size]  # [s, L]
        local = (positions % block_size)[None, :].expand_as(blocks)
        keys = torch.where(valid[..., None, None], self.k[blocks, local], 0.0)
        values = torch.where(valid[..., None, None], self.v[blocks, local], 0.0)
        scores = (keys * q[:, None]).sum(-1) / math.sqrt(q.shape[-1])  # [s, L, heads]
        weights = torch.softmax(scores.masked_fill(~valid[..., None], float("-inf")), 1)
        weights = torch.where(valid[..., None], weights, 0.0)  # no key: 0, not NaN
        out = (weights[..., None] * values).sum(1)  # [s, heads, dim]
        return torch.where(has_query[:, None, None], out, 0.0)
