"""A commit pass takes the leading rows of its block table from the draft loop's
persistent device table, device-to-device, when they are the rows ``begin_decode``
staged (mirror path; the host-to-device bytes of issue 17).

The rows are compared on the host against the host copy of what the device holds,
never assumed: any changed entry, a torch write into ``block_table`` since, or a
``begin_decode`` from device inputs (whose table the host never saw) turns the device
copy off. Every test drives the mirror path and the reference (upstream's op sequence)
with the same calls and compares every view byte; the counted host-to-device bytes say
whether the device copy was taken.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.bench.h2d import H2DCounter, StagingRecorder
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from mtpmeta.runtime import use_runtime
from tests.cuda_sim import CudaSim
from tests.helpers import assert_views_equal, config
from tests.test_cuda_sim import (assert_no_hidden_copies, host, make_sim,  # noqa: F401
                                 new_pair)
from tests.test_sim_hazards import upload
from tests.upstream_view import UpstreamLayoutView

under_sim = pytest.mark.skipif(
    os.environ.get("MTPMETA_DEBUG") == "1",
    reason="MTPMETA_DEBUG's .numpy() reads bypass the simulated device")

KWARGS = config()
R, W, BS, D = (KWARGS["max_requests"], KWARGS["max_kv_block_count"],
               KWARGS["block_size_tokens"], KWARGS["dummy_block_idx"])
TOKENS = 64
LAYOUTS = {"mtpmeta": ContextGPUView, "upstream": UpstreamLayoutView}


class Pair:
    """A CPU-forced mirror-path object (its staging recorded, so its H2D bytes can be
    counted) and the reference, each with a view, driven with the same calls."""

    def __init__(self, layout: str = "mtpmeta") -> None:
        self.recorder = StagingRecorder()
        with use_runtime(self.recorder):
            self.meta = MTPMetadata(**KWARGS)
            self.meta.allocate("cpu", mirror=True, max_tokens=TOKENS)
        self.view = LAYOUTS[layout](R, TOKENS, W, "cpu")
        self.ref = ReferenceMTPMetadata(**KWARGS)
        self.ref.allocate("cpu")
        self.ref_view = ReferenceGPUView(R, TOKENS, W, "cpu")

    def draft_loop(self, count: int, starts: torch.Tensor, table: torch.Tensor) -> None:
        for meta, view in ((self.meta, self.view), (self.ref, self.ref_view)):
            meta.begin_decode(count, count, starts, table, False)
            meta.setup_decode_step(view)
            meta.advance_decode_step()
            meta.end_forward()

    def commit(self, counts: torch.Tensor, table: torch.Tensor, starts: torch.Tensor,
               padded_tokens: int) -> int:
        """The commit pass on both sides; the mirror path's H2D bytes. Views equal."""
        kwargs = dict(start_positions=starts, padded_token_count=padded_tokens)
        with H2DCounter(self.recorder) as counter:
            self.meta.setup_commit_pass(self.view, counts, table, **kwargs)
        self.ref.setup_commit_pass(self.ref_view, counts, table, **kwargs)
        self.meta.end_forward()
        self.ref.end_forward()
        assert_views_equal(self.view, self.ref_view)
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
    reference's, and its H2D bytes are a never-drafted twin's minus ``k`` table rows,
    ``k = min(P, n)`` (never the row that absorbs a full batch's pad), when rows
    ``[:k]`` of its table equal T's, and the twin's own bytes when any entry differs."""
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
    reused = rows if change is None and rows > 0 else 0
    assert got == full - reused * W * table_item(layout)


def test_commit_pass_alone_ships_its_whole_table():
    """A commit with no draft loop before it has no device rows to take."""
    pair = Pair()
    rng = np.random.default_rng(0)
    counts, starts, padded = commit_inputs(rng, 5, 0)
    nbytes = pair.commit(counts, random_table(rng), starts, padded)
    assert nbytes >= 5 * W * 4


def test_a_torch_write_into_the_draft_table_turns_the_device_copy_off():
    """A scheduler that patches ``active_block_table`` in place (a torch op: the version
    counter moves) after begin_decode: the commit pass must read its own argument, not
    the patched device row, and ship the whole table."""
    rng = np.random.default_rng(1)
    table = random_table(rng)
    starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    pair, twin = Pair(), Pair()
    pair.draft_loop(5, starts, table)
    pair.meta.active_block_table[0, 0] = D - 1
    pair.ref.active_block_table[0, 0] = D - 1
    counts, commit_starts, padded = commit_inputs(rng, 6, 0)
    assert pair.commit(counts, table, commit_starts, padded) == \
        twin.commit(counts, table, commit_starts, padded)


def test_inference_mode_buffers_still_take_the_device_rows():
    """Buffers allocated under ``torch.inference_mode`` keep no version counter; the
    row comparison alone still decides, and a changed entry still turns it off."""
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
        changed = table.clone()
        changed[4, W - 1] += R * W
        assert pair.commit(counts, changed, commit_starts, padded) == full


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
    assert_no_hidden_copies(sim)


def commits_between_begins_on_two_streams(sim: CudaSim, seed: int):
    """begin(T_i) and a depth on stream a, the commit on T_i on stream b (its rows from
    the device table), then begin(T_i+1) on a, overwriting that table: each commit's
    view, as a forward on b reads it, against the reference's."""
    rng = np.random.default_rng(seed)
    lanes = [sim.Stream("a"), sim.Stream("b")]
    checks = []
    with sim:
        meta, ref, [(view, ref_view)] = new_pair(sim)
        for _ in range(6):
            table = random_table(rng)
            starts = host(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
            n = int(rng.integers(1, R))
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
    from mtpmeta.runtime import StreamOrder

    monkeypatch.setattr(StreamOrder, "enter", lambda self: None)
    assert sum(commits_between_begins_on_two_streams(make_sim(seed, idle=0.9), seed)
               for seed in range(4)) > 0
