"""Placing staged data: many ``(destination, source)`` copies issued as few torch ops.

The mirror path ends every staged forward with a dozen small device-to-device copies
(token maps, lengths, cumulative sums, block-table rows) from its device stage and its
persistent buffers into the destination view. ``CopyPlan`` turns such a list into one
``torch._foreach_copy_`` per dtype group, after reading every 4- or 8-byte integer
field as int32 words (the same bytes, so an int64 field joins the int32 group: the
layout of upstream's view, with int64 block ids, costs the same ops as mtpmeta's).
Only a copy that converts a dtype (an int64 persistent table into an int32 view) goes
as its own ``copy_``.

Cost note: CUDA's ``_foreach_copy_`` takes its fused path (one multi-tensor-apply
launch per group, for groups that fit one launch's tensor list) only when every
tensor of both lists has one dtype and one device and is non-overlapping and dense,
which is why the plan word-views and groups first; otherwise it falls back to one copy
launch per pair (the same work as plain ``copy_`` calls, no worse). On the CPU the
dispatcher sees one op either way; ``gpu_check.sh`` must confirm the launch count
with the profiler.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from mtpmeta.buffers.grad_mode import kept_dtype_view

__all__ = ["CopyPlan", "word_view", "forward_pairs"]

CopyPair = Tuple[Tensor, Tensor]  # (destination, source)


def word_view(tensor: Tensor) -> Tensor:
    """``tensor`` read as int32 words when it is a contiguous 4- or 8-byte integer
    tensor with a unit last stride (an ``[n]`` int64 becomes ``[2n]`` int32, an
    ``[n, W]`` one ``[n, 2W]``); else ``tensor`` itself.

    >>> word_view(torch.tensor([1, -1])).tolist()
    [1, 0, -1, -1]
    """
    dtype = tensor.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or \
            dtype.itemsize not in (4, 8) or tensor.dim() == 0 or \
            not tensor.is_contiguous() or tensor.stride(-1) != 1:  # size-1: any stride
        return tensor
    return tensor if dtype == torch.int32 else kept_dtype_view(tensor, torch.int32)


class CopyPlan:
    """A fixed list of copies, grouped: ``groups`` (one ``_foreach_copy_`` each) and
    ``singles`` (one ``copy_`` each: dtype conversions and lone pairs). Empty pairs are
    dropped. Built once per shape and cached; ``run`` issues ``ops`` torch ops.

    >>> dst, src = torch.zeros(6, dtype=torch.int32), torch.arange(6, dtype=torch.int32)
    >>> wide = torch.zeros(2, dtype=torch.int64)
    >>> plan = CopyPlan([(dst[:2], src[:2]), (dst[4:], src[2:4]),
    ...                  (wide, torch.tensor([7, -1]))])
    >>> plan.ops, (plan.run(), dst.tolist(), wide.tolist())[1:]
    (1, ([0, 1, 0, 0, 2, 3], [7, -1]))
    """

    __slots__ = ("groups", "singles")

    def __init__(self, pairs: Sequence[CopyPair]) -> None:
        by_dtype: Dict[Tuple[torch.dtype, torch.device], List[CopyPair]] = {}
        singles: List[CopyPair] = []
        for dst, src in pairs:
            if dst.numel() == 0:
                continue
            if dst.dtype != src.dtype or dst.device != src.device:
                singles.append((dst, src))
                continue
            dst_words, src_words = word_view(dst), word_view(src)
            if dst_words.shape != src_words.shape:  # one side not word-viewable
                dst_words, src_words = dst, src
            by_dtype.setdefault((dst_words.dtype, dst_words.device), []).append(
                (dst_words, src_words))
        self.groups: List[Tuple[List[Tensor], List[Tensor]]] = []
        for members in by_dtype.values():
            if len(members) == 1:
                singles.append(members[0])
            else:
                self.groups.append(([d for d, _ in members], [s for _, s in members]))
        self.singles = singles

    @property
    def ops(self) -> int:
        """Torch ops one ``run`` dispatches."""
        return len(self.groups) + len(self.singles)

    def run(self) -> None:
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        for dst, src in self.singles:
            dst.copy_(src, non_blocking=True)


def forward_pairs(view: Any, staged: Any, buffers: Any, minus_one: Tensor, tokens: int,
                  real_tokens: int, requests: Optional[int], to_lengths: str,
                  lengths_count: int, device_rows: int,
                  device_table: Tensor) -> List[CopyPair]:
    """The copies that place one staged forward of the mirror path (its per-shape
    route, ``ForwardStaging.flush`` in ``forward_staging``) as ``(destination,
    source)`` pairs.

    ``view``/``staged``: the view's and the device stage's fields by name (the stage's
    fields exactly as long as the forward writes them); ``buffers``: the persistent
    buffers; ``minus_one``: a device ``[R * W]`` int32 block of -1. Block and local
    offset over ``[:tokens]``; request, position and pos id over ``[:real_tokens]``
    only (pad rows keep theirs). With ``requests``: the lengths ``[:requests]``, sums
    ``[:requests + 1]``, table rows ``[:device_rows]`` from ``device_table`` (the
    persistent ``block_table`` for a draft depth, the private reuse table for a commit
    pass), the stage's rows next, -1 rows up to ``requests``. ``to_lengths``: ``"pair"`` (the
    persistent query and KV lengths ``[:lengths_count]``), ``"query"`` or ``""``.
    """
    pairs = [(getattr(view, name)[:tokens], getattr(staged, name)[:tokens])
             for name in ("token_to_block_idx", "token_to_local_position_within_kv_block")]
    pairs += [(getattr(view, name)[:real_tokens], getattr(staged, name)[:real_tokens])
              for name in ("token_to_request_idx", "token_to_position_in_request",
                           "token_to_pos_ids")]
    if requests is not None:
        pairs += [(view.mha_query_lengths[:requests], staged.mha_query_lengths),
                  (view.mha_kv_seq_lengths[:requests], staged.mha_kv_seq_lengths),
                  (view.mha_cu_query_seq_lengths[:requests + 1],
                   staged.mha_cu_query_seq_lengths),
                  (view.mha_cu_kv_seq_lengths[:requests + 1],
                   staged.mha_cu_kv_seq_lengths)]
        table = view.mha_block_table
        staged_end = device_rows + staged.mha_block_table.shape[0]
        pad_rows = requests - staged_end
        pairs += [(table[:device_rows], device_table[:device_rows]),
                  (table[device_rows:staged_end], staged.mha_block_table),
                  (table[staged_end:requests],
                   minus_one[:pad_rows * table.shape[1]].view(pad_rows, table.shape[1]))]
    if to_lengths == "pair":
        pairs += [(buffers.query_lengths[:lengths_count],
                   staged.mha_query_lengths[:lengths_count]),
                  (buffers.kv_lengths[:lengths_count],
                   staged.mha_kv_seq_lengths[:lengths_count])]
    elif to_lengths == "query":
        pairs.append((buffers.query_lengths[:lengths_count],
                      staged.mha_query_lengths[:lengths_count]))
    return pairs
