"""The scheduler of the dynamic batch: arrivals, admission with prefix matching,
chunk planning, preemption (pause/resume), cancellation, completion and compaction.

Everything random comes from one ``np.random.default_rng(seed)``. Row moves go through
``RowTable`` (library annotations + engine state together) and are verified after each.
Two limits keep the batch inside what the library promises:

* at most one request is prefilled in chunks at a time: the library keeps ONE
  chunk-boundary carry (upstream's context has one chunked request in flight);
* at most ``R - 1`` requests are active, so a commit pass always has ``P < R`` and its
  TP pad rows get their own trailing pad request (contract §6). With ``P == R`` the last
  request would absorb them and read past the blocks it owns (contract §6).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence

import numpy as np

from mtpmeta.simulate.blocks import BlockPool, PrefixCache
from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.rows import Request, RowTable

__all__ = ["Scheduler"]


class Scheduler:
    """Decides, each step, which requests run and with how many prompt tokens."""

    def __init__(self, config: SimConfig, rng: np.random.Generator, rows: RowTable,
                 stats: Dict[str, int]) -> None:
        self.config = config
        self.rng = rng
        self.rows = rows
        self.stats = stats
        self.pool = BlockPool(config.num_blocks)
        self.prefix = PrefixCache(config.block_size)
        self.waiting: Deque[Request] = deque()
        self.chunked: Optional[Request] = None  # the one request between chunks
        self.next_rid = 0
        bs = config.block_size
        self.system_prompts = [
            rng.integers(0, config.vocab, size=int(rng.integers(2 * bs + 1, 3 * bs + 4)))
            .tolist() for _ in range(config.system_prompts)]

    def _count(self, name: str, value: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + value

    # ----------------------------------------------------------------- arrivals
    def arrive(self) -> None:
        """New requests join the waiting queue; about half share a system prompt."""
        cfg = self.config
        for _ in range(int(self.rng.poisson(cfg.arrival_rate))):
            if len(self.waiting) >= 4:
                break
            if self.system_prompts and self.rng.random() < 0.55:
                pick = int(self.rng.integers(len(self.system_prompts)))
                system = self.system_prompts[pick]
                extra = int(self.rng.integers(1, cfg.max_prompt - len(system) + 1))
                prompt = system + self.rng.integers(0, cfg.vocab, size=extra).tolist()
            else:
                length = int(self.rng.integers(2, cfg.max_prompt + 1))
                prompt = self.rng.integers(0, cfg.vocab, size=length).tolist()
            max_new = int(self.rng.integers(2, cfg.max_new_tokens + 1))
            self.waiting.append(Request(self.next_rid, prompt, max_new))
            self.next_rid += 1
            self._count("arrived")

    def plan_prefill(self) -> Dict[Request, int]:
        """Prompt tokens each active prefilling request processes this step.

        The chunked request (if active) goes first; then waiting requests are admitted
        in order while rows and the ``chunk_tokens`` budget last: whole when the rest
        of their prompt fits, else as the (single) chunked request.
        """
        cfg, rows = self.config, self.rows
        budget = cfg.chunk_tokens
        plan: Dict[Request, int] = {}
        chunked = self.chunked
        if chunked is not None and rows.row_of(chunked) >= rows.paused:
            plan[chunked] = min(len(chunked.prompt) - chunked.prefilled, budget)
            budget -= plan[chunked]
        while self.waiting and budget > 0 and rows.total < cfg.max_requests \
                and rows.active_count < cfg.max_requests - 1:
            request = self.waiting[0]
            inherited = self.prefix.match(request.prompt, cfg.block_columns - 1)
            rest = len(request.prompt) - len(inherited) * cfg.block_size
            if rest > budget and (self.chunked is not None or budget < 4):
                break
            self.waiting.popleft()
            self._admit(request, inherited)
            plan[request] = min(rest, budget)
            budget -= plan[request]
            if plan[request] < rest:
                self.chunked = request
                self._count("chunked prompts")
        return plan

    def _admit(self, request: Request, inherited: List[int]) -> None:
        for block in inherited:
            self.pool.share(block)
        request.blocks = list(inherited)
        request.matched = len(inherited)
        request.prefilled = request.mtp_committed = len(inherited) * self.config.block_size
        request.tokens = list(request.prompt)
        self.rows.place(request)
        self.rows.verify("placing a new request")
        self._count("admitted")
        if inherited:
            self._count("prefix hits")
            self._count("inherited blocks", len(inherited))

    # -------------------------------------------------------------- preemption
    def pause_resume(self) -> None:
        """Pause a few active requests (moved to the front with a swap), or resume a
        few paused ones (swapped back to the active side), at the seeded rates."""
        cfg, rows = self.config, self.rows
        if rows.active_count >= 2 and self.rng.random() < cfg.pause_rate:
            k = int(self.rng.integers(1, min(2, rows.active_count - 1) + 1))
            chosen = self.rng.choice(list(rows.active_rows), size=k, replace=False)
            if any(rows.requests[int(r)] is self.chunked for r in chosen):
                self._count("carry holders paused")  # its carry must survive the swap
            self._swap_into(sorted(int(r) for r in chosen),
                            range(rows.paused, rows.paused + k))
            rows.paused += k
            rows.verify("pausing")
            self._count("paused", k)
        elif rows.paused and self.rng.random() < 0.45:
            k = int(self.rng.integers(1, min(2, rows.paused) + 1))
            k = min(k, cfg.max_requests - 1 - rows.active_count)
            if k > 0:
                chosen = self.rng.choice(rows.paused, size=k, replace=False)
                self._swap_into(sorted(int(r) for r in chosen),
                                range(rows.paused - k, rows.paused))
                rows.paused -= k
                rows.verify("resuming")
                self._count("resumed", k)

    def _swap_into(self, chosen: Sequence[int], targets: range) -> None:
        """Swap the ``chosen`` rows into the ``targets`` range (pairs are disjoint)."""
        src = [r for r in chosen if r not in targets]
        dst = [t for t in targets if t not in chosen]
        self.rows.swap(src, dst)

    # ------------------------------------------------------------------ blocks
    def reserve(self, request: Request, last_position: int) -> None:
        """Give ``request`` blocks through the column of ``last_position``."""
        while len(request.blocks) <= last_position // self.config.block_size:
            self.rows.add_block(request, self.pool.allocate())
            self._count("blocks allocated")

    def register_prefixes(self) -> None:
        """Offer every full, committed block a request owns to the prefix cache."""
        bs = self.config.block_size
        for request in self.rows.live():
            for column in range(request.matched, request.mtp_committed // bs):
                self.prefix.register(request.tokens, column, request.blocks[column])

    # ------------------------------------------------------- finish and compact
    def finish(self, carry_owner_lost: Any) -> List[Request]:
        """Retire finished requests (and, rarely, cancel a paused one), free their
        blocks and compact the rows. ``carry_owner_lost()`` is called when the
        request that held the chunk carry is cancelled. Returns the retired requests."""
        rows = self.rows
        holes = [row for row in rows.active_rows
                 if rows.requests[row].decoding
                 and rows.requests[row].generated >= rows.requests[row].max_new]
        self._count("finished", len(holes))
        if rows.paused and self.rng.random() < 0.04:
            holes.insert(0, int(self.rng.integers(rows.paused)))
            self._count("cancelled")
        if not holes:
            return []
        retired = [rows.requests[row] for row in holes]
        for request in retired:
            if request is self.chunked:
                self.chunked = None
                carry_owner_lost()
            for block in request.blocks:
                if self.pool.release(block):
                    self.prefix.forget(block)
        if any(row < rows.paused for row in holes) or self.rng.random() < 0.5:
            self._compact_by_shift(set(holes))
        else:
            self._compact_from_tail(set(holes))
        rows.verify("compaction")
        return retired

    def _compact_by_shift(self, holes: set) -> None:
        """Survivors slide down in order: one overlapping ``move`` (``[3, 4, 5] ->
        [2, 3, 4]``), then the vacated tail is reset."""
        rows = self.rows
        survivors = [r for r in range(rows.total) if r not in holes]
        moves = [(s, d) for d, s in enumerate(survivors) if s != d]
        rows.move([s for s, _ in moves], [d for _, d in moves])
        rows.reset(range(len(survivors), rows.total))
        rows.paused -= sum(1 for r in holes if r < rows.paused)
        rows.total = len(survivors)
        self._count("compactions (shift)")

    def _compact_from_tail(self, holes: set) -> None:
        """The last rows fill the holes below them (order not kept), then reset."""
        rows = self.rows
        tail = range(rows.total - len(holes), rows.total)
        movers = [r for r in tail if r not in holes]
        targets = sorted(r for r in holes if r < tail.start)
        rows.move(movers, targets)
        rows.reset(tail)
        rows.total = tail.start
        self._count("compactions (tail)")
