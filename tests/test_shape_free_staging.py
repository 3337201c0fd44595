"""The mirror path's draft depths and commit passes build nothing per shape: over steps whose counts change every time, once every (tensor, length) of
the trace was seen, no layout, CopyPlan, cache entry or slice is built any more,
however many steps follow; a placement's prefixes are warm after one slot saw their
length (every slot lands in one device zone); and the views stay bit-exact with the
reference on the way (views that start from a sentinel, so a pad row that is written
shows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpmeta import MTPMetadata
from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.layout import PackedLayout
from mtpmeta.mirror.copy_plan import CopyPlan
from mtpmeta.mirror.prefixes import Prefixes
from mtpmeta.mirror.commit_stage import CommitStage
from mtpmeta.mirror.stages import FixedStage

from .helpers import (assert_buffers_equal, assert_views_equal, config, make_reference,
                      make_view)

R, W, BS, TOKENS = 8, 6, 4, 40


class Builds:
    """Counts layouts, CopyPlans, new keys of the mirror path's ``caches`` (the view's
    plans, the view caches of the backend and its parts) and fixed-stage builds."""

    def __init__(self, monkeypatch, caches) -> None:
        self.count = 0
        builds = self
        layout_build = PackedLayout.build.__func__
        plan_init = CopyPlan.__init__
        put = BoundedCache.put

        def counted_build(cls, *args, **kwargs):
            builds.count += 1
            return layout_build(cls, *args, **kwargs)

        def counted_init(self, *args, **kwargs):
            builds.count += 1
            plan_init(self, *args, **kwargs)

        def counted_put(self, key, value):
            if key not in self and any(self is cache for cache in caches):
                builds.count += 1
            put(self, key, value)

        monkeypatch.setattr(PackedLayout, "build", classmethod(counted_build))
        monkeypatch.setattr(CopyPlan, "__init__", counted_init)
        monkeypatch.setattr(BoundedCache, "put", counted_put)

    def stages(self, target) -> int:
        return sum(stage.built for stage in target.plans.values()
                   if isinstance(stage, FixedStage))


def _view_caches(backend) -> tuple:
    """The ``BoundedCache`` of views of the mirror backend and of each part it holds."""
    return (backend._slices, backend.begin.views, backend.counted._views,
            backend.prefill_lengths._views)


def _view_keys(backend) -> set:
    """Every ``(cache index, key)`` of ``_view_caches``."""
    return {(index, key) for index, cache in enumerate(_view_caches(backend))
            for key in cache}


def _mirror_and_reference(requests: int, width: int):
    """A CPU-forced mirror-path object and the reference at ``requests`` x ``width``
    (block size BS), with a sentinel-filled view each."""
    kwargs = dict(max_requests=requests, max_kv_block_count=width, block_size_tokens=BS)
    meta = MTPMetadata(**config(**kwargs))
    meta.allocate("cpu", mirror=True, max_tokens=TOKENS)
    ref = make_reference(**kwargs)
    return (meta, ref, make_view("context", requests, TOKENS, width),
            make_view("reference", requests, TOKENS, width))


def _step(pairs, rng, table):
    """A draft loop of 2 depths and a commit pass, all sizes drawn from small sets (so
    a warm-up sees every one in every slot): n in 3..5 padded by 0 or 1; commit counts
    1 but the prefill row's 1..3; tokens padded by 0 or 1, requests to P or P + 1;
    the commit first or last (so it takes 0 or n rows from the device table)."""
    n = int(rng.integers(3, 6))
    padded = n + int(rng.integers(0, 2))
    starts = rng.integers(0, W * BS - 4, size=n).astype(np.int32)
    counts = np.ones(n + 1, dtype=np.int32)
    counts[n] = rng.integers(1, 4)
    commit_starts = np.maximum(starts - counts[:n], 0).astype(np.int32)
    commit_starts = np.append(commit_starts, np.int32(2))
    total = int(counts.sum())
    padded_tokens = total + int(rng.integers(0, 2))
    padded_requests = n + 1 + int(rng.integers(0, 2))
    commit_first = bool(rng.integers(0, 2))
    for o, target in pairs:
        def commit():
            o.setup_commit_pass(target, counts, table, start_positions=commit_starts,
                                padded_token_count=padded_tokens,
                                padded_request_count=padded_requests)
            o.end_forward()

        if commit_first:
            commit()
        o.begin_decode(n, padded, starts, table, False)
        for _ in range(2):
            o.setup_decode_step(target)
            o.advance_decode_step()
        o.end_forward()
        if not commit_first:
            commit()


@pytest.mark.parametrize("kind, table_dtype", [("context", torch.int32),
                                               ("reference", torch.int64)])
def test_builds_stop_after_warm_up_and_views_match(monkeypatch, kind, table_dtype):
    """Warm-up of 500 random steps (every slot, every length), then 100 and 300 more:
    both add no build at all; the reference runs the same steps and its views and
    buffers equal ours at the end of each phase."""
    kwargs = dict(max_requests=R, max_kv_block_count=W, block_size_tokens=BS,
                  block_table_dtype=table_dtype)
    meta = MTPMetadata(**config(**kwargs))
    meta.allocate("cpu", mirror=True, max_tokens=TOKENS)
    ref = make_reference(**kwargs)
    view, ref_view = make_view(kind, R, TOKENS, W), make_view("reference", R, TOKENS, W)
    target = meta._memo.target(view)
    builds = Builds(monkeypatch, (target.plans,) + _view_caches(meta._backend))
    rng = np.random.default_rng(0)
    tables = [rng.permutation(R * W).reshape(R, W).astype(np.int32) for _ in range(3)]
    counts = []
    pairs = ((meta, view), (ref, ref_view))
    for steps in (500, 100, 300):
        before = builds.count + builds.stages(target)
        for i in range(steps):
            _step(pairs, rng, tables[i % 3])
        counts.append(builds.count + builds.stages(target) - before)
        assert_views_equal(view, ref_view)
        assert_buffers_equal(meta, ref)
    assert counts[0] > 0  # the warm-up did build (the counter sees builds)
    assert meta._backend.fence_stalls == 0
    assert counts[1] == counts[2] == 0, counts


@pytest.mark.parametrize("width", [40, 320])
def test_counted_calls_stop_building_after_warm_up(monkeypatch, width):
    """The opt-in block counts at W 320: begins and commit passes
    with per-row counts (every row 1..8 blocks, so the shipped width C is 8 or 16 of
    320) build nothing after a warm-up of 500 random steps, over 200 more; the views
    and buffers equal the reference's on the table with D past the counts. At W 40
    (under 256 columns) the rows ship whole: C is 40."""
    dummy = config()["dummy_block_idx"]
    meta, ref, view, ref_view = _mirror_and_reference(R, width)
    target = meta._memo.target(view)
    builds = Builds(monkeypatch, (target.plans,) + _view_caches(meta._backend))
    rng = np.random.default_rng(1)
    counts_seen = []
    begin_views = []  # the counted begin's (slot, C) views, after each phase
    for steps in (500, 200):
        before = builds.count + builds.stages(target)
        for _ in range(steps):
            n = int(rng.integers(3, 6))
            padded = n + int(rng.integers(0, 2))
            used = rng.integers(1, 9, size=R).astype(np.int32)
            used[:n] = np.maximum(used[:n], 3)  # depths write columns 0..2
            starts = rng.integers(0, 2 * BS, size=n).astype(np.int32)
            table = rng.permutation(R * width).reshape(R, width).astype(np.int32)
            oracle = table.copy()
            for i in range(R):
                table[i, used[i]:] = -1
                oracle[i, used[i]:] = dummy
            spans = np.ones(n, dtype=np.int32)  # as _step: one row's span 1..3
            spans[-1] = rng.integers(1, 4)
            commit_starts = rng.integers(0, 2 * BS, size=n).astype(np.int32)
            padded_tokens = int(spans.sum()) + int(rng.integers(0, 2))
            padded_requests = n + int(rng.integers(0, 2))
            for o, target_view, t, extra in ((meta, view, table, {"block_counts": used}),
                                             (ref, ref_view, oracle, {})):
                o.begin_decode(n, padded, starts, t, False, **extra)
                for _ in range(2):
                    o.setup_decode_step(target_view)
                    o.advance_decode_step()
                o.end_forward()
                o.setup_commit_pass(target_view, spans, t, start_positions=commit_starts,
                                    padded_token_count=padded_tokens,
                                    padded_request_count=padded_requests, **extra)
                o.end_forward()
        counts_seen.append(builds.count + builds.stages(target) - before)
        begin_views.append(set(meta._backend.counted._packed_view_cache))
        assert_views_equal(view, ref_view)
        assert_buffers_equal(meta, ref)
    assert counts_seen[0] > 0
    assert counts_seen[1] == 0, counts_seen
    # The begin's views are kept per (slot, C) only: none is added after the warm-up,
    # and no more than the slots times the C values (8 and 16, or W) exist.
    slots = meta._backend.begin.ring.num_slots
    assert begin_views[0] and begin_views[1] == begin_views[0], begin_views
    assert {c for _, c in begin_views[0]} <= ({8, 16} if width >= 256 else {width})
    assert len(begin_views[0]) <= 2 * slots


def test_a_length_seen_in_one_slot_is_warm_in_every_slot(monkeypatch):
    """Every slot's H2D copy lands in one device zone, so a placement's prefixes are
    cached by length alone: a depth shape and a commit shape staged once (one slot
    each) build no prefix when they come back in each of the other 7 slots (per-slot
    device sources rebuilt theirs in every slot)."""
    meta = MTPMetadata(**config(max_requests=R, max_kv_block_count=W, block_size_tokens=BS))
    meta.allocate("cpu", mirror=True, max_tokens=TOKENS, staging_slots=8)
    view = make_view("context", R, TOKENS, W)
    builds = [0]
    build, rows = Prefixes.build, Prefixes.rows

    def counted_build(self, count):
        builds[0] += 1
        return build(self, count)

    def counted_rows(self, start, stop):
        builds[0] += (start, stop) not in self.ranges
        return rows(self, start, stop)

    monkeypatch.setattr(Prefixes, "build", counted_build)
    monkeypatch.setattr(Prefixes, "rows", counted_rows)
    table = np.arange(R * W, dtype=np.int32).reshape(R, W)
    starts = np.arange(4, dtype=np.int32)
    counts = np.array([1, 2, 1, 3, 2], dtype=np.int32)

    def loop(depths):
        meta.begin_decode(4, 5, starts, table, False)
        for _ in range(depths):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
        meta.end_forward()
        meta.setup_commit_pass(view, counts, table, padded_token_count=10)
        meta.end_forward()

    loop(1)  # one depth, one commit pass: two slots
    assert builds[0] > 0
    builds[0] = 0
    for _ in range(8):  # 8 forward slots, each staging 2 depths and a pass
        loop(2)
    assert builds[0] == 0


def _count_prefix_builds(monkeypatch):
    """A one-element list that counts every ``Prefixes.build`` from now on."""
    builds = [0]
    build = Prefixes.build

    def counted_build(self, count):
        builds[0] += 1
        return build(self, count)

    monkeypatch.setattr(Prefixes, "build", counted_build)
    return builds


def _commit(o, target, total: int, requests: int, table, starts) -> None:
    counts = np.full(requests, total // requests, dtype=np.int32)
    counts[:total % requests] += 1
    o.setup_commit_pass(target, counts, table, start_positions=starts,
                        padded_token_count=TOKENS, padded_request_count=requests + 1)
    o.end_forward()


def _shared_sources(meta):
    """The forward ring's prefixes that every view's stages share, and their builds."""
    ring = meta._backend.forward.ring
    return ring.shared_prefixes, ring.shared_built


def test_real_token_counts_build_prefixes_once_and_views_share_their_sources(
        monkeypatch):
    """Commit passes of every real token count T below the padded one (each pass has
    pad tokens): a view's first pass builds only the prefixes of its own counts (a
    handful, not one per possible T), the first pass at a new T builds that T's,
    and the same Ts again build none. A second view builds only its own destination
    prefixes: the sources' (the ring's zone, the persistent buffers) are shared. Each
    view equals the reference's (pad tokens' request, position and pos id are never
    written, so a copy over more than T would show)."""
    meta, ref, view, ref_view = _mirror_and_reference(R, W)
    table = np.arange(R * W, dtype=np.int32).reshape(R, W)
    requests = 4
    builds = _count_prefix_builds(monkeypatch)
    rng = np.random.default_rng(3)
    totals = [int(t) for t in rng.permutation(np.arange(requests, TOKENS))]
    starts = rng.integers(0, BS, size=requests).astype(np.int32)
    second = make_view("context", R, TOKENS, W)
    second_ref = make_view("reference", R, TOKENS, W)
    for target, ref_target in ((view, ref_view), (second, second_ref)):
        shared, shared_built = _shared_sources(meta)
        sources_before = shared_built[0]
        for sweep in range(2):
            for index, total in enumerate(totals):
                builds[0] = 0
                for o, t in ((meta, target), (ref, ref_target)):
                    _commit(o, t, total, requests, table, starts)
                assert_views_equal(target, ref_target)
                if sweep:
                    assert builds[0] == 0, (total, builds)
                else:
                    # its own counts only: fewer than one per possible T
                    assert builds[0] < len(totals), (index, total, builds)
        if target is second:
            assert shared_built[0] == sources_before, "a second view rebuilt sources"


def test_row_counts_build_prefixes_once_and_views_share_their_sources(monkeypatch):
    """Draft loops of every row count n (padded count fixed): the first loop at a new n
    builds only that n's prefixes, the same n again builds none (nor an active view or
    a begin pair); a second view's loops build no source prefix (the ring's zone and
    the persistent buffers are shared). Views and buffers equal the reference's."""
    meta, ref, view, ref_view = _mirror_and_reference(R, W)
    table = np.arange(R * W, dtype=np.int32).reshape(R, W)
    builds = _count_prefix_builds(monkeypatch)
    rng = np.random.default_rng(4)
    backend = meta._backend
    rows = [1] + [int(n) for n in rng.permutation(np.arange(2, R + 1))]
    second = make_view("context", R, TOKENS, W)
    second_ref = make_view("reference", R, TOKENS, W)
    cached = None
    for target, ref_target in ((view, ref_view), (second, second_ref)):
        _, shared_built = _shared_sources(meta)
        sources_before = shared_built[0]
        for sweep in range(2):
            for n in rows:
                builds[0] = 0
                starts = rng.integers(0, (W - 1) * BS, size=n).astype(np.int32)
                for o, t in ((meta, target), (ref, ref_target)):
                    o.begin_decode(n, R, starts, table, False)
                    for _ in range(2):
                        o.setup_decode_step(t)
                        o.advance_decode_step()
                    o.end_forward()
                assert_views_equal(target, ref_target)
                assert_buffers_equal(meta, ref)
                if sweep:
                    assert builds[0] == 0, (n, builds)
            if cached is None:
                cached = (len(meta._memo.active), _view_keys(backend))
        if target is second:
            assert shared_built[0] == sources_before, "a second view rebuilt sources"
    assert len(meta._memo.active) == cached[0]
    new_keys = _view_keys(backend) - cached[1]
    # Only the begin's H2D views (per slot and bucket) may be new.
    assert {(index, key[0]) for index, key in new_keys} <= {(1, "begin_h2d")}, new_keys


def test_begin_views_are_per_slot_and_bucket_of_rows():
    """A host-route begin_decode's host-to-device views are built per (slot, n
    rounded up to BEGIN_ROWS), not per (slot, n): 300 begins of random n in 1..24 on
    every slot keep at most slots x 3 buckets of them (per (slot, n): up to 192); the
    buffers equal the reference's after every begin, and so does a commit pass that
    takes the rows from the device copy (the landed rows past n are never read)."""
    from mtpmeta.mirror.begin_staging import BEGIN_ROWS

    requests = 3 * BEGIN_ROWS
    meta, ref, view, ref_view = _mirror_and_reference(requests, W)
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, requests + 1))
        table = rng.permutation(requests * W).reshape(requests, W).astype(np.int32)
        starts = rng.integers(0, W * BS - 1, size=requests).astype(np.int32)
        for o in (meta, ref):
            o.begin_decode(n, n, starts, table, False)
            o.end_forward()
        assert_buffers_equal(meta, ref)
    counts = np.ones(n, dtype=np.int32)
    for o, target in ((meta, view), (ref, ref_view)):
        o.setup_commit_pass(target, counts, table, start_positions=starts[:n],
                            padded_token_count=n)
        o.end_forward()
    assert_views_equal(view, ref_view)
    assert meta._backend.reused_table_rows == n
    backend = meta._backend
    keys = [key for key in backend.begin.views if key[0] == "begin_h2d"]
    assert {key[2] for key in keys} <= {BEGIN_ROWS, 2 * BEGIN_ROWS, 3 * BEGIN_ROWS}
    assert 0 < len(keys) <= backend.begin.ring.num_slots * 3, len(keys)


def test_length_classes_issue_the_pair_by_pair_copies(monkeypatch):
    """With one copy group a fixed stage places its pairs by length class (a few
    cached lists joined: ``PrefixGroup``); the pair-by-pair ``_place`` is the fallback
    for several groups. Both must issue the same copies, each class a role's own
    length: 60 random steps (depths with and without pad rows, commit passes before and
    after the loop) run twice from the same state, once each way, issue the same
    ``_foreach_copy_`` pairs (the same cached views, by identity) in every call, and
    the views equal the reference's. A role put in the wrong class copies over the
    wrong length: a pair that differs here, a row the reference does not write."""
    meta, ref, view, ref_view = _mirror_and_reference(R, W)
    rng = np.random.default_rng(11)
    table = rng.permutation(R * W).reshape(R, W).astype(np.int32)
    calls = []
    foreach_copy = torch._foreach_copy_

    def recording(dsts, srcs, **kwargs):
        calls.append(sorted((id(dst), id(src)) for dst, src in zip(dsts, srcs)))
        return foreach_copy(dsts, srcs, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)

    def run(pairs):
        calls.clear()
        for o, _ in pairs:  # the same state before each run: every row shipped
            o.begin_decode(R, R, np.zeros(R, np.int32), table, False)
            o.end_forward()
        steps = np.random.default_rng(12)
        for _ in range(60):
            _step(pairs, steps, table)
        return list(calls)

    by_class = run(((meta, view),))
    run(((ref, ref_view),))
    assert_views_equal(view, ref_view)
    stages = [stage for stage in meta._memo.target(view).plans.values()
              if isinstance(stage, FixedStage)]
    assert len(stages) == 2 and all(stage._single_group for stage in stages)
    for stage in stages:
        stage._single_group = False  # the pair-by-pair fallback from now on
    assert run(((meta, view),)) == by_class
    assert_views_equal(view, ref_view)


def test_length_classes_must_hold_each_role_once():
    """A role in no class would never be copied, one in two classes twice: building
    the classes refuses both, so an edit of a stage's class table cannot drop a copy."""
    from mtpmeta.mirror.prefixes import PrefixGroup

    counter = [0]
    roles = [(Prefixes(torch.zeros(4), False, counter),
              Prefixes(torch.zeros(4), False, counter), 0) for _ in range(3)]
    got, groups = PrefixGroup.classes(roles, ((0, 2), (1,)), counter)
    assert got is roles and [len(group.pairs) for group in groups] == [2, 1]
    assert groups[0].build(2)[0][1] is roles[2][0].prefix(2)
    for members in (((0, 2),), ((0, 1), (1, 2))):
        with pytest.raises(ValueError, match="exactly one"):
            PrefixGroup.classes(roles, members, counter)


def test_packed_ends_cover_the_bytes_in_few_buckets():
    """A packed commit pass ships its table bytes to a bucketed end (the per-slot H2D
    copies it caches): never short of the bytes, at most 1/8 (or one alignment) over,
    within the layout, and about 8 distinct ends per doubling of the bytes."""
    meta, _, view, _ = _mirror_and_reference(R, 40)
    n, used = 4, np.full(R, 3, dtype=np.int32)
    table = np.full((R, 40), -1, dtype=np.int32)
    table[:, :3] = np.arange(3 * R, dtype=np.int32).reshape(R, 3)
    meta.setup_commit_pass(view, np.ones(n, dtype=np.int32), table,
                           start_positions=np.zeros(n, dtype=np.int32),
                           padded_token_count=n, padded_request_count=n,
                           block_counts=used)
    meta.end_forward()
    stage = next(s for s in meta._memo.target(view).plans.values()
                 if isinstance(s, CommitStage))
    base, total = stage._end_base, stage.layout.nbytes
    ends = [stage._packed_end(size) for size in range(1, total - base + 1)]
    for size, end in enumerate(ends, start=1):
        assert base + size <= end <= total
        assert end - base - size < max(size // 8, 8) or end == total, (size, end)
    assert len(set(ends)) <= 8 * (total - base).bit_length() + 2
