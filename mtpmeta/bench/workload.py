"""The standard step: one seeded, scheduler-like workload shared by the bench command,
the asv suite and the hygiene tests.

A standard step (defaults of ``StepConfig``) is:

* 256 max requests, 128 block columns of 64 tokens, 192 active requests;
* row compaction: one ``move_request_rows`` of 16 rows, one ``swap_request_rows`` of 4
  pairs, one ``reset_request_rows`` of 16 rows;
* one chunk carry of a ``[1, 1, H]`` hidden and one take at the exact seam;
* a draft loop of 3 depths (``begin_decode`` from the full ``[R, W]`` table, then
  ``setup_decode_step`` + ``advance_decode_step`` per depth, ``end_forward``), eager or,
  with ``StepConfig(graphed=True)``, marked graphed (the forward would replay a graph);
* a commit pass of the 192 decode requests writing 1-4 tokens each plus one 256-token
  prefill chunk that inherits 8 blocks, tokens padded to a multiple of ``tp`` (8).

The inputs have the types the seed declares and a scheduler holds: torch CPU tensors,
int64 row indices (slices of a ``torch.randperm`` and a ``nonzero`` of a finished
mask), int32 positions, counts and tables, each per-request input a slice of a
``[R]`` tensor. ``StepInputs.as_numpy`` gives the same step with numpy arrays, which
the bench keeps as a second row for comparison.

``PRODUCTION`` is the step at a production-like size (R 1024, N 768, W 2048), and
``production_steps`` draws its start positions from a log-normal spread of context
lengths (median 3000 tokens) instead of uniformly over the table: a real engine's
requests use a few percent of the columns, so a cost that follows the capacity rather
than the work shows there.

``make_steps`` draws the inputs once (from ``np.random.default_rng(seed)``), so the
timed loop measures only the library calls; ``run_step`` drives any object with the
MTPMetadata API (the library or the reference) through one step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Dict, List

import numpy as np
import torch

from mtpmeta.buffers.layout import round_up

__all__ = ["StepConfig", "StepInputs", "make_steps", "PRODUCTION", "production_steps",
           "run_step", "run_step_commit_first", "run_step_groups"]


@dataclass(frozen=True)
class StepConfig:
    """Sizes of the standard step (see the module docstring)."""

    max_requests: int = 256
    block_columns: int = 128
    block_size: int = 64
    active: int = 192
    depths: int = 3
    prefill_tokens: int = 256
    inherited_blocks: int = 8
    tp: int = 8
    moves: int = 16
    swaps: int = 4
    resets: int = 16
    hidden_size: int = 64
    graphed: bool = False  # the draft loop's ``graphed`` flag

    def __post_init__(self) -> None:
        if self.active + 1 > self.max_requests:
            raise ValueError(f"StepConfig: active {self.active} + 1 prefill request > "
                             f"max_requests {self.max_requests}")

    @property
    def dummy_block(self) -> int:
        return self.max_requests * self.block_columns  # one past the real block ids

    @property
    def max_tokens(self) -> int:
        decode = self.active * 4
        return round_up(decode + self.prefill_tokens, self.tp) + self.tp

    @property
    def padded_active(self) -> int:
        """The draft loop's ``padded_count``: ``active`` rounded up to ``tp``."""
        return round_up(self.active, self.tp)

    def metadata_kwargs(self) -> Dict[str, Any]:
        return dict(enabled=True, max_requests=self.max_requests,
                    max_kv_block_count=self.block_columns,
                    block_size_tokens=self.block_size, dummy_block_idx=self.dummy_block,
                    block_table_dtype=torch.int32, hidden_size=self.hidden_size,
                    hidden_dtype=torch.float32)


@dataclass
class StepInputs:
    """Inputs of one standard step: torch CPU tensors (or, after ``as_numpy``, numpy
    arrays for every index, count, position and table; the hidden stays a tensor)."""

    move_src: Any  # [moves] int64, a slice of a [R] permutation
    move_dst: Any  # [moves] int64, a slice of the same permutation
    swap_src: Any  # [swaps] int64, a slice
    swap_dst: Any  # [swaps] int64, a slice
    reset_rows: Any  # [resets] int64, nonzero() of a [R] bool mask
    hidden: torch.Tensor  # [1, 1, H] float32
    carry_req_id: int
    carry_position: int
    start_positions: Any  # [active] int32, depth-0 write positions (a slice of [R])
    block_table: Any  # [R, W] int32, the whole table
    append_counts: Any  # [active + 1] int32 (a slice of [R])
    commit_starts: Any  # [active + 1] int32 (a slice of [R])
    inherited: Any  # [active + 1] int32 (a slice of [R])
    padded_tokens: int
    padded_requests: int

    def as_numpy(self) -> "StepInputs":
        """The same step with numpy arrays in place of the index/count/table tensors."""
        return replace(self, **{
            f.name: getattr(self, f.name).numpy() for f in fields(self)
            if f.name != "hidden" and isinstance(getattr(self, f.name), torch.Tensor)})


def make_steps(config: StepConfig = StepConfig(), steps: int = 8,
               seed: int = 0) -> List[StepInputs]:
    """``steps`` standard steps drawn from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    R, W, BS = config.max_requests, config.block_columns, config.block_size
    n = config.active
    # Row compaction never needs more distinct rows than the table has.
    moves = min(config.moves, R // 4)
    swaps = min(config.swaps, R // 8)
    resets = min(config.resets, R)
    out = []
    for step in range(steps):
        rows = torch.from_numpy(rng.permutation(R))  # [R] int64
        table = torch.from_numpy(rng.permutation(R * W).reshape(R, W).astype(np.int32))
        # Depth-0 positions leave room for the draft depths inside the table.
        limit = W * BS - config.depths - 4
        starts = np.zeros(R, dtype=np.int32)
        starts[:n] = rng.integers(0, limit, size=n)
        counts = np.zeros(R, dtype=np.int32)
        counts[:n + 1] = rng.integers(1, 5, size=n + 1)
        counts[n] = config.prefill_tokens
        commit_starts = np.zeros(R, dtype=np.int32)
        commit_starts[:n] = np.maximum(starts[:n] - counts[:n], 0)
        prefill_start = config.inherited_blocks * BS - BS // 2  # crosses the boundary
        commit_starts[n] = prefill_start
        inherited = np.zeros(R, dtype=np.int32)
        inherited[n] = config.inherited_blocks
        finished = torch.zeros(R, dtype=torch.bool)
        finished[torch.from_numpy(rng.choice(R, size=resets, replace=False))] = True
        total = int(counts[:n + 1].sum())
        padded_tokens = round_up(total, config.tp)
        out.append(StepInputs(
            move_src=rows[:moves],
            move_dst=rows[moves:2 * moves],
            swap_src=rows[2 * moves:2 * moves + swaps],
            swap_dst=rows[R - swaps:],
            reset_rows=torch.nonzero(finished, as_tuple=True)[0],
            hidden=torch.from_numpy(rng.standard_normal(config.hidden_size)
                                    .astype(np.float32)).reshape(1, 1, -1),
            carry_req_id=1000 + step,
            carry_position=prefill_start + config.prefill_tokens - 1,
            start_positions=torch.from_numpy(starts)[:n],
            block_table=table,
            append_counts=torch.from_numpy(counts)[:n + 1],
            commit_starts=torch.from_numpy(commit_starts)[:n + 1],
            inherited=torch.from_numpy(inherited)[:n + 1],
            padded_tokens=padded_tokens,
            padded_requests=n + 1,
        ))
    return out


#: The standard step at a production-like size (see the module docstring).
PRODUCTION = StepConfig(max_requests=1024, block_columns=2048, block_size=64, active=768,
                        depths=3, prefill_tokens=256, inherited_blocks=8, tp=8)


def production_steps(config: StepConfig = PRODUCTION, steps: int = 4,
                     seed: int = 0) -> List[StepInputs]:
    """``make_steps`` with start positions from a log-normal spread of context lengths
    (median 3000 tokens, sigma 1, clipped to the table) instead of uniform over the
    table's capacity; the commit starts follow them (start - count, floored at 0)."""
    rng = np.random.default_rng(seed + 1)
    limit = config.block_columns * config.block_size - config.depths - 4
    n = config.active
    out = []
    for step in make_steps(config, steps, seed=seed):
        starts = np.zeros(config.max_requests, dtype=np.int32)
        starts[:n] = np.clip(rng.lognormal(np.log(3000.0), 1.0, n), 0, limit)
        counts = step.append_counts.numpy()
        commit = np.zeros(config.max_requests, dtype=np.int32)
        commit[:n + 1] = step.commit_starts.numpy()
        commit[:n] = np.maximum(starts[:n] - counts[:n], 0)
        out.append(replace(step, start_positions=torch.from_numpy(starts)[:n],
                           commit_starts=torch.from_numpy(commit)[:n + 1]))
    return out


def run_rows(meta: Any, inputs: StepInputs) -> None:
    meta.move_request_rows(inputs.move_src, inputs.move_dst)
    meta.swap_request_rows(inputs.swap_src, inputs.swap_dst)
    meta.reset_request_rows(inputs.reset_rows)


def run_carry(meta: Any, inputs: StepInputs) -> None:
    meta.carry_chunk_boundary(inputs.hidden, inputs.carry_req_id, inputs.carry_position)
    meta.take_chunk_boundary(inputs.carry_req_id, inputs.carry_position)


def run_draft(meta: Any, view: Any, inputs: StepInputs, config: StepConfig) -> None:
    meta.begin_decode(config.active, config.padded_active, inputs.start_positions,
                      inputs.block_table, config.graphed)
    for _ in range(config.depths):
        meta.setup_decode_step(view)
        meta.advance_decode_step()
    meta.end_forward()


def run_commit(meta: Any, view: Any, inputs: StepInputs) -> None:
    meta.setup_commit_pass(view, inputs.append_counts, inputs.block_table,
                           start_positions=inputs.commit_starts,
                           inherited_blocks=inputs.inherited,
                           padded_token_count=inputs.padded_tokens,
                           padded_request_count=inputs.padded_requests)
    meta.end_forward()


def run_step(meta: Any, view: Any, inputs: StepInputs, config: StepConfig) -> None:
    """One standard step: rows, carry, draft loop, commit pass."""
    run_rows(meta, inputs)
    run_carry(meta, inputs)
    run_draft(meta, view, inputs, config)
    run_commit(meta, view, inputs)


def run_step_commit_first(meta: Any, view: Any, inputs: StepInputs,
                          config: StepConfig) -> None:
    """The standard step with the commit pass before the draft loop (an engine that
    commits the accepted tokens first): the commit follows the previous step's draft
    loop, on another table."""
    run_rows(meta, inputs)
    run_carry(meta, inputs)
    run_commit(meta, view, inputs)
    run_draft(meta, view, inputs, config)


#: The method groups the bench reports separately, in step order.
run_step_groups = {
    "rows": lambda meta, view, inputs, config: run_rows(meta, inputs),
    "carry": lambda meta, view, inputs, config: run_carry(meta, inputs),
    "draft depth": run_draft,
    "commit pass": lambda meta, view, inputs, config: run_commit(meta, view, inputs),
}
