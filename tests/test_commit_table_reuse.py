"""A commit pass takes the leading rows of its block table from the draft loop's
persistent device table, device-to-device, when they are the rows ``begin_decode``
staged (mirror path: those rows cross no host-to-device copy).

The rows are compared on the host against the host copy of what the device holds,
never assumed: any changed entry, or a ``begin_decode`` from device inputs (whose table
the host never saw), turns the device copy off. They are read from a private device
table that no public name aliases, so no write into ``block_table`` (a torch op,
``.data``, DLPack, ``.numpy()``, a ``set_`` alias, a replayed graph, under
``torch.inference_mode``) reaches a row a commit places. Every test drives the mirror
path and the reference (upstream's op sequence) with the same calls and compares every
view byte; the counted host-to-device bytes and ``reused_table_rows`` say whether the
device copy was taken.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.bench.counters import H2DCounter, StagingRecorder
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from mtpmeta.buffers.device_runtime import use_runtime
from tests.cuda_sim import CudaSim, SimGraph
from tests.helpers import assert_views_equal, config
from tests.test_cuda_sim import (assert_no_hidden_copies, host, make_sim,  # noqa: F401
                                 new_pair)
from tests.test_sim_hazards import upload
from tests.upstream_view import UpstreamLayoutView

under_sim = pytest.mark.skipif(
    os.environ.get("MTPMETA_DEBUG") == "1",
    reason="MTPMETA_DEBUG's checks synchronize the simulated device after every call")

KWARGS = config()
R, W, BS, D = (KWARGS["max_requests"], KWARGS["max_kv_block_count"],
               KWARGS["block_size_tokens"], KWARGS["dummy_block_idx"])
TOKENS = 64
LAYOUTS = {"mtpmeta": ContextGPUView, "upstream": UpstreamLayoutView}


class Pair:
    """A CPU-forced mirror-path object (its staging recorded, so its H2D bytes can be
    counted) and the reference, each with a view, driven with the same calls; with
    ``direct``, a direct-path object too."""

    def __init__(self, layout: str = "mtpmeta", *, direct: bool = False) -> None:
        self.recorder = StagingRecorder()
        with use_runtime(self.recorder):
            self.meta = MTPMetadata(**KWARGS)
            self.meta.allocate("cpu", mirror=True, max_tokens=TOKENS)
        self.view = LAYOUTS[layout](R, TOKENS, W, "cpu")
        self.ref = ReferenceMTPMetadata(**KWARGS)
        self.ref.allocate("cpu")
        self.ref_view = ReferenceGPUView(R, TOKENS, W, "cpu")
        self.sides = [(self.meta, self.view), (self.ref, self.ref_view)]
        if direct:
            self.direct = MTPMetadata(**KWARGS)
            self.direct.allocate("cpu", mirror=False, max_tokens=TOKENS)
            self.direct_view = LAYOUTS[layout](R, TOKENS, W, "cpu")
            self.sides.append((self.direct, self.direct_view))

    @property
    def reused(self) -> int:
        """Commit-pass table rows the mirror path placed from its device copy so far."""
        return self.meta._backend.reused_table_rows

    def draft_loop(self, count: int, starts: torch.Tensor, table: torch.Tensor) -> None:
        for meta, view in self.sides:
            meta.begin_decode(count, count, starts, table, False)
            meta.setup_decode_step(view)
            meta.advance_decode_step()
            meta.end_forward()

    def commit(self, counts: torch.Tensor, table: torch.Tensor, starts: torch.Tensor,
               padded_tokens: int) -> int:
        """The commit pass on every side; the mirror path's H2D bytes. Every view (and
        the direct path's ``query_lengths``) equals the reference's."""
        kwargs = dict(start_positions=starts, padded_token_count=padded_tokens)
        with H2DCounter(self.recorder) as counter:
            self.meta.setup_commit_pass(self.view, counts, table, **kwargs)
        for meta, view in self.sides[1:]:
            meta.setup_commit_pass(view, counts, table, **kwargs)
        for meta, view in self.sides:
            meta.end_forward()
            assert_views_equal(view, self.ref_view)
        if len(self.sides) > 2:
            assert torch.equal(self.meta.query_lengths, self.direct.query_lengths)
        return counter.nbytes


def commit_inputs(rng: np.random.Generator, num_prefill: int, pad: int
                  ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    counts = rng.integers(1, 4, size=num_prefill).astype(np.int32)
    starts = rng.integers(0, W * BS - 4, size=num_prefill).astype(np.int32)
    return host(counts), host(starts), int(counts.sum()) + pad


def random_table(rng: np.random.Generator) -> torch.Tensor:
    return host(rng.permutation(R * W).reshape(R, W).astype(np.int32))


def table_item(layout: str) -> int:
    return LAYOUTS[layout](1, 1, 1, "cpu").mha_block_table.element_size()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_commit_rows_come_from_the_device_table_exactly_when_they_match(layout, data):
    """After a draft loop on table T, a commit pass on P rows: the view is the
    reference's, and its H2D bytes are a never-drafted twin's minus ``k`` table rows:
    of the first ``min(P, n)`` rows (never the row that absorbs a full batch's pad),
    the ones before the first row with an entry that differs from T's (the longest
    matching prefix, so one changed row does not make every row cross again)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    count = data.draw(st.integers(1, R), label="n")
    num_prefill = data.draw(st.integers(1, R), label="P")
    pad = data.draw(st.integers(0, 3), label="pad tokens")
    absorbs = num_prefill == R and pad > 0
    rows = min(count, num_prefill - absorbs)
    change: Optional[Tuple[int, int]] = None
    if rows > 0 and data.draw(st.booleans(), label="change an entry"):
        change = (data.draw(st.integers(0, rows - 1), label="row"),
                  data.draw(st.integers(0, W - 1), label="column"))
    table = random_table(rng)
    starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    pair, twin = Pair(layout), Pair(layout)
    pair.draft_loop(count, starts, table)
    commit_table = table.clone()
    if change is not None:
        commit_table[change] += R * W  # another block, still inside the id range
    counts, commit_starts, padded = commit_inputs(rng, num_prefill, pad)
    got = pair.commit(counts, commit_table, commit_starts, padded)
    full = twin.commit(counts, commit_table, commit_starts, padded)
    reused = max(rows, 0) if change is None else change[0]
    assert got == full - reused * W * table_item(layout)
    assert (pair.reused, twin.reused) == (reused, 0)


def test_commit_pass_alone_ships_its_whole_table():
    """A commit with no draft loop before it has no device rows to take."""
    pair = Pair()
    rng = np.random.default_rng(0)
    counts, starts, padded = commit_inputs(rng, 5, 0)
    nbytes = pair.commit(counts, random_table(rng), starts, padded)
    assert nbytes >= 5 * W * 4
    assert pair.reused == 0


def _write_op(table: torch.Tensor) -> None:
    table[0, 0] = D - 1


def _write_data(table: torch.Tensor) -> None:
    table.data[0, 0] = D - 1


def _write_dlpack(table: torch.Tensor) -> None:
    dlpack = torch.utils.dlpack
    dlpack.from_dlpack(dlpack.to_dlpack(table))[0, 0] = D - 1


def _write_numpy(table: torch.Tensor) -> None:
    table.numpy()[0, 0] = D - 1


def _write_set_alias(table: torch.Tensor) -> None:
    alias = torch.empty(0, dtype=table.dtype)
    alias.set_(table.untyped_storage(), table.storage_offset(), table.shape, table.stride())
    alias[0, 0] = D - 1


#: Writes into the persistent table; all but the torch op bypass its version counter.
TABLE_WRITES: Dict[str, Callable[[torch.Tensor], None]] = {
    "torch op": _write_op, ".data": _write_data, "DLPack": _write_dlpack,
    ".numpy()": _write_numpy, "set_ alias": _write_set_alias}


@pytest.mark.parametrize("inference", [False, True], ids=["grad mode", "inference_mode"])
@pytest.mark.parametrize("write", sorted(TABLE_WRITES))
def test_no_write_into_the_draft_table_reaches_a_commit_row(write, inference):
    """contract §1 and §9: after a draft loop on T, a scheduler writes
    ``block_table[0, 0]`` by any route (under ``torch.inference_mode`` there is no
    version counter at all). The commit pass on T still writes T's rows, the
    reference's bytes, and still takes its 5 leading rows from the device: from the
    private copy begin_decode filled, which the write cannot reach."""
    rng = np.random.default_rng(1)
    table = random_table(rng)
    starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    with torch.inference_mode() if inference else contextlib.nullcontext():
        pair, twin = Pair(), Pair()
        pair.draft_loop(5, starts, table)
        TABLE_WRITES[write](pair.meta.block_table)
        assert int(pair.meta.active_block_table[0, 0]) == D - 1 != int(table[0, 0])
        counts, commit_starts, padded = commit_inputs(rng, 6, 0)
        got = pair.commit(counts, table, commit_starts, padded)
        assert got == twin.commit(counts, table, commit_starts, padded) - 5 * W * 4
    assert pair.reused == 5


@pytest.mark.parametrize("seed", range(4))
def test_a_full_batch_commit_with_pad_writes_the_direct_paths_bytes(seed):
    """n = P = R, pad tokens, the draft loop's own table: the mirror path takes R - 1
    rows from the device, never row R - 1, which absorbs the pad and whose columns
    wholly past the span it writes point at D (§6). Every view byte and
    ``query_lengths`` equal the direct path's and the reference's."""
    rng = np.random.default_rng(seed)
    table = random_table(rng)
    starts = host(rng.integers(0, BS, size=R).astype(np.int32))
    counts = host(rng.integers(1, 4, size=R).astype(np.int32))
    padded = int(counts.sum()) + int(rng.integers(1, 5))
    pair = Pair(direct=True)
    pair.draft_loop(R, starts, table)
    pair.commit(counts, table, starts, padded)
    assert pair.reused == R - 1
    assert int(pair.view.mha_block_table[R - 1, W - 1]) == D != int(table[R - 1, W - 1])


def test_inference_mode_buffers_still_take_the_device_rows():
    """Buffers allocated under ``torch.inference_mode`` keep no version counter; the
    row comparison alone still decides, and a changed entry in row 4 stops the reuse
    there (rows 0-3 still come from the device)."""
    rng = np.random.default_rng(2)
    table = random_table(rng)
    starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    with torch.inference_mode():
        pair, twin = Pair(), Pair()
        pair.draft_loop(5, starts, table)
        counts, commit_starts, padded = commit_inputs(rng, 6, 0)
        reused = pair.commit(counts, table, commit_starts, padded)
        full = twin.commit(counts, table, commit_starts, padded)
        assert reused == full - 5 * W * 4
        assert pair.reused == 5
        changed = table.clone()
        changed[4, W - 1] += R * W
        assert pair.commit(counts, changed, commit_starts, padded) == full - 4 * W * 4
        assert pair.reused == 5 + 4


def test_capture_begin_rows_of_dummy_are_device_rows_too():
    """``begin_decode_for_capture`` fills rows of D on both sides; a commit whose rows
    are D takes them from the device."""
    pair, twin = Pair(), Pair()
    for meta in (pair.meta, pair.ref):
        meta.begin_decode_for_capture(4)
        meta.end_forward()
    table = torch.full((R, W), D, dtype=torch.int32)
    table[4:] = torch.arange((R - 4) * W, dtype=torch.int32).view(R - 4, W)
    counts, starts, padded = commit_inputs(np.random.default_rng(3), 6, 0)
    assert pair.commit(counts, table, starts, padded) == \
        twin.commit(counts, table, starts, padded) - 4 * W * 4
    assert pair.reused == 4


# --------------------------------------------------------- under CUDA semantics
@under_sim
def test_a_device_input_begin_turns_the_device_copy_off(make_sim):
    """A host-route begin on T, then a device-input begin on X (the device table now
    holds X, which the host never saw), then a commit on T: the commit must write T's
    rows, not X's. Under ``inference_mode`` (no version counter to see the device
    write), so the host's own record of what the device table holds must."""
    sim = make_sim(0, idle=0.5)
    rng = np.random.default_rng(4)
    table, other = random_table(rng), random_table(rng)
    starts = rng.integers(0, W * BS - 4, size=R).astype(np.int32)
    with sim, torch.inference_mode():
        meta, ref, [(view, ref_view)] = new_pair(sim)
        meta.begin_decode(5, 5, host(starts), table, False)
        meta.end_forward()
        meta.begin_decode(5, 5, upload(sim, starts), upload(sim, other.numpy()), False)
        meta.end_forward()
        counts, commit_starts, padded = commit_inputs(rng, 6, 0)
        meta.setup_commit_pass(view, counts, table, start_positions=commit_starts,
                               padded_token_count=padded)
        got = view.mha_block_table.clone()
        ref.setup_commit_pass(ref_view, counts, table, start_positions=commit_starts,
                              padded_token_count=padded)
        sim.synchronize()
        got = sim.peek(got)
    assert torch.equal(got, ref_view.mha_block_table)
    assert meta._backend.reused_table_rows == 0
    assert_no_hidden_copies(sim)


@under_sim
def test_a_replayed_table_patch_never_reaches_a_commit_row(make_sim):
    """A user graph that patches ``block_table`` in place, replayed after the next
    begin_decode (on CUDA a replay moves no version counter, and the simulator models
    that): the commit pass on the begin's table writes that table's rows, taking its
    5 leading rows from the device's private copy, which no replay touches."""
    sim = make_sim(0)
    rng = np.random.default_rng(5)
    table = random_table(rng)
    starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        patch = torch.full((1,), D - 1, dtype=torch.int32)  # a device tensor
        sim.synchronize()
        graph = SimGraph()
        meta.begin_decode(5, 5, starts, table, False)
        with sim.capture(graph):
            meta.block_table[0, :1].copy_(patch)
        meta.end_forward()
        meta.begin_decode(5, 5, starts, table, False)
        version = meta.block_table._version
        graph.replay()
        meta.end_forward()
        counts, commit_starts, padded = commit_inputs(rng, 6, 0)
        meta.setup_commit_pass(view, counts, table, start_positions=commit_starts,
                               padded_token_count=padded)
        ref.begin_decode(5, 5, starts, table, False)
        ref.end_forward()
        ref.setup_commit_pass(ref_view, counts, table, start_positions=commit_starts,
                              padded_token_count=padded)
        sim.synchronize()
        assert meta.block_table._version == version  # the replay moved no counter
        assert int(sim.peek(meta.block_table)[0, 0]) == D - 1  # the patch did land
        got = sim.peek(view.mha_block_table)
    assert torch.equal(got, ref_view.mha_block_table)
    assert meta._backend.reused_table_rows == 5
    assert_no_hidden_copies(sim)


def commits_between_begins_on_two_streams(sim: CudaSim, seed: int):
    """begin(T_i) and a depth on stream a, the commit on T_i on stream b (its rows from
    the device table), then begin(T_i+1) on a, overwriting that table: each commit's
    view, as a forward on b reads it, against the reference's."""
    rng = np.random.default_rng(seed)
    lanes = [sim.Stream("a"), sim.Stream("b")]
    checks, drafted = [], 0
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        for _ in range(6):
            table = random_table(rng)
            starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
            n = int(rng.integers(1, R))
            drafted += n
            counts, commit_starts, padded = commit_inputs(rng, n + 1, 0)
            with sim.stream(lanes[0]):
                meta.begin_decode(n, n, starts, table, False)
                meta.setup_decode_step(view)
                meta.end_forward()
            ref.begin_decode(n, n, starts, table, False)
            ref.setup_decode_step(ref_view)
            ref.end_forward()
            with sim.stream(lanes[1]):
                meta.setup_commit_pass(view, counts, table, start_positions=commit_starts,
                                       padded_token_count=padded)
                got = view.mha_block_table.clone()
                meta.end_forward()
                event = sim.Event()
                event.record(lanes[1])
            ref.setup_commit_pass(ref_view, counts, table, start_positions=commit_starts,
                                  padded_token_count=padded)
            ref.end_forward()
            with sim.bypass():
                checks.append((event, got, ref_view.mha_block_table.clone()))
        results = []
        for event, got, want in checks:
            event.synchronize()
            results.append((sim.peek(got), want))
        sim.synchronize()
    assert_no_hidden_copies(sim)
    assert meta._backend.reused_table_rows == drafted  # each commit took its n rows
    return sum(not torch.equal(got, want) for got, want in results)


@under_sim
@pytest.mark.parametrize("seed", range(4))
def test_device_rows_are_read_before_the_next_begin_overwrites_them(make_sim, seed):
    """The commit's device-to-device read of the draft table is stream-ordered before
    the next begin_decode's upload into it, also across streams (StreamOrder)."""
    assert commits_between_begins_on_two_streams(make_sim(seed, idle=0.9), seed) == 0


@under_sim
def test_unordered_streams_let_the_next_begin_overwrite_the_rows_read(make_sim,
                                                                      monkeypatch):
    """Negative control: with the cross-stream ordering of the persistent buffers
    removed, the device-row read races the next upload and some commit reads a wrong
    row (so the test above can fail)."""
    from mtpmeta.buffers.device_runtime import StreamOrder

    monkeypatch.setattr(StreamOrder, "enter", lambda self: None)
    assert sum(commits_between_begins_on_two_streams(make_sim(seed, idle=0.9), seed)
               for seed in range(4)) > 0


class PassCounter:
    """A test seam around the two host passes over a commit's table: the rows
    ``native.draft_state.matching_rows`` compares (its count, stopping after the first row
    that differs) and the rows the ``native.staging.commit_pass`` right after it copies
    (``[first:P]``); the passes of the other sides (no comparison) are not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mtpmeta import native
        self.compared = self.copied = self.both = 0
        match, commit = native.draft_state.matching_rows, native.staging.commit_pass

        def matching_rows(table, truth, count):
            k = match(table, truth, count)
            self.compared += min(k + 1, count)
            self.last_match = (k, count)
            return k

        def commit_pass(counts, *args):
            if self.last_match is not None:  # the pass whose rows were just compared
                first = args[11]  # first_table_row
                self.copied += counts.shape[0] - first
                k, count = self.last_match
                self.both += k < count and first == k  # row k: compared, then copied
                self.last_match = None
            return commit(counts, *args)

        self.last_match: Optional[Tuple[int, int]] = None
        monkeypatch.setattr(native.draft_state, "matching_rows", matching_rows)
        monkeypatch.setattr(native.staging, "commit_pass", commit_pass)


@pytest.mark.parametrize("first_changed", [0, 1, 3, 5])
def test_a_commit_reuses_exactly_its_matching_leading_rows(monkeypatch, first_changed):
    """After a draft loop on T (n = 7), a commit on P = 9 rows whose
    row ``k`` differs from T's (and later rows too) takes exactly rows ``[:k]`` from the
    device, ships the rest, and writes the direct path's and the reference's bytes. Each
    of the P rows is compared or copied; only row k is both (one pass per table)."""
    rng = np.random.default_rng(first_changed)
    table = random_table(rng)
    starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    pair, twin = Pair(direct=True), Pair()
    pair.draft_loop(6, starts, table)
    commit_table = table.clone()
    commit_table[first_changed, W - 1] += R * W
    commit_table[first_changed + 1, 0] += R * W
    counts, commit_starts, padded = commit_inputs(rng, 7, 2)
    passes = PassCounter(monkeypatch)
    got = pair.commit(counts, commit_table, commit_starts, padded)
    assert pair.reused == first_changed
    assert got == twin.commit(counts, commit_table, commit_starts, padded) \
        - first_changed * W * 4
    assert passes.compared + passes.copied == 7 + 1
    assert passes.both == 1
