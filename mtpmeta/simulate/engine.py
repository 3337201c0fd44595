"""The engine: one speculative-decoding step over a dynamic batch, driving the public
API of ``MTPMetadata`` the way upstream's dynamic inference context does.

A step, in order (``Engine.step``):

1. **Rows**: preemption (``swap_request_rows``), admission with prefix matching
   (annotations written into ``request_matched_prefix_blocks``), see ``Scheduler``.
2. **Main model** (a closed-form stand-in): a prefilling request runs its chunk
   ``[off, off + c)``; a decoding request verifies last step's ``K`` drafts, keeping
   the ``a`` that the main model agrees with plus one bonus token.
3. **Commit pass** (varlen, one ``setup_commit_pass``): every active request writes
   the MTP KV of the positions that just became committed. MTP is roll-by-one: the
   position ``p`` needs the main hidden at ``p`` and the token at ``p + 1``, so a chunk
   ``[off, off + c)`` writes ``[off - 1, off + c - 1)``; its first position (the seam)
   uses the hidden the previous chunk carried (``take_chunk_boundary``), and its last
   hidden is carried on (``carry_chunk_boundary``). A decoding request writes its ``a``
   accepted positions. Tokens are padded to a multiple of ``tp``.
4. **Draft loop** (``begin_decode``, then per depth ``setup_decode_step`` and
   ``advance_decode_step``, then ``end_forward``) over the decoding requests: depth 0
   writes the last committed position (main hidden + bonus token) and drafts token 1;
   depth ``j`` feeds the MTP hidden and draft ``j`` of depth ``j - 1``. Request slots are
   padded to a bucket; every other step is ``graphed=True``, and every fourth step
   takes the captured draft loop instead (``capture_setup=True``, contract §12: the setup
   of each depth is device ops only, replayed from CUDA graphs on CUDA; see
   ``mtpmeta.simulate.captured``).
5. **Retire** finished requests and compact the rows (``move_request_rows``,
   ``reset_request_rows``).

Every forward writes the paged cache through the view's token maps and attends
through its MHA metadata (``PagedKVCache``); ``Checker`` then checks it densely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from mtpmeta.gpu_view import ContextGPUView
from mtpmeta.buffers.layout import round_up
from mtpmeta.metadata import MTPMetadata
from mtpmeta.simulate.captured import CapturedSetups
from mtpmeta.simulate.checks import Checker, Expectation
from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.mismatch import Mismatch
from mtpmeta.simulate.model import TinyModel
from mtpmeta.simulate.paged import PagedKVCache
from mtpmeta.simulate.rows import Request, RowTable
from mtpmeta.simulate.scheduler import Scheduler

__all__ = ["Engine"]

PAD_INPUT = 3.0  # x of pad token rows: outside tanh's range, so a stray pad write shows


@dataclass
class Work:
    """One active request's part of this step: the MTP inputs ``x [count, H]`` of the
    commit span starting at ``start``; for a request that drafts, the depth-0 hidden
    (main hidden at its last committed position); for a chunk, the hidden to carry."""

    request: Request
    start: int
    x: Tensor
    draft_hidden: Optional[Tensor] = None
    carry: Optional[Tuple[Tensor, int]] = None


class Engine:
    """A deterministic toy serving engine; ``run`` or ``step`` it (see module doc)."""

    def __init__(self, config: SimConfig = SimConfig(), *, seed: int = 0,
                 device: str | torch.device = "cpu", mirror: bool = False) -> None:
        self.config = config
        self.device = torch.device(device)
        self.mtp = MTPMetadata(**config.metadata_kwargs())
        self.mtp.allocate(self.device, mirror=mirror, max_tokens=config.max_tokens)
        self.view = ContextGPUView(config.max_requests, config.max_tokens,
                                   config.block_columns, self.device)
        self.model = TinyModel(config, seed, self.device)
        self.cache = PagedKVCache(config, self.device)
        self.rows = RowTable(config.max_requests, config.block_columns, self.mtp)
        self.stats: Dict[str, int] = {}
        self.scheduler = Scheduler(config, np.random.default_rng(seed), self.rows,
                                   self.stats)
        self.checker = Checker(config, self.model, self.cache, self.view)
        self.captured = CapturedSetups(self.mtp, self.view, self.device)
        self.step_index = 0
        self.forward_label: Optional[str] = None
        self.mtp.reset_request_rows()  # all rows free (the default slice(None))

    def _count(self, name: str, value: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + value

    # ------------------------------------------------------------------- driver
    def run(self, steps: int, progress: Optional[Callable[[int], None]] = None) -> None:
        """Warm up the graphed buckets, then ``steps`` steps; raises ``Mismatch``.

        Runs with one intra-op torch thread (restored after): every tensor here is
        tiny, and a thread pool contending for two busy cores was 7x slower (17 s
        against 2.3 s for 60 steps, measured on the CI machine).
        """
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if self.step_index == 0:
                self._guarded(self.capture_warmup)
            for _ in range(steps):
                self._guarded(self.step)
                if progress is not None:
                    progress(self.step_index)
        finally:
            torch.set_num_threads(threads)

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run ``work``; any failure leaves as a ``Mismatch`` located at this step."""
        try:
            work()
        except Mismatch as mismatch:
            raise mismatch.locate(self.step_index, self.forward_label) from None
        except Exception as error:  # a library error is a finding too
            raise Mismatch("exception", f"{type(error).__name__}: {error}").locate(
                self.step_index, self.forward_label) from error
        finally:
            self.forward_label = None

    def capture_warmup(self) -> None:
        """``begin_decode_for_capture`` for each padded bucket, as a CUDA-graph warmup
        does: every row points at the dummy block, so only ``D`` may change."""
        for bucket in self.buckets():
            self.mtp.begin_decode_for_capture(bucket)
            self.forward_label = f"#{self._forwards()} capture warmup ({bucket} rows)"
            shape = self.mtp.setup_decode_step(self.view)
            d = self.config.dummy_block
            expect = Expectation("capture warmup", [(None, 0, i, d) for i in range(bucket)],
                                 self._pad_rows(bucket), bucket,
                                 [(None, 1, 1)] * bucket, bucket)
            self._forward(expect.x, shape, expect)
            self.mtp.end_forward()
            self._count("capture warmups")
            self.forward_label = f"#{self._forwards()} captured warmup ({bucket} rows)"
            shape = self.captured.warm(bucket)
            self._forward(expect.x, shape, expect)
            self.mtp.end_forward()
            self._count("captured warmups")

    def buckets(self) -> List[int]:
        """Graphed draft sizes: powers of two below ``R``, and ``R``."""
        R = self.config.max_requests
        return sorted({min(1 << i, R) for i in range(R.bit_length() + 1)})

    def step(self) -> None:
        self.step_index += 1
        self.scheduler.arrive()
        self.scheduler.pause_resume()
        plan = self.scheduler.plan_prefill()
        works = [self._prefill_work(r, plan[r]) if not r.decoding else self._decode_work(r)
                 for r in (self.rows.requests[row] for row in self.rows.active_rows)]
        self.stats["max active requests"] = max(self.stats.get("max active requests", 0),
                                                len(works))
        self._commit_pass(works)
        self._draft_loop([w for w in works if w.draft_hidden is not None])
        for request in self.scheduler.finish(self._carry_owner_lost):
            self.checker.oracle.forget(request)
        self.scheduler.register_prefixes()
        self._count("steps")

    def _carry_owner_lost(self) -> None:
        self.mtp.invalidate_chunk_boundary()
        self._count("carries invalidated")

    # --------------------------------------------------------------- main model
    def _tokens(self, request: Request) -> Tensor:
        return torch.tensor(request.tokens, device=self.device)

    def _span_inputs(self, request: Request, hidden: Tensor, start: int) -> Tensor:
        """MTP inputs of positions ``start..start + len(hidden) - 1`` (roll-by-one)."""
        positions = torch.arange(start, start + hidden.shape[0], device=self.device)
        return self.model.mtp_input(hidden, self._tokens(request)[positions + 1], positions)

    def _prefill_work(self, request: Request, chunk: int) -> Work:
        """The main model runs prompt chunk ``[off, end)``; the commit span is
        ``[off - 1, end - 1)``."""
        cfg, off = self.config, request.prefilled
        end = off + chunk
        final = end == len(request.prompt)
        self.scheduler.reserve(request, end + cfg.depths - 2 if final else end - 2)
        hidden = self.model.main_hiddens(self._tokens(request), off, end)  # [c, H]
        if off == 0:
            span, start = hidden[:-1], 0
        else:
            if request.holds_carry:  # the seam: the previous chunk's last main hidden
                seam = self.mtp.take_chunk_boundary(request.rid, off - 1).reshape(1, -1)
                self._count("seams taken")
            elif off == request.matched * cfg.block_size:
                # The seam lies in an inherited block: the library redirects its write
                # to the dummy block, so any hidden will do (the producer's KV stays).
                seam = torch.zeros_like(hidden[:1])
            else:
                raise RuntimeError(f"engine bug: {request} continues at {off} "
                                   "without a carry")
            span, start = torch.cat([seam, hidden[:-1]]), off - 1
        x = self._span_inputs(request, span, start)
        request.prefilled = end
        work = Work(request, start, x)
        if final:
            first = self.model.main_next(request.tokens[end - 1], end - 1)
            request.tokens.append(first)
            request.holds_carry = False
            if self.scheduler.chunked is request:
                self.scheduler.chunked = None
            work.draft_hidden = hidden[-1]
        else:
            work.carry = (hidden[-1], end - 1)
        return work

    def _decode_work(self, request: Request) -> Work:
        """Verify the drafts: accept while the main model agrees, then a bonus token;
        the span is the ``a`` accepted positions ``[N-1, N-1+a)``."""
        n, cfg = len(request.tokens), self.config
        self.scheduler.reserve(request, n + 2 * cfg.depths - 2)
        previous, accepted = request.tokens[-1], 0
        for draft in request.drafts:
            if draft != self.model.main_next(previous, n - 1 + accepted):
                break
            previous, accepted = draft, accepted + 1
        bonus = self.model.main_next(previous, n - 1 + accepted)
        request.tokens.extend(request.drafts[:accepted] + [bonus])
        self._count("drafts verified", len(request.drafts))
        self._count("drafts accepted", accepted)
        hidden = self.model.main_hiddens(self._tokens(request), n - 1, n + accepted)
        return Work(request, n - 1, self._span_inputs(request, hidden[:accepted], n - 1),
                    draft_hidden=hidden[accepted])

    # --------------------------------------------------------------- commit pass
    def _commit_pass(self, works: List[Work]) -> None:
        cfg, rows, d = self.config, self.rows, self.config.dummy_block
        counts = [w.x.shape[0] for w in works]
        total = sum(counts)
        padded = round_up(total, cfg.tp)
        pad = padded - total
        if len(works) >= cfg.max_requests and pad:
            raise RuntimeError("engine bug: a padded commit pass with P == R")
        rng = self.scheduler.rng
        padded_requests = int(rng.integers(len(works), cfg.max_requests + 1)) \
            if rng.random() < 0.3 else None
        tokens, slots, groups = [], [], []
        for slot, work in enumerate(works):
            request = work.request
            first = len(tokens)
            for p in range(work.start, work.start + work.x.shape[0]):
                column = p // cfg.block_size
                block = d if column < request.matched else request.blocks[column]
                tokens.append((request, p, slot, block))
                self._count("inherited redirects", block == d)
            slots.append((request, counts[slot], counts[slot]))
            if work.start == 0 and counts[slot]:
                groups.append((request, first, len(tokens)))
            request.mtp_committed = max(request.mtp_committed, work.start + counts[slot])
        if pad:
            slots.append((None, pad, pad))  # the trailing pad request reads only D
        x = torch.cat([w.x for w in works] + [self._pad_rows(pad)])
        expect = Expectation("commit pass", tokens, x, padded, slots,
                             max(padded_requests or 0, len(slots)), groups)
        self.forward_label = f"#{self._forwards()} commit pass"
        shape = self.mtp.setup_commit_pass(
            self.view, torch.tensor(counts, dtype=torch.int32),
            rows.table[rows.paused:rows.total],
            start_positions=torch.tensor([w.start for w in works], dtype=torch.int32),
            # per commit-pass request: the ACTIVE slice, never the whole array
            inherited_blocks=self.mtp.request_matched_prefix_blocks[rows.paused:rows.total],
            padded_token_count=padded, padded_request_count=padded_requests)
        self._forward(x, shape, expect)
        self.mtp.end_forward()
        self.forward_label = None
        self._count("commit passes")
        self._count("commit passes with TP pad", pad > 0)
        self._count("commit tokens", total)
        self._count("pad tokens", pad)
        for work in works:
            if work.carry is not None:
                hidden, position = work.carry
                self.mtp.carry_chunk_boundary(hidden, work.request.rid, position)
                work.request.holds_carry = True
                self._count("carries")
                if (self.mtp.chunk_boundary_req_id, self.mtp.chunk_boundary_position) != \
                        (work.request.rid, position) or not self.mtp.chunk_boundary_valid:
                    raise Mismatch("carry", "carry_chunk_boundary did not record its keys",
                                   request=repr(work.request), position=position,
                                   expected=(True, work.request.rid, position),
                                   got=(self.mtp.chunk_boundary_valid,
                                        self.mtp.chunk_boundary_req_id,
                                        self.mtp.chunk_boundary_position))
        if self.scheduler.chunked is None and self.mtp.chunk_boundary_valid:
            self.mtp.invalidate_chunk_boundary()  # no chunked request in flight
            self._count("carries invalidated")

    # ---------------------------------------------------------------- draft loop
    def _draft_loop(self, works: List[Work]) -> None:
        if not works:
            return
        cfg, n = self.config, len(works)
        graphed = self.step_index % 2 == 0
        captured = self.step_index % 4 == 0  # a graphed step's padding, setup captured
        padded = next(b for b in self.buckets() if b >= n) if graphed else \
            min(cfg.max_requests, round_up(n, cfg.tp))
        requests = [w.request for w in works]
        positions = torch.tensor([len(r.tokens) - 2 for r in requests], device=self.device)
        table = self.rows.table[[self.rows.row_of(r) for r in requests]]
        self.mtp.begin_decode(n, padded, positions.to(device="cpu", dtype=torch.int32),
                              table, graphed, capture_setup=captured)
        hidden = torch.stack([w.draft_hidden for w in works])
        in_tokens = torch.tensor([r.tokens[-1] for r in requests], device=self.device)
        drafts = []
        for depth in range(cfg.depths):
            x = self.model.mtp_input(hidden, in_tokens, positions)
            plist = positions.tolist()
            if depth == 0:  # the last committed position: committed KV from now on
                for request, p in zip(requests, plist):
                    request.mtp_committed = p + 1
            tokens = [(r, p, i, r.blocks[p // cfg.block_size])
                      for i, (r, p) in enumerate(zip(requests, plist))]
            slots = [(r, 1, p + 1) for r, p in zip(requests, plist)]
            every_output = [(r, i, i + 1) for i, r in enumerate(requests)]
            expect = Expectation(f"draft depth {depth}", tokens,
                                 torch.cat([x, self._pad_rows(padded - n)]), padded,
                                 slots, padded, every_output, speculative=depth > 0)
            self.forward_label = f"#{self._forwards()} draft depth {depth}"
            shape = self.captured.setup(padded) if captured else \
                self.mtp.setup_decode_step(self.view)
            out = self._forward(expect.x, shape, expect)
            hidden, in_tokens = self.model.draft(out[:n], x, in_tokens)
            drafts.append(in_tokens.tolist())
            positions = positions + 1
            if captured:
                self.captured.advance(padded)
            else:
                self.mtp.advance_decode_step()
        self.mtp.end_forward()
        self.forward_label = None
        self.checker.end_draft_loop()
        for i, request in enumerate(requests):
            request.drafts = [depth[i] for depth in drafts]
        self._count("draft loops (captured)" if captured else
                    "draft loops (graphed)" if graphed else "draft loops (eager)")
        self._count("draft loops with padded rows", padded > n)
        self._count("draft tokens", n * cfg.depths)

    # ------------------------------------------------------------------ forward
    def _pad_rows(self, rows: int) -> Tensor:
        return torch.full((rows, self.config.hidden_size), PAD_INPUT,
                          dtype=self.config.dtype, device=self.device)

    def _forwards(self) -> int:
        return self.stats.get("forwards", 0) + 1

    def _forward(self, x: Tensor, shape, expect: Expectation) -> Tensor:
        """The MTP layer's forward over the view, then every check."""
        rows = expect.padded_tokens
        before = self.cache.snapshot()
        pos_ids = self.view.token_to_pos_ids[:rows].clamp(0, self.config.max_positions - 1)
        q, k, v = self.model.qkv(x[:rows], pos_ids)
        self.cache.write(self.view, k, v, rows)
        out, reads = self.cache.attend(q, self.view, shape.padded_request_count)
        self.checker.after_forward(expect, shape, out, reads, before, self.rows.live())
        self._count("forwards")
        return out
