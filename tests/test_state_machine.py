"""A scheduler as a hypothesis state machine, driving the library and the reference.

The machine keeps a model of a small scheduler (requests in rows, a host block table,
one chunked prefill at a time) and issues only what such a scheduler may issue: admit
requests with prefix-cache hits, chunked prefill across commit passes with the carry
taken at the exact seam, draft loops whose random accept counts feed the next start
positions and commit pass, pause/resume swaps, compaction moves, finishes, and
suspend/resume through deallocate/allocate. The path (direct or CPU-forced mirror) and
the geometry are drawn at init. After every library call the ten view fields, the
persistent buffers and the scalar state equal the reference's, and ``check_invariants``
passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mtpmeta import ContextGPUView, MTPForwardMode, MTPMetadata
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from tests.helpers import PATHS, assert_buffers_equal, assert_views_equal, config

D = 997  # dummy block: outside the drawn block ids (0..63), so a redirect shows
SCALARS = ("forward_mode", "active_request_count", "padded_count", "graphed",
           "chunk_boundary_valid", "chunk_boundary_req_id", "chunk_boundary_position",
           "forward_active", "is_varlen_forward")
FORMS = ("list", "numpy32", "numpy64", "torch32", "torch64")


def build(values: Any, form: str) -> Any:
    """``values`` (ints, any shape) as a fresh list, numpy array or CPU tensor."""
    array = np.asarray(values, dtype=np.int64)
    if form == "list":
        return array.tolist()
    array = array.astype(np.int32 if form.endswith("32") else np.int64)
    return torch.from_numpy(array) if form.startswith("torch") else array


@dataclass
class Request:
    rid: int
    prompt: int  # prompt tokens: positions [0, prompt) are prefill
    prefix: int  # prefix-cache blocks it inherited (its annotation)
    pos: int  # next MTP write position; everything before it is committed
    pending: int = 0  # accepted draft tokens (+ bonus) awaiting the next commit pass
    chunked: bool = False  # mid chunked prefill: the next chunk starts at the seam
    carry_lost: bool = False  # the carry died with a suspend/resume

    @property
    def prefilling(self) -> bool:
        return self.pos < self.prompt


class SchedulerMachine(RuleBasedStateMachine):
    """The scheduler model and the two objects it drives (``lib``: MTPMetadata on the
    drawn path; ``ref``: the pure-torch reference), each with its own view.

    The failure story: state carried from one step into the next (annotations moved
    with their requests, a carry surviving row moves but not a suspend, offsets
    advanced to the end of a table, a stale view row from an earlier, wider forward)
    must evolve identically on both sides; ``both`` reports the first call whose
    results, view, buffers or scalars differ, or whose state breaks an invariant.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lib: Optional[MTPMetadata] = None

    # ------------------------------------------------------------------ plumbing
    @initialize(path=st.sampled_from(PATHS), R=st.integers(2, 6), W=st.integers(2, 5),
                BS=st.integers(1, 4), dtype=st.sampled_from([torch.int32, torch.int64]),
                junk=st.integers(0, 2**16), data=st.data())
    def start(self, path, R, W, BS, dtype, junk, data) -> None:
        event(f"path: {path}")
        self.path, self.R, self.W, self.BS = path, R, W, BS
        self.span = W * BS
        self.max_tokens = R * self.span + 2 * BS + 4
        self.kwargs = config(max_requests=R, max_kv_block_count=W, block_size_tokens=BS,
                             dummy_block_idx=D, block_table_dtype=dtype)
        self.lib = MTPMetadata(**self.kwargs)
        self.ref = ReferenceMTPMetadata(**self.kwargs)
        self.lib.allocate("cpu", mirror=(path == "mirror"), max_tokens=self.max_tokens)
        self.ref.allocate("cpu")
        self.lib_view = ContextGPUView(R, self.max_tokens, W, "cpu")
        self.ref_view = ReferenceGPUView(R, self.max_tokens, W, "cpu")
        gen = torch.Generator().manual_seed(junk)  # identical junk: stray writes show
        for name, field in self.lib_view.fields().items():
            values = torch.randint(-9, 1000, field.shape, generator=gen)
            field.copy_(values)
            getattr(self.ref_view, name).copy_(values)
        self.requests: List[Optional[Request]] = [None] * R
        self.table = np.full((R, W), D, dtype=np.int64)  # the scheduler's block table
        self.next_rid = 0
        for _ in range(data.draw(st.integers(0, R), label="requests at start")):
            self.admit(data)

    def both(self, method: str, make: Callable[[Any, Any], tuple] = lambda m, v: ((), {}),
             raises: Any = None) -> Any:
        """Call ``method`` on both sides with inputs built afresh for each, compare."""
        results = []
        for meta, view in ((self.lib, self.lib_view), (self.ref, self.ref_view)):
            args, kwargs = make(meta, view)
            if raises is not None:
                with pytest.raises(raises):
                    getattr(meta, method)(*args, **kwargs)
            else:
                results.append(getattr(meta, method)(*args, **kwargs))
        if results:
            ours, theirs = results
            if isinstance(ours, tuple):  # stage_decode_lengths: (query, kv) views
                assert len(ours) == len(theirs), method
                for a, b in zip(ours, theirs):
                    assert torch.equal(a, b), f"{method}: {a} vs {b}"
            elif isinstance(ours, torch.Tensor):
                assert torch.equal(ours, theirs), f"{method}: {ours} vs {theirs}"
            else:
                assert ours == theirs, f"{method}: {ours!r} vs {theirs!r}"
        self.compare(method)
        return results[0] if results else None

    def compare(self, where: str) -> None:
        try:
            assert_views_equal(self.lib_view, self.ref_view)
            assert_buffers_equal(self.lib, self.ref)
            for name in SCALARS:
                ours, theirs = getattr(self.lib, name), getattr(self.ref, name)
                assert ours == theirs, f"{name}: {ours!r} vs {theirs!r}"
        except AssertionError as exc:
            raise AssertionError(f"after {where}: {exc}") from None
        self.lib.check_invariants()

    def annotate(self, row: int, value: int) -> None:
        """The scheduler writes a prefix-match count straight into the host buffer."""
        self.lib.request_matched_prefix_blocks[row] = value
        self.ref.request_matched_prefix_blocks[row] = value

    def occupied(self) -> List[int]:
        return [r for r, req in enumerate(self.requests) if req is not None]

    def active_rows(self) -> int:
        """Rows a forward covers: up to the last occupied row."""
        rows = self.occupied()
        return rows[-1] + 1 if rows else 0

    @invariant()
    def libraries_agree(self) -> None:
        if self.lib is not None:
            self.compare("rule")
            assert self.lib.forward_mode is MTPForwardMode.NONE

    # --------------------------------------------------------------------- rules
    @precondition(lambda self: None in self.requests)
    @rule(data=st.data())
    def admit(self, data) -> None:
        """A new request in a free row, often with a prefix-cache hit."""
        free = [r for r, q in enumerate(self.requests) if q is None]
        row = data.draw(st.sampled_from(free), label="row")
        prompt = data.draw(st.one_of(st.just(self.span - 1), st.integers(1, self.span - 1)),
                           label="prompt")
        most = (prompt - 1) // self.BS  # at least one prompt token is computed
        prefix = data.draw(st.one_of(st.just(most), st.integers(0, most)),
                           label="prefix blocks")
        start = data.draw(st.sampled_from([0, prefix * self.BS]), label="first position")
        self.requests[row] = Request(self.next_rid, prompt, prefix, start)
        self.next_rid += 1
        self.table[row] = data.draw(st.lists(st.integers(0, 63), min_size=self.W,
                                             max_size=self.W), label="blocks")
        self.annotate(row, prefix)
        self.compare("admit")

    def _chunk(self, data, req: Request, chunk_free: bool) -> int:
        remaining = req.prompt - req.pos
        if req.chunked:  # a continuation chunk must run now
            return data.draw(st.integers(1, remaining), label="continuation chunk")
        if chunk_free:  # may start the (one) chunked prefill, or wait, or finish
            return data.draw(st.integers(0, remaining), label="chunk")
        return data.draw(st.sampled_from([0, remaining]), label="wait or whole prompt")

    @rule(data=st.data())
    def commit_pass(self, data) -> None:
        """One varlen commit pass: prefill chunks and accepted draft tokens of every
        row up to the last occupied one, starts at each request's position, inherited
        blocks = the annotations, token and request padding."""
        P = self.active_rows()
        P = data.draw(st.integers(P, self.R), label="P") if data.draw(st.booleans()) else P
        counts, starts = [0] * P, [0] * P
        chunk_free = not any(q is not None and q.chunked for q in self.requests)
        for row in range(P):
            req = self.requests[row]
            if req is None:
                continue
            starts[row] = req.pos
            if req.prefilling:
                counts[row] = self._chunk(data, req, chunk_free)
                partial = 0 < counts[row] < req.prompt - req.pos
                chunk_free = chunk_free and not partial
            else:
                counts[row], req.pending = req.pending, 0
        for row in range(P):  # continuation chunks take the carry at their seam
            req = self.requests[row]
            if req is not None and req.chunked:
                seam = (lambda m, v, r=req: ((r.rid, r.pos - 1), {}))
                event("commit: continuation chunk, carry "
                      + ("lost" if req.carry_lost else "taken"))
                if req.carry_lost:
                    self.both("take_chunk_boundary", seam, raises=AssertionError)
                else:
                    self.both("take_chunk_boundary", seam)
        T = sum(counts)
        pad = data.draw(st.sampled_from([0, 0, 1, data.draw(st.integers(1, 2 * self.BS))]))
        kwargs: dict = {}
        if data.draw(st.booleans()):
            kwargs["padded_token_count"] = T + pad
        if data.draw(st.booleans()):
            kwargs["padded_request_count"] = data.draw(st.integers(P, self.R))
        inherited = data.draw(st.sampled_from(["own", "own", "copy", None]))
        if inherited and any(q is not None and counts[r] and starts[r] // self.BS < q.prefix
                             for r, q in enumerate(self.requests[:P])):
            event("commit: tokens in inherited blocks")
        padding = kwargs.get("padded_token_count", T) - T
        event("commit: " + ("no token pad" if not padding else "spare-slot pad"
                            if P < self.R else "full-batch pad"))
        form = data.draw(st.sampled_from(FORMS), label="form")

        def make(meta, view):
            own = meta.request_matched_prefix_blocks
            k = dict(kwargs, start_positions=build(starts, form),
                     inherited_blocks=own if inherited == "own" else
                     None if inherited is None else build(own.numpy(), form))
            return (view, build(counts, form), build(self.table, form)), k

        self.both("setup_commit_pass", make)
        self.both("end_forward")
        hidden = data.draw(st.lists(st.integers(-8, 8), min_size=8, max_size=8))
        for row in range(P):
            req = self.requests[row]
            if req is None:
                continue
            was_prefilling = req.prefilling
            req.pos += counts[row]
            if was_prefilling and counts[row]:
                req.chunked = req.prefilling  # a partial chunk: carry its last hidden
                req.carry_lost = False
                if req.chunked:
                    carried = (lambda m, v, r=req: (
                        (torch.tensor(hidden, dtype=torch.float32) / 4, r.rid, r.pos - 1),
                        {}))
                    self.both("carry_chunk_boundary", carried)

    @rule(data=st.data())
    def draft_loop(self, data) -> None:
        """begin_decode -> depths x (setup_decode_step, advance_decode_step) ->
        end_forward; accepted counts then feed the next commit pass and draft starts."""
        n = self.active_rows()
        starts = [0] * n
        for row in range(n):
            req = self.requests[row]
            if req is not None:  # never inside its inherited (shared) prefix blocks
                starts[row] = max(req.pos + req.pending, req.prefix * self.BS)
        room = min((self.span - s for s in starts), default=self.span)
        if room < 1:  # a request filled its table: the scheduler finishes it first
            return
        depths = data.draw(st.one_of(st.just(min(3, room)), st.integers(1, min(3, room))),
                           label="depths")
        padded = data.draw(st.integers(n, self.R), label="padded")
        extra = data.draw(st.lists(st.integers(0, self.span - 1), max_size=2))
        graphed = data.draw(st.booleans())
        form = data.draw(st.sampled_from(FORMS), label="form")
        self.both("begin_decode", lambda m, v: (
            (n, padded, build(starts + extra, form), build(self.table, form), graphed), {}))
        for _ in range(depths):
            self.both("setup_decode_step", lambda m, v: ((v,), {}))
            if data.draw(st.booleans(), label="stage lengths"):
                self.both("stage_decode_lengths")
            self.both("advance_decode_step")
        self.both("end_forward")
        event(f"draft: request padding={padded > n}, last slot reached="
              f"{any(s + depths == self.span for s in starts)}")
        for row in range(n):
            req = self.requests[row]
            if req is not None and not req.prefilling:
                accepted = data.draw(st.integers(0, depths), label="accepted")
                req.pending = min(req.pending + accepted + 1, self.span - req.pos)

    @rule(padded=st.integers(0, 6), depths=st.integers(1, 2))
    def capture_warmup(self, padded, depths) -> None:
        """begin_decode_for_capture: scratch-only draft state, as at graph capture."""
        padded = min(padded, self.R)
        self.both("begin_decode_for_capture", lambda m, v: ((padded,), {}))
        for _ in range(depths):
            self.both("setup_decode_step", lambda m, v: ((v,), {}))
            self.both("advance_decode_step")
        self.both("end_forward")

    @rule(data=st.data())
    def pause_resume_swap(self, data) -> None:
        """Swap k disjoint pairs of rows (paused requests trade places with active ones)."""
        perm = data.draw(st.permutations(range(self.R)))
        k = data.draw(st.integers(1, self.R // 2))
        src, dst = perm[:k], perm[k:2 * k]
        form = data.draw(st.sampled_from(FORMS))
        self.both("swap_request_rows",
                  lambda m, v: ((build(src, form), build(dst, form)), {}))
        for s, d in zip(src, dst):
            self.requests[s], self.requests[d] = self.requests[d], self.requests[s]
            self.table[[s, d]] = self.table[[d, s]]

    @rule(data=st.data())
    def compact(self, data) -> None:
        """Close the holes: move every request down to rows 0..m-1 in one call (ranges
        overlap), then reset the freed tail rows. (No holes: nothing to do.)"""
        if None not in self.requests[:self.active_rows()]:
            return
        rows = self.occupied()
        old_end, m = rows[-1] + 1, len(rows)
        pairs = data.draw(st.permutations([(r, i) for i, r in enumerate(rows) if r != i]),
                          label="move order")  # any order: sources are read first
        src, dst = [s_ for s_, _ in pairs], [d_ for _, d_ in pairs]
        form = data.draw(st.sampled_from(FORMS))
        event(f"compact: src and dst overlap={bool(set(src) & set(dst))}")
        self.both("move_request_rows",
                  lambda m_, v: ((build(src, form), build(dst, form)), {}))
        moved = [self.requests[r] for r in rows]
        self.table[dst] = self.table[src]
        self.requests = moved + [None] * (self.R - m)
        freed = (slice(m, old_end) if data.draw(st.booleans())
                 else list(range(m, old_end)))
        self.both("reset_request_rows", lambda m_, v: (
            (freed if isinstance(freed, slice) else build(freed, form),), {}))

    @rule(data=st.data())
    def make_room(self, data) -> None:
        """Open a free row at ``a`` by shifting rows ``[a, end)`` up by one in one call
        (overlapping, destinations above sources), then reset row ``a``."""
        end = self.active_rows()
        if end == self.R:
            return
        a = data.draw(st.integers(0, end), label="opened row")
        src, dst = list(range(a, end)), list(range(a + 1, end + 1))
        form = data.draw(st.sampled_from(FORMS))
        as_slice = data.draw(st.booleans())
        self.both("move_request_rows", lambda m, v: (
            (slice(a, end), slice(a + 1, end + 1)) if as_slice else
            (build(src, form), build(dst, form)), {}))
        self.requests[a + 1:end + 1] = self.requests[a:end]
        self.requests[a] = None
        self.table[dst] = self.table[src]
        self.both("reset_request_rows", lambda m, v: ((a,), {}))

    @precondition(lambda self: any(q is not None for q in self.requests))
    @rule(data=st.data())
    def finish(self, data) -> None:
        """A request finishes: its row's annotation is reset; a dropped chunked prefill
        may invalidate the carry."""
        full = [r for r in self.occupied()
                if self.requests[r].pos + self.requests[r].pending >= self.span]
        row = data.draw(st.sampled_from(full or self.occupied()), label="finished row")
        index = data.draw(st.sampled_from(["int", "list", "mask"]))
        value = row if index == "int" else [row] if index == "list" else \
            [r == row for r in range(self.R)]
        self.both("reset_request_rows", lambda m, v: (
            (value if index != "mask" else torch.tensor(value),), {}))
        if self.requests[row].chunked and data.draw(st.booleans()):
            self.both("invalidate_chunk_boundary")
        self.requests[row] = None

    @rule(data=st.data())
    def wrong_seam_take_raises(self, data) -> None:
        """A take for another request, or off the seam, raises on both sides."""
        chunked = [q for q in self.requests if q is not None and q.chunked]
        rid, seam = (chunked[0].rid, chunked[0].pos - 1) if chunked else (self.next_rid, 0)
        rid, seam = data.draw(st.sampled_from([(rid + 1, seam), (rid, seam + 1),
                                               (rid, seam - 1)]))
        self.both("take_chunk_boundary", lambda m, v: ((rid, seam), {}),
                  raises=AssertionError)

    @rule()
    def suspend_resume(self) -> None:
        """deallocate (the suspend path: no buffers, methods that need them raise),
        then allocate: a fresh object; the scheduler re-annotates its rows, and a
        chunked prefill finds its carry gone."""
        self.both("deallocate")
        self.both("reset_request_rows", raises=RuntimeError)
        self.both("end_forward")
        self.lib.allocate("cpu", mirror=(self.path == "mirror"), max_tokens=self.max_tokens)
        self.ref.allocate("cpu")
        self.compare("allocate")
        for row, req in enumerate(self.requests):
            if req is not None:
                self.annotate(row, req.prefix)
                req.carry_lost = req.carry_lost or req.chunked
        self.compare("re-annotate")

    @rule()
    def suspend_mid_chunked_prefill(self) -> None:
        """Suspend/resume between two chunks: the continuation's take must raise. (A
        rule of its own so that this order is drawn often; no chunk in flight: no-op.)"""
        if any(q is not None and q.chunked for q in self.requests):
            self.suspend_resume()


SchedulerMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=30, deadline=None, derandomize=True,
    database=None, suppress_health_check=[HealthCheck.too_slow,
                                          HealthCheck.data_too_large])
test_scheduler_sequences_match_reference_and_keep_invariants = SchedulerMachine.TestCase
