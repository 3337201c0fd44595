"""The opt-in per-row block counts (contract §5 and §10, "Block
counts"): ``begin_decode(..., block_counts=)`` and ``setup_commit_pass(...,
block_counts=)``.

The oracle is the reference (upstream's op sequence) run on a copy of the table whose
columns at or past each row's count hold the dummy block ``D``: with counts, the view
and every buffer must equal it bit for bit, on both paths, while the caller's table
holds ``-1`` (an unallocated block, which a read would copy or refuse) past the counts.
A call without counts on the same object stays bit-exact with upstream on the raw
table, whatever the calls before it did (the mirror path's commit reuses device rows
only when they are what it would ship). A token or depth past its count, and bad
counts, are refused with nothing changed; with counts the mirror path ships only
``C = column_bucket(max count, W)`` columns, at one more device data op per call.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.bench.counters import H2DCounter, StagingRecorder
from mtpmeta.bench.counters import OpCounter
from mtpmeta.kernels.counted import column_bucket
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from mtpmeta.buffers.device_runtime import use_runtime
from tests.helpers import (assert_buffers_equal, assert_same_state, assert_views_equal,
                           buffer_state, config, view_state)

no_debug = pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                              reason="MTPMETA_DEBUG=1: the checks issue ops of their own")
R, W, BS, D = 8, 6, 4, 999
KWARGS = config(max_requests=R, max_kv_block_count=W, block_size_tokens=BS,
                dummy_block_idx=D)
TOKENS = 64
PATHS = ("direct", "mirror")


def build(path: str, **overrides):
    kwargs = dict(KWARGS, **overrides)
    recorder = StagingRecorder()
    with use_runtime(recorder):
        meta = MTPMetadata(**kwargs)
        meta.allocate("cpu", mirror=path == "mirror", max_tokens=TOKENS)
    view = ContextGPUView(kwargs["max_requests"], TOKENS, kwargs["max_kv_block_count"],
                          "cpu")
    return meta, view, recorder


def masked(table: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The oracle's table: columns at or past ``counts[i]`` of row ``i`` hold ``D``."""
    out = table.copy()
    for i in range(min(len(counts), out.shape[0])):
        out[i, int(counts[i]):] = D
    return out


def raw_table(rng: np.random.Generator, counts: np.ndarray, width: int = W) -> np.ndarray:
    """Distinct real blocks below the counts, ``-1`` (unallocated) past them."""
    table = rng.permutation(R * width).reshape(R, width).astype(np.int32)
    for i in range(R):
        table[i, int(counts[i]):] = -1
    return table


class Pair:
    """A library object on ``path`` and the reference, driven step by step."""

    def __init__(self, path: str, width: int = W) -> None:
        self.meta, self.view, self.recorder = build(path, max_kv_block_count=width)
        self.ref = ReferenceMTPMetadata(**dict(KWARGS, max_kv_block_count=width))
        self.ref.allocate("cpu")
        self.ref_view = ReferenceGPUView(R, TOKENS, width, "cpu")

    def draft(self, n, padded, starts, table, counts, depths, use_counts):
        t = torch.from_numpy
        if use_counts:
            self.meta.begin_decode(n, padded, t(starts), t(table), False,
                                   block_counts=t(counts))
            self.ref.begin_decode(n, padded, t(starts), t(masked(table, counts)), False)
        else:
            self.meta.begin_decode(n, padded, t(starts), t(table), False)
            self.ref.begin_decode(n, padded, t(starts), t(table), False)
        for _ in range(depths):
            ours = self.meta.setup_decode_step(self.view)
            theirs = self.ref.setup_decode_step(self.ref_view)
            assert (ours.max_seqlen_q, ours.max_seqlen_k) == \
                (theirs.max_seqlen_q, theirs.max_seqlen_k)
            assert_views_equal(self.view, self.ref_view)
            self.meta.advance_decode_step()
            self.ref.advance_decode_step()
        self.meta.end_forward()
        self.ref.end_forward()
        assert_buffers_equal(self.meta, self.ref)

    def commit(self, counts, starts, table, block_counts, inherited, padded_tokens,
               padded_requests, use_counts):
        t = torch.from_numpy
        kwargs = dict(start_positions=t(starts), inherited_blocks=t(inherited),
                      padded_token_count=padded_tokens,
                      padded_request_count=padded_requests)
        if use_counts:
            ours = self.meta.setup_commit_pass(self.view, t(counts), t(table),
                                               block_counts=t(block_counts), **kwargs)
            theirs = self.ref.setup_commit_pass(self.ref_view, t(counts),
                                                t(masked(table, block_counts)), **kwargs)
        else:
            ours = self.meta.setup_commit_pass(self.view, t(counts), t(table), **kwargs)
            theirs = self.ref.setup_commit_pass(self.ref_view, t(counts), t(table),
                                                **kwargs)
        assert ours.max_seqlen_q == max(theirs.max_seqlen_q, 1)
        assert_views_equal(self.view, self.ref_view)
        self.meta.end_forward()
        self.ref.end_forward()
        assert_buffers_equal(self.meta, self.ref)


def step_inputs(rng: np.random.Generator, depths: int, width: int = W, low: int = 0,
                long: bool = True):
    """One step's inputs: draft rows whose depths stay below their counts, and a commit
    pass whose spans stay below theirs (a row's count covers what it writes); ``n`` and
    ``P`` at least ``low``; without ``long``, positions stay in the first ``W``
    columns."""
    n = int(rng.integers(low, R + 1))
    padded = int(rng.integers(n, R + 1))
    reach = int(rng.choice([2 * BS, W * BS] + [width * BS] * long))  # short, long rows
    starts = rng.integers(0, reach - depths, size=R).astype(np.int32)
    need = (starts + depths - 1) // BS + 1
    counts = np.minimum(width, need + rng.integers(0, 3, size=R)).astype(np.int32)
    table = raw_table(rng, counts, width)
    num_prefill = int(rng.integers(low, R + 1))
    spans = rng.integers(0, 5, size=num_prefill).astype(np.int32)
    commit_starts = np.array([rng.integers(0, reach - int(c)) if c else 0
                              for c in spans], dtype=np.int32)
    last = (commit_starts + np.maximum(spans, 1) - 1) // BS + 1
    commit_counts = counts.copy()
    commit_counts[:num_prefill] = np.minimum(
        width, np.where(spans > 0, last, 0) + rng.integers(0, 3, size=num_prefill))
    commit_table = raw_table(rng, commit_counts, width)
    inherited = np.minimum(commit_counts[:num_prefill],
                           rng.integers(0, 3, size=num_prefill)).astype(np.int32)
    total = int(spans.sum())
    padded_tokens = int(min(TOKENS, total + rng.integers(0, 4)))
    padded_requests = int(rng.integers(num_prefill, R + 1))
    return (n, padded, starts, table, counts), (spans, commit_starts, commit_table,
                                                commit_counts, inherited, padded_tokens,
                                                padded_requests)


@pytest.mark.parametrize("width", [W, 40], ids=["W6", "W40"])  # C == W, and C < W
@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), modes=st.lists(
    st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=5))
def test_views_and_buffers_equal_the_oracle_with_or_without_counts(path, width, seed,
                                                                  modes):
    """Steps mixing begins and commits with and without counts: after every depth
    and every pass, the view, the ForwardShape and every buffer equal the reference's
    (on the masked table with counts, the raw one without), so no column past a count
    is read, the device rows hold D there, and a commit after a counted begin (or the
    other way round) reuses no row it would not ship."""
    rng = np.random.default_rng(seed)
    pair = Pair(path, width)
    depths = 3
    for begin_counts, commit_counts in modes:
        draft, commit = step_inputs(rng, depths, width)
        pair.draft(*draft, depths, begin_counts)
        if rng.random() < 0.5:  # the draft loop's rows again: what a commit may reuse
            n, _, _, table, counts = draft
            # Without counts, the rows as the counted begin left them on the device
            # (D past the counts), so a reuse of its packed rows would go unnoticed by
            # the host comparison; with counts, the raw rows a plain begin shipped.
            same = table if commit_counts else masked(table, counts)
            zeros = np.zeros(n, np.int32)
            pair.commit(zeros, zeros, same, counts, zeros, 0, n, commit_counts)
        else:
            pair.commit(*commit, commit_counts)


def full_batch_inputs():
    """P == R with pad tokens: request R - 1 absorbs the pad (contract §6)."""
    counts = np.full(R, 2, np.int32)
    table = raw_table(np.random.default_rng(7), counts)
    spans = np.ones(R, np.int32)
    starts = np.arange(R, dtype=np.int32) % 8
    return spans, starts, table, counts, np.zeros(R, np.int32), R + 3, R


@pytest.mark.parametrize("path", PATHS)
def test_a_full_batch_that_absorbs_the_pad_equals_the_oracle(path):
    pair = Pair(path)
    pair.commit(*full_batch_inputs(), True)


@pytest.mark.parametrize("path", PATHS)
def test_a_shrunk_count_leaves_no_stale_block_in_the_draft_table(path):
    """An int64 draft table into an int32 view: every entry of a draft row must fit the
    view (contract §5). A begin whose row 0 holds 2**40 in column 4, below its count,
    makes the depth refuse; the next begin gives row 0 two blocks, so column 4 is past
    its count and holds D: the depth runs (a stale 2**40 left in the host's copy of
    the table would refuse it) and equals the oracle."""
    kwargs = dict(KWARGS, max_kv_block_count=40, block_table_dtype=torch.int64)
    meta, view, _ = build(path, max_kv_block_count=40, block_table_dtype=torch.int64)
    ref = ReferenceMTPMetadata(**kwargs)
    ref.allocate("cpu")
    ref_view = ReferenceGPUView(R, TOKENS, 40, "cpu")
    table = np.arange(R * 40, dtype=np.int64).reshape(R, 40)
    table[0, 4] = 2**40
    starts = np.zeros(R, np.int32)
    meta.begin_decode(2, 2, starts, table, False, block_counts=[5, 3])
    with pytest.raises(ValueError, match="does not fit"):
        meta.setup_decode_step(view)
    counts = np.array([2, 3])
    meta.begin_decode(2, 2, starts, table, False, block_counts=counts)
    meta.setup_decode_step(view)
    ref.begin_decode(2, 2, torch.from_numpy(starts),
                     torch.from_numpy(masked(table, counts)), False)
    ref.setup_decode_step(ref_view)
    assert_views_equal(view, ref_view)
    assert_buffers_equal(meta, ref)


@pytest.mark.parametrize("path", PATHS)
def test_a_depth_past_its_count_is_refused_with_nothing_changed(path):
    """Row 1 has one block (column 0) and its depth 1 writes column 1: the depth is
    refused, naming block_counts, though the caller's table holds a real block there
    (never read) and the device row holds D."""
    meta, view, _ = build(path)
    table = np.arange(R * W, dtype=np.int32).reshape(R, W)
    counts = np.full(R, W, np.int32)
    counts[1] = 1
    starts = np.zeros(R, np.int32)
    starts[1] = BS - 1
    meta.begin_decode(3, 4, starts, table, False, block_counts=counts)
    assert meta.block_table[1].tolist() == [table[1, 0]] + [D] * (W - 1)
    meta.setup_decode_step(view)
    meta.advance_decode_step()
    before, view_before = buffer_state(meta), view_state(view)
    with pytest.raises(ValueError, match=r"block_counts: draft row 1 .* column 1"):
        meta.setup_decode_step(view)
    assert_same_state(before, buffer_state(meta))
    assert_same_state(view_before, view_state(view))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad_block", [False, True])
def test_a_depth_past_the_shipped_columns_is_refused_naming_its_row(path, bad_block):
    """W 40, counts of at most 2 blocks (C = 8 shipped columns): row 0's depth writes
    column 10, past its count and past C, so the mirror path's host truth (the packed
    ``[n, C]`` rows) does not reach it; the depth is still refused naming row 0 and
    block_counts, also when row 1 after it writes an unallocated block."""
    width = 40
    meta, view, _ = build(path, max_kv_block_count=width)
    view = ContextGPUView(R, TOKENS, width, "cpu")
    table = np.arange(R * width, dtype=np.int32).reshape(R, width)
    table[1, 0] = -1 if bad_block else table[1, 0]
    starts = np.zeros(R, np.int32)
    starts[0] = 10 * BS
    meta.begin_decode(3, 4, starts, table, False, block_counts=np.full(R, 2, np.int32))
    before, view_before = buffer_state(meta), view_state(view)
    with pytest.raises(ValueError, match=r"block_counts: draft row 0 .* column 10"):
        meta.setup_decode_step(view)
    assert_same_state(before, buffer_state(meta))
    assert_same_state(view_before, view_state(view))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("inherited", [False, True])
def test_a_commit_token_past_its_count_is_refused_with_nothing_changed(path, inherited):
    """Request 1 writes positions 2..5 (columns 0 and 1) with one block: refused before
    anything is written, even when its columns are inherited (redirected to D)."""
    meta, view, _ = build(path)
    table = np.arange(R * W, dtype=np.int32).reshape(R, W)
    kwargs = dict(start_positions=np.array([0, 2]), block_counts=np.array([2, 1]))
    if inherited:
        kwargs["inherited_blocks"] = np.array([0, 2])
    before, view_before = buffer_state(meta), view_state(view)
    with pytest.raises(ValueError, match=r"block_counts: request 1 .* column 1"):
        meta.setup_commit_pass(view, np.array([3, 4]), table, **kwargs)
    assert_same_state(before, buffer_state(meta))
    assert_same_state(view_before, view_state(view))


BAD_COUNTS = [
    (np.array([1, 1]), ValueError, r"block_counts: 2 entries < 3"),
    (np.array([1, -1, 1]), ValueError, r"block_counts: entry 1 is -1, outside \[0, 6\]"),
    (np.array([1, 7, 1]), ValueError, r"block_counts: entry 1 is 7, outside \[0, 6\]"),
    (np.array([1.0, 1.0, 1.0]), TypeError, r"block_counts"),
    (torch.ones(3, dtype=torch.int32, device="meta"), TypeError,
     r"block_counts: a device tensor"),
    (np.ones((3, 1), np.int32), ValueError, r"block_counts: expected a 1-D"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad, error, message", BAD_COUNTS)
def test_bad_block_counts_are_refused_with_nothing_changed(path, bad, error, message):
    meta, view, _ = build(path)
    table = np.arange(R * W, dtype=np.int32).reshape(R, W)
    before, view_before = buffer_state(meta), view_state(view)
    with pytest.raises(error, match=message):
        meta.begin_decode(3, 3, np.zeros(3, np.int32), table, False, block_counts=bad)
    with pytest.raises(error, match=message):
        meta.setup_commit_pass(view, np.ones(3, np.int32), table, block_counts=bad)
    assert_same_state(before, buffer_state(meta))
    assert_same_state(view_before, view_state(view))


def test_a_device_table_with_counts_is_refused():
    """The device route takes no counts: they select what the host reads."""
    meta, view, _ = build("mirror")
    table = torch.zeros((R, W), dtype=torch.int32, device="meta")
    before = buffer_state(meta)
    with pytest.raises(TypeError, match="block_counts: block_table_src is a device"):
        meta.begin_decode(2, 2, torch.zeros(2, dtype=torch.int32, device="meta"), table,
                          False, block_counts=[1, 1])
    with pytest.raises(TypeError, match="block_counts: block_table is a device"):
        meta.setup_commit_pass(view, [1, 1], table, block_counts=[1, 1])
    assert_same_state(before, buffer_state(meta))


def test_column_bucket_is_a_small_fixed_set():
    assert [column_bucket(m, 2048) for m in (0, 1, 8, 9, 40, 64, 65, 2000)] == \
        [8, 8, 8, 16, 64, 64, 128, 2048]
    assert column_bucket(300, 100) == 100
    assert len({column_bucket(m, 8192) for m in range(8193)}) == 11


@no_debug
def test_counted_calls_ship_only_the_bucket_columns():
    """Mirror path, W 512 and 1024: a begin with counts copies (n + 1) head words and
    ``n * C`` table entries host-to-device, a commit pass the same bytes at both widths;
    without counts a begin ships its head region (R + 1 = 9 words, padded to 40 bytes)
    and its rows rounded up to BEGIN_ROWS (6 -> 8) of W entries. Counts of 3..5
    blocks: C = 8. Below 256 columns (W 64) both ship whole rows (C = W)."""
    commit_bytes = {}
    for width in (64, 512, 1024):
        meta, _, recorder = build("mirror", max_kv_block_count=width)
        view = ContextGPUView(R, TOKENS, width, "cpu")
        rng = np.random.default_rng(0)
        n = 6
        counts = rng.integers(3, 6, size=R).astype(np.int32)
        table = np.full((R, width), -1, np.int32)
        for i in range(R):
            table[i, :counts[i]] = rng.integers(0, 1000, size=counts[i])
        starts = np.arange(R, dtype=np.int32)
        columns = column_bucket(int(counts[:n].max()), width) if width >= 256 else width
        assert columns == (8 if width >= 256 else width)
        with H2DCounter(recorder) as begin:
            meta.begin_decode(n, n, starts, table, False, block_counts=counts)
        assert (begin.copies, begin.nbytes) == (2, 4 * (n + 1) + 4 * n * columns)
        meta.end_forward()
        with H2DCounter(recorder) as plain:
            meta.begin_decode(n, n, starts, table, False)
        assert (plain.copies, plain.nbytes) == (1, 40 + 4 * 8 * width)
        meta.end_forward()
        with H2DCounter(recorder) as commit:
            meta.setup_commit_pass(view, np.ones(n, np.int32), table,
                                   start_positions=starts[:n], block_counts=counts)
        assert commit.copies == 1
        commit_bytes[width] = commit.nbytes
    assert commit_bytes[512] == commit_bytes[1024], commit_bytes
    assert commit_bytes[64] >= commit_bytes[512] + 4 * 6 * (64 - 8), commit_bytes


@no_debug
@pytest.mark.parametrize("width", [64, 512])
@pytest.mark.parametrize("path", PATHS)
def test_counted_calls_stay_within_their_op_budgets_with_no_sync_or_allocation(path,
                                                                               width):
    """Per call after a warm-up: the mirror path's counted begin 4 data ops (2
    without), a depth 2, a counted commit pass 3 (2 without); no scalar read-back and
    no new storage anywhere; the direct path issues no device op at all. Counts of at
    most 6 blocks: C = 8 at W 512; W 64 is below 256 columns, whose rows ship whole
    (C = W): a begin and a commit pass 2 each."""
    meta, _, _ = build(path, max_kv_block_count=width)
    view = ContextGPUView(R, TOKENS, width, "cpu")
    rng = np.random.default_rng(3)
    ops = {}
    for round_ in range(4):
        draft, commit = step_inputs(rng, 2, width, low=1, long=False)
        n, padded, starts, table, counts = draft
        spans, cstarts, ctable, ccounts, inherited, ptokens, prequests = commit
        calls = {
            "begin": lambda: meta.begin_decode(n, padded, starts, table, False,
                                               block_counts=counts),
            "depth": lambda: meta.setup_decode_step(view),
            "advance": meta.advance_decode_step,
            "end": meta.end_forward,
            "commit": lambda: meta.setup_commit_pass(
                view, spans, ctable, start_positions=cstarts, inherited_blocks=inherited,
                padded_token_count=ptokens, padded_request_count=prequests,
                block_counts=ccounts)}
        for name in ("begin", "depth", "advance", "depth", "end", "commit", "end"):
            with OpCounter() as counter:
                calls[name]()
            if round_:
                assert counter.scalar_reads == 0, (name, counter.ops)
                assert counter.new_storages == 0, (name, counter.new_storage_ops)
                ops.setdefault(name, set()).add(counter.data_ops)
    if path == "direct":
        assert all(values == {0} for values in ops.values()), ops
        return
    assert ops["depth"] == {2} and ops["advance"] == {1}, ops
    whole = width < 256
    assert ops["begin"] == {2 if whole else 4} and ops["commit"] == {2 if whole else 3}, ops


@pytest.mark.parametrize("slots", [2, 3])
def test_reused_staging_slots_never_leak_stale_blocks(slots):
    """The mirror path D-fills a staging slot's packed rows only where they may be
    stale (per-slot widths, valid for one shipped width C and one writer): 60 steps on
    2 or 3 slots, each a begin (counted or plain), two depths and a commit pass
    (counted or plain), with the largest count jumping between buckets, every one equal
    to the reference on the masked table (a stale entry past a count would show)."""
    width = 40
    pair = Pair("mirror", width)
    pair.meta.allocate("cpu", mirror=True, max_tokens=TOKENS, staging_slots=slots)
    rng = np.random.default_rng(11)
    for step in range(60):
        draft, commit = step_inputs(rng, 2, width, low=1)
        pair.draft(*draft, 2, bool(rng.random() < 0.7))
        pair.commit(*commit, bool(rng.random() < 0.7))
