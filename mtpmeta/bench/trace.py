"""A seeded continuous-batching trace: every step's library calls, precomputed.

One ``np.random.default_rng(seed)`` drives a small engine model; its output is a list
of :class:`TraceStep`, the per-step call inputs with the seed's types (torch CPU
tensors, int64 row indices, int32 counts and positions, each per-request input a slice
of an ``[R]`` tensor), so every implementation replays exactly the same calls and the
generation is never timed. The model, per step, in engine order:

* Poisson arrivals join a queue; prompt and output lengths are log-normal (clipped
  so a request fits its ``W * BS`` table row with room for the draft depths);
* completions of the previous step are compacted: tail rows ``move`` into the holes
  (the chunked prefill row too), the freed rows are ``reset``; pause/resume pairs
  ``swap`` a decode row with a paused one (paused requests live at the top rows);
* at most one chunked prefill at a time, at row ``n`` after the ``n`` decode rows,
  with a prefix hit (whole matched blocks, its ``inherited_blocks``) on some
  admissions and the chunk-boundary carry between chunks (take, then carry);
* the commit pass: each decode request accepts 1..K+1 tokens, the prefill commits
  its chunk; tokens padded to a multiple of 8, requests to a multiple of 8 (CUDA-graph
  buckets); new blocks are appended to the host table as requests grow;
* the draft loop of the ``n`` decode requests, graphed at ``padded = round_up(n, 8)``.

Table changes are stored as the rows they set (``table_rows``, ``table_values``), to
be applied to the replay's own ``[R, W]`` host table before the step's calls. Each
step also carries every row's block count (``block_counts``: the blocks the engine
gave the row, its leading non-negative entries), for the opt-in ``block_counts=`` of
``begin_decode`` / ``setup_commit_pass`` (contract §5).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Tuple

import numpy as np
import torch

from mtpmeta.buffers.layout import round_up
from mtpmeta.bench.workload import StepConfig

__all__ = ["TraceConfig", "TraceStep", "STANDARD_TRACE", "PRODUCTION_TRACE",
           "PRODUCTION_WIDE_TRACE", "make_trace", "trace_shape_stats"]

_BUCKET = 8  # CUDA-graph buckets and the TP token multiple


@dataclass(frozen=True)
class TraceConfig:
    """Geometry and traffic of a trace (lengths in tokens, rates per step)."""

    max_requests: int = 256
    block_columns: int = 128
    block_size: int = 64
    depths: int = 3
    steps: int = 320
    start_active: int = 155
    start_paused: int = 12
    chunk_tokens: int = 256  # prefill tokens per commit pass
    prompt_median: float = 300.0
    output_median: float = 1500.0
    context_median: float = 1500.0  # of the requests running at step 0
    sigma: float = 0.8
    arrival_rate: float = 0.47
    prefix_hit_rate: float = 0.4
    swap_rate: float = 0.3
    hidden_size: int = 64
    pool_columns: int = 0  # the block pool holds R * this (0: block_columns) blocks

    def step_config(self) -> StepConfig:
        """The ``StepConfig`` whose objects hold every step of the trace."""
        return StepConfig(max_requests=self.max_requests, block_columns=self.block_columns,
                          block_size=self.block_size, active=self.max_requests - 1,
                          depths=self.depths, prefill_tokens=self.chunk_tokens,
                          tp=_BUCKET, hidden_size=self.hidden_size, graphed=True)


STANDARD_TRACE = TraceConfig()
PRODUCTION_TRACE = TraceConfig(max_requests=1024, block_columns=2048, block_size=64,
                               depths=3, steps=160, start_active=615, start_paused=40,
                               chunk_tokens=1024, prompt_median=400.0,
                               output_median=3000.0, context_median=3000.0,
                               arrival_rate=1.8)
#: The production traffic on a table 4x as wide (W 8192): the same block pool (so the
#: same random draws) and the same requests, whose lengths stay far below either
#: width, so only the table's width changes.
PRODUCTION_WIDE_TRACE = TraceConfig(**{**PRODUCTION_TRACE.__dict__, "block_columns": 8192,
                                       "pool_columns": PRODUCTION_TRACE.block_columns})


@dataclass
class TraceStep:
    """One step's call inputs (see the module docstring); ``None``: no such call."""

    table_rows: torch.Tensor  # [k] int64: host-table rows set before the step
    table_values: torch.Tensor  # [k, W] int32: their new contents
    move_src: Optional[torch.Tensor]  # [m] int64
    move_dst: Optional[torch.Tensor]  # [m] int64
    swap_src: Optional[torch.Tensor]  # [s] int64
    swap_dst: Optional[torch.Tensor]  # [s] int64
    reset_rows: Optional[torch.Tensor]  # [f] int64
    take: Optional[Tuple[int, int]]  # (req_id, seam position)
    append_counts: torch.Tensor  # [P] int32, slice of [R]
    commit_starts: torch.Tensor  # [P] int32, slice of [R]
    inherited: torch.Tensor  # [P] int32, slice of [R]
    padded_tokens: int
    padded_requests: int
    carry: Optional[Tuple[torch.Tensor, int, int]]  # ([1, 1, H] float32, req_id, position)
    active: int  # n, decode requests of the draft loop
    padded: int  # round_up(n, 8)
    start_positions: torch.Tensor  # [n] int32, slice of [R]
    block_counts: torch.Tensor  # [R] int32: each row's blocks (leading entries >= 0)

    @property
    def token_count(self) -> int:
        return int(self.append_counts.sum())


class _Request:
    __slots__ = ("rid", "prompt", "output", "ctx", "made", "blocks", "matched")

    def __init__(self, rid: int, prompt: int, output: int) -> None:
        self.rid, self.prompt, self.output = rid, prompt, output
        self.ctx = self.made = self.matched = 0
        self.blocks: List[int] = []


class _Engine:
    """The model's state: rows, block pool, host table (numpy), waiting queue."""

    def __init__(self, config: TraceConfig, rng: np.random.Generator) -> None:
        self.c, self.rng = config, rng
        R, W = config.max_requests, config.block_columns
        self.free = rng.permutation(R * (config.pool_columns or W)).tolist()
        self.table = np.full((R, W), -1, dtype=np.int32)
        self.counts = np.zeros(R, dtype=np.int32)  # blocks of each row of the table
        self.dirty: set = set()
        self.decode: List[_Request] = []
        self.paused: List[_Request] = []  # paused[j] sits at row R - 1 - j
        self.prefills: List[_Request] = []  # rows n, n+1, ...: the chunked one last
        self.plan: List[Tuple[_Request, int]] = []
        self.carry: Optional[Tuple[int, int]] = None
        self.waiting: Deque[_Request] = deque()
        self.next_rid = 0
        self.limit = W * config.block_size - config.depths - 2 * (config.depths + 1)

    def lengths(self, median: float, size: int) -> np.ndarray:
        draw = self.rng.lognormal(np.log(median), self.c.sigma, size)
        return np.clip(draw, 1, self.limit // 2).astype(np.int64)

    def new_request(self) -> _Request:
        prompt = int(self.lengths(self.c.prompt_median, 1)[0])
        output = int(self.lengths(self.c.output_median, 1)[0])
        request = _Request(self.next_rid, prompt, output)
        self.next_rid += 1
        return request

    def set_row(self, row: int, request: Optional[_Request]) -> None:
        self.table[row, :self.counts[row]] = -1
        self.counts[row] = 0 if request is None else len(request.blocks)
        if request is not None:
            self.table[row, :len(request.blocks)] = request.blocks
        self.dirty.add(row)

    def take_blocks(self, request: _Request, count: int) -> None:
        """Append ``count`` blocks of the pool to ``request``'s."""
        if count > len(self.free):
            c = self.c
            raise ValueError(f"the block pool (max_requests {c.max_requests} * "
                             f"{c.pool_columns or c.block_columns} pool columns) ran out: "
                             "widen pool_columns or shorten the requests")
        request.blocks.extend(self.free.pop() for _ in range(count))

    def grow(self, row: int, request: _Request, tokens: int) -> None:
        """Append blocks until ``request`` (at ``row``) covers ``tokens`` positions."""
        need = -(-tokens // self.c.block_size)
        have = len(request.blocks)
        if have >= need:
            return
        self.take_blocks(request, need - have)
        self.table[row, have:need] = request.blocks[have:need]
        self.counts[row] = need
        self.dirty.add(row)

    def seed_batch(self) -> None:
        c = self.c
        for index in range(c.start_active + c.start_paused):
            request = self.new_request()
            request.prompt = int(self.lengths(c.context_median, 1)[0])
            request.ctx = request.prompt
            request.made = int(self.rng.integers(0, max(request.output, 1)))
            self.take_blocks(request, -(-(request.ctx + c.depths + 1) // c.block_size))
            (self.decode if index < c.start_active else self.paused).append(request)
        for row, request in enumerate(self.decode):
            self.set_row(row, request)
        for j, request in enumerate(self.paused):
            self.set_row(c.max_requests - 1 - j, request)


def _rows(values: List[int]) -> Optional[torch.Tensor]:
    return torch.tensor(values, dtype=torch.int64) if values else None


def _compact(engine: _Engine) -> Tuple[List[int], List[int], List[int]]:
    """Drop finished decode requests: moves (tail rows into holes, the prefill row
    down), resets of the freed rows."""
    decode = engine.decode
    n = len(decode)
    done = [i for i, r in enumerate(decode) if r.made >= r.output]
    if not done:
        return [], [], []
    for i in done:
        engine.free.extend(decode[i].blocks)
    n_new = n - len(done)
    holes = [i for i in done if i < n_new]
    tail = [i for i in range(n_new, n) if i not in set(done)]
    src, dst = list(tail), list(holes)
    kept = list(decode)
    for s, d in zip(tail, holes):
        kept[d] = decode[s]
    engine.decode = kept[:n_new]
    has_prefill = bool(engine.prefills)  # the chunked one, between chunks
    if has_prefill:
        src.append(n)
        dst.append(n_new)
    occupied_before, occupied = n + has_prefill, n_new + has_prefill
    for row in dst:
        engine.set_row(row, engine.decode[row] if row < n_new else engine.prefills[0])
    resets = list(range(occupied, occupied_before))
    for row in resets:
        engine.set_row(row, None)
    return src, dst, resets


def _swap(engine: _Engine) -> Tuple[List[int], List[int]]:
    """Pause/resume pairs: decode row ``i`` swaps with paused row ``R - 1 - j``."""
    c, rng = engine.c, engine.rng
    if not engine.paused or rng.random() >= c.swap_rate or not engine.decode:
        return [], []
    pairs = int(rng.integers(1, min(3, len(engine.paused), len(engine.decode)) + 1))
    rows = rng.choice(len(engine.decode), size=pairs, replace=False)
    slots = rng.choice(len(engine.paused), size=pairs, replace=False)
    src, dst = [], []
    for i, j in zip(rows.tolist(), slots.tolist()):
        top = c.max_requests - 1 - j
        engine.decode[i], engine.paused[j] = engine.paused[j], engine.decode[i]
        engine.set_row(i, engine.decode[i])
        engine.set_row(top, engine.paused[j])
        src.append(i)
        dst.append(top)
    return src, dst


def _join(engine: _Engine) -> None:
    """Last step's finished prefills (rows ``n, n+1, ...``) join the decode rows; an
    unfinished chunked one (always the last prefill row) becomes row ``n``."""
    finished = [r for r in engine.prefills if r.ctx >= r.prompt]
    engine.decode.extend(finished)
    engine.prefills = [r for r in engine.prefills if r.ctx < r.prompt]


def _admit(engine: _Engine) -> None:
    """Plan this step's prefill rows within ``chunk_tokens``: the chunked request
    first, then waiting requests whole while they fit, the first that does not as the
    new chunked request (the last row: one chunked prefill at a time)."""
    c, rng = engine.c, engine.rng
    budget = c.chunk_tokens
    plan = []
    if engine.prefills:
        chunked = engine.prefills[0]
        plan.append((chunked, min(budget, chunked.prompt - chunked.ctx)))
        budget -= plan[-1][1]
    room = c.max_requests - len(engine.paused) - len(engine.decode) - len(plan) - 1
    while budget > 0 and engine.waiting and room > 0:
        request = engine.waiting.popleft()
        if rng.random() < c.prefix_hit_rate and request.prompt > c.block_size:
            request.matched = int(rng.integers(1, request.prompt // c.block_size + 1))
            request.ctx = min(request.matched * c.block_size, request.prompt - 1)
        plan.append((request, min(budget, request.prompt - request.ctx)))
        budget -= plan[-1][1]
        room -= 1
    engine.prefills = [r for r, _ in plan]
    engine.plan = plan


def _step(engine: _Engine, bucket: int) -> TraceStep:
    c, rng = engine.c, engine.rng
    R, K = c.max_requests, c.depths
    for _ in range(int(rng.poisson(c.arrival_rate))):
        engine.waiting.append(engine.new_request())
    _join(engine)
    move_src, move_dst, resets = _compact(engine)
    _admit(engine)
    swap_src, swap_dst = _swap(engine)
    n = len(engine.decode)
    counts, starts, inherited = (np.zeros(R, dtype=np.int32) for _ in range(3))
    draft_starts = np.zeros(R, dtype=np.int32)
    for i, request in enumerate(engine.decode):
        accepted = int(rng.integers(1, K + 2))
        counts[i], starts[i] = accepted, request.ctx
        request.ctx += accepted
        request.made += accepted
        draft_starts[i] = request.ctx
        engine.grow(i, request, request.ctx + K)
    take, carry, P = engine.carry, None, n
    for row, (request, chunk) in enumerate(engine.plan, start=n):
        counts[row], starts[row], inherited[row] = chunk, request.ctx, request.matched
        request.ctx += chunk
        engine.grow(row, request, request.ctx + K + 1)
        engine.set_row(row, request)
        P = row + 1
        if request.ctx < request.prompt:
            hidden = torch.from_numpy(rng.standard_normal(c.hidden_size)
                                      .astype(np.float32)).reshape(1, 1, -1)
            carry = (hidden, request.rid, request.ctx - 1)
    engine.carry = None if carry is None else (carry[1], carry[2])
    dirty = sorted(engine.dirty)
    engine.dirty = set()
    tokens = int(counts[:P].sum())
    return TraceStep(
        table_rows=torch.tensor(dirty, dtype=torch.int64),
        table_values=torch.from_numpy(engine.table[dirty].copy()),
        move_src=_rows(move_src), move_dst=_rows(move_dst),
        swap_src=_rows(swap_src), swap_dst=_rows(swap_dst), reset_rows=_rows(resets),
        take=take,
        append_counts=torch.from_numpy(counts)[:P],
        commit_starts=torch.from_numpy(starts)[:P],
        inherited=torch.from_numpy(inherited)[:P],
        padded_tokens=round_up(tokens, bucket),
        padded_requests=min(round_up(P, bucket), R),
        carry=carry, active=n, padded=min(round_up(n, bucket), R),
        start_positions=torch.from_numpy(draft_starts)[:n],
        block_counts=torch.from_numpy(engine.counts.copy()))


def _check_config(c: TraceConfig) -> None:
    """Refuse a geometry the engine model cannot run: the starting requests need a row
    each, and a row must hold a request of at least one token with room for the draft
    depths (``_Engine.limit``)."""
    rows = c.start_active + c.start_paused
    if c.start_active < 0 or c.start_paused < 0 or rows > c.max_requests:
        raise ValueError(f"start_active {c.start_active} + start_paused {c.start_paused} "
                         f"must be in [0, max_requests {c.max_requests}]")
    tokens = c.block_columns * c.block_size
    need = c.depths + 2 * (c.depths + 1) + 2
    if tokens < need:
        raise ValueError(f"block_columns {c.block_columns} * block_size {c.block_size} "
                         f"= {tokens} tokens per row: depths {c.depths} need >= {need}")
    if c.chunk_tokens < 1:
        raise ValueError(f"chunk_tokens {c.chunk_tokens} must be >= 1")


def make_trace(config: TraceConfig = STANDARD_TRACE, steps: Optional[int] = None,
               seed: int = 0) -> List[TraceStep]:
    """``steps`` (default ``config.steps``) trace steps from ``default_rng(seed)``.
    A geometry that cannot hold its traffic raises ``ValueError`` naming the bound."""
    _check_config(config)
    rng = np.random.default_rng(seed)
    engine = _Engine(config, rng)
    engine.seed_batch()
    return [_step(engine, _BUCKET) for _ in range(config.steps if steps is None else steps)]


def trace_shape_stats(trace: List[TraceStep]) -> dict:
    """How much the trace's shapes move: the range of ``n``, the distinct
    ``(n, padded)`` pairs and commit token counts, the calls of each kind."""
    active = [s.active for s in trace]
    return {"steps": len(trace), "active_min": min(active), "active_max": max(active),
            "distinct_n_padded": len({(s.active, s.padded) for s in trace}),
            "distinct_commit_tokens": len({s.token_count for s in trace}),
            "moves": sum(s.move_src is not None for s in trace),
            "swaps": sum(s.swap_src is not None for s in trace),
            "resets": sum(s.reset_rows is not None for s in trace),
            "carries": sum(s.carry is not None for s in trace),
            "prefix_hits": sum(int(s.inherited[-1]) > 0 for s in trace
                               if s.inherited.numel() > s.active)}
