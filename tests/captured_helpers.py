"""Shared pieces of the captured-draft-loop tests (``tests/test_captured_loop.py`` and
``tests/gpu/test_captured_cuda.py``): the geometry, the field groups, a capturable toy
forward, the step schedule and the depth loop.

Imports only torch, numpy and mtpmeta (no hypothesis, no simulator), so ``tests/gpu``
collects on a GPU box with torch, numba, numpy and pytest alone.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from mtpmeta import VIEW_FIELDS, MTPMetadata
from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.paged import PagedKVCache

__all__ = ["CFG", "R", "W", "BS", "D", "P", "DEPTHS", "VIEW_TOKENS", "REPLAY_COUNTS",
           "FIELDS", "PADDED_FIELDS", "REAL_FIELDS", "CU_FIELDS", "toy_forward", "snapshot",
           "schedule", "run_depths"]

CFG = SimConfig(max_requests=8, block_columns=6, block_size=4, hidden_size=8, heads=2,
                head_dim=4, max_prompt=4, max_new_tokens=4, system_prompts=0)
R, W, BS, D = CFG.max_requests, CFG.block_columns, CFG.block_size, CFG.dummy_block
P, DEPTHS, VIEW_TOKENS = 6, 3, 16
REPLAY_COUNTS = (P, P - 1, 1, 0)
FIELDS = tuple(f.name for f in VIEW_FIELDS)
# Written by the default route on the padded rows / on the real rows only.
PADDED_FIELDS = ("token_to_block_idx", "token_to_local_position_within_kv_block",
                 "mha_query_lengths", "mha_kv_seq_lengths", "mha_block_table")
REAL_FIELDS = ("token_to_request_idx", "token_to_position_in_request", "token_to_pos_ids",
               "offsets", "query_lengths", "kv_lengths")
CU_FIELDS = ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths")


def toy_forward(cache: PagedKVCache, view: Any, x: torch.Tensor, depth: int) -> torch.Tensor:
    """A draft depth's forward over ``P`` rows: append ``k, v`` through the token maps,
    attend through the MHA fields. Fixed shapes, no read-back: capturable."""
    cache.write_rows(view, x + depth, x * 2 - depth, P)
    return cache.attend_decode(x, view, P)


def snapshot(meta: MTPMetadata, view: Any, cache: PagedKVCache,
             out: torch.Tensor) -> Dict[str, torch.Tensor]:
    """What a forward would see after a depth (clones: inside a capture they are the
    graph's static outputs, refreshed by every replay)."""
    snap = {name: getattr(view, name).clone() for name in FIELDS}
    for name in ("offsets", "query_lengths", "kv_lengths"):
        snap[name] = getattr(meta, name).clone()
    snap["k_cache"], snap["v_cache"], snap["attention"] = (cache.k.clone(), cache.v.clone(),
                                                           out.clone())
    return snap


def schedule(seed: int) -> List[Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(n', start positions, block table, inputs) per step; tables name real blocks in
    every row, so a stale pad row that is not masked writes real KV. Starts stay low
    enough that even pad rows advanced through every replay stay in the table."""
    rng = np.random.default_rng(seed)
    steps = []
    for n in REPLAY_COUNTS:
        starts = rng.integers(0, W * BS - DEPTHS * len(REPLAY_COUNTS) - 1, size=R)
        table = rng.permutation(R * W)[:R * W].reshape(R, W)
        x = rng.standard_normal((P, CFG.heads, CFG.head_dim))
        steps.append((n, torch.from_numpy(starts.astype(np.int32)),
                      torch.from_numpy(table.astype(np.int32)),
                      torch.from_numpy(x.astype(np.float32))))
    return steps


def run_depths(meta: MTPMetadata, view: Any, cache: PagedKVCache,
               x: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
    """DEPTHS depths of the current draft loop (setup, toy forward, advance); the
    snapshot after each (inside a capture: the static tensors every replay refreshes)."""
    snaps = []
    for depth in range(DEPTHS):
        meta.setup_decode_step(view)
        out = toy_forward(cache, view, x, depth)
        meta.advance_decode_step()
        snaps.append(snapshot(meta, view, cache, out))
    return snaps
