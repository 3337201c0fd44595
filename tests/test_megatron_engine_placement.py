"""The patched helpers on the placement Megatron's engine really uses, under the CUDA
simulator (``tests/cuda_sim.py``).

Failure story: upstream's ``MTPControllerMixin`` hands the commit pass device counts,
device start positions and a device copy of the context's block-table rows, and the
draft loop device start positions beside the context's pinned host table. A patched
helper that reads each device input back with its own blocking copy (the whole
``[A, W]`` table among them) spends more syncs than upstream's one, and moves the
table across the bus for nothing; one that takes the host rows from the wrong place
writes KV into another request's blocks. So seeded multi-step runs (paused rows,
prefix hits, zero counts, eager and graphed loops) go through the stand-in engine
unpatched and patched on this placement, and every byte of the view, every
``_mtp_activate_attn_metadata`` call and ``forward_mode`` must agree, while each
helper's syncs and device-to-host bytes are counted against upstream's.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch

from mtpmeta.bench.counters import OpCounter
from mtpmeta.integrations import megatron
from tests import standin_megatron
from tests.cuda_sim import CudaSim
from tests.test_megatron_integration import upstream  # noqa: F401 (the fixture)
from tests.test_megatron_integration import (BS, D, GRAPH_MAX_SEQLEN, MAX_TOKENS, R, W,
                                             make_context, random_steps)
from tests.upstream_view import UpstreamLayoutView

#: Syncs and read-back bytes are counted: under MTPMETA_DEBUG=1 the invariant checks
#: read the view back after every call.
counts_syncs = pytest.mark.skipif(os.environ.get("MTPMETA_DEBUG") == "1",
                                  reason="MTPMETA_DEBUG=1: the checks read the view back")

pytestmark = pytest.mark.cuda_sim


class Placement:
    """A stand-in context on the simulated device with the engine's placement: view
    and metadata buffers on the device, ``request_to_kv_block_ids`` pinned host."""

    def __init__(self, modules: Dict[str, Any], sim: CudaSim, patched: bool) -> None:
        self.sim, self.patched = sim, patched
        context_module = modules[f"{standin_megatron.PACKAGE}.dynamic_context"]
        self.context = context_module.StandInContext(R, W, BS, D, MAX_TOKENS,
                                                     GRAPH_MAX_SEQLEN)
        meta = self.context.mtp_metadata
        meta.deallocate()
        meta.allocate("cpu", mirror=True) if patched else meta.allocate("cpu")
        self.context.request_to_kv_block_ids = sim.host_empty((R, W), torch.int32)
        self.read_bytes = 0
        runtime, to_host = sim.runtime, sim.runtime.to_host

        def counted_to_host(tensor: torch.Tensor, out: Any = None) -> torch.Tensor:
            self.read_bytes += tensor.numel() * tensor.element_size()
            return to_host(tensor, out=out)

        runtime.to_host = counted_to_host

    def device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host`` (outside any counted helper call)."""
        out = torch.empty(tuple(host.shape), dtype=host.dtype)
        out.copy_(host)
        return out

    def syncs(self) -> int:
        """The patched side: every sync; upstream: its ``.item()`` read-backs (its
        reference also issues host-scalar copies that CUDA runs as fills)."""
        sim = self.sim
        if self.patched:
            return sim.syncs
        return sum("_local_scalar_dense" in reason for reason in sim.sync_reasons)

    def reads(self) -> int:
        """Device-to-host bytes: the runtime's read-backs, and 8 per ``.item()`` (an
        int64 or narrower scalar)."""
        scalars = sum("_local_scalar_dense" in r for r in self.sim.sync_reasons)
        return self.read_bytes + 8 * scalars

    def counted(self, call) -> Dict[str, int]:
        """``call``'s syncs and read-back bytes (``cost``); its host-to-device copies,
        their bytes and the staged (strided or converting) ones (``copies``)."""
        sim = self.sim
        sim.synchronize()
        syncs, reads = self.syncs(), self.reads()
        before = (sim.h2d_copies, sim.h2d_bytes, sim.staged_h2d_copies,
                  sim.pageable_async_copies)
        issued = sim.issued
        with OpCounter() as counter:
            call()
        self.device_ops, self.allocations = sim.issued - issued, counter.new_storages
        self.copies = dict(zip(("h2d", "h2d_bytes", "staged", "pageable"),
                               (now - was for now, was in zip(
                                   (sim.h2d_copies, sim.h2d_bytes, sim.staged_h2d_copies,
                                    sim.pageable_async_copies), before))))
        return dict(syncs=self.syncs() - syncs, reads=self.reads() - reads)

    def record(self, what: str, cost: Dict[str, int]) -> Dict[str, Any]:
        context, sim = self.context, self.sim
        sim.synchronize()
        calls = context.activations
        return dict(what=what, view=sim.peek(context.gpu_view._buf), calls=len(calls),
                    call=dict(calls[-1]) if calls else None,
                    mode=context.mtp_metadata.forward_mode.value, cost=cost,
                    device_ops=self.device_ops, allocations=self.allocations)


def run_engine(modules: Dict[str, Any], steps: List[Dict], patched: bool,
               seed: int = 0, block_counts: bool = False) -> List[Dict[str, Any]]:
    """Drive ``steps`` as ``MTPControllerMixin`` calls the helpers (the commit pass
    skipped when nothing is committed), on the engine's placement; patched with
    ``patch(block_counts=block_counts)``."""
    if patched:
        megatron.patch(block_counts=block_counts)
    try:
        sim = CudaSim(seed)
        with sim:
            place = Placement(modules, sim, patched)
            context, meta = place.context, place.context.mtp_metadata
            trace = []
            for step in steps:
                paused, total = step["paused"], step["total"]
                n = total - paused
                context.paused_request_count, context.total_request_count = paused, total
                context.request_to_kv_block_ids.copy_(step["table"])
                meta.request_matched_prefix_blocks.copy_(step["hits"])
                counts = place.device(step["counts"])
                starts = place.device(step["starts"])
                table = place.device(context.request_to_kv_block_ids[paused:total][:n])
                total = int(step["counts"].sum())  # the client's, before the helper
                if total:
                    cost = place.counted(lambda: context._mtp_setup_prefill_step(
                        counts, table, padded_token_count=step["padded_tokens"],
                        padded_request_count=step["padded_requests"],
                        request_start_positions=starts, total=total))
                    trace.append(place.record("commit", cost))
                    meta.end_forward()
                draft_starts = place.device(step["starts"] + step["counts"] - 1 + 1)
                cost = place.counted(lambda: context._mtp_begin_decode(
                    n, step["padded"], draft_starts, graphed=step["graphed"]))
                trace.append(dict(place.record("begin", cost), copies=place.copies, n=n))
                for _ in range(step["depths"]):
                    cost = place.counted(context._mtp_setup_decode_step)
                    trace.append(place.record("depth", cost))
                    meta.advance_decode_step()
                meta.end_forward()
            sim.synchronize()
        return trace
    finally:
        megatron.unpatch()


def engine_steps(seed: int) -> List[Dict]:
    """Seeded steps with paused rows, prefix hits and graphed and eager loops, plus a
    step whose counts are all zero (the engine skips its commit pass)."""
    steps = random_steps(seed, count=8)
    zero = dict(steps[0])
    zero["counts"] = torch.zeros_like(zero["counts"])
    zero["padded_tokens"] = 0
    # Nothing committed: the drafts start where the commit pass would have, which for a
    # prefix hit lies in the row's inherited block; the step has none.
    zero["hits"] = torch.zeros_like(zero["hits"])
    return steps + [zero]


def same_but_dummy_past_counts(want: Dict[str, Any], got: Dict[str, Any],
                               view: Any) -> int:
    """How many ``mha_block_table`` entries hold ``D`` in ``got`` where upstream's
    ``want`` copies ``-1`` (every other entry equal); ``want`` then takes ``got``'s
    table bytes, so the rest of the view compares as a whole."""
    start, stop = view.spans["mha_block_table"]
    table_want = want["view"][start:stop].view(torch.int32)
    table_got = got["view"][start:stop].view(torch.int32)
    differs = table_want != table_got
    assert bool((table_want[differs] == -1).all() and (table_got[differs] == D).all())
    want["view"][start:stop] = got["view"][start:stop]
    return int(differs.sum())


@counts_syncs
@pytest.mark.parametrize("block_counts", [False, True], ids=["exact", "counts"])
@pytest.mark.parametrize("seed", range(3))
def test_engine_placement_writes_upstreams_bytes_with_no_more_syncs(upstream, seed,
                                                                    block_counts):
    """Either setting, every byte upstream's: the commit pass places the engine's
    device copy of the table rows as they are (``device_block_table``), so block counts
    change nothing on this placement."""
    steps = engine_steps(seed)
    expected = run_engine(upstream, steps, patched=False, seed=seed)
    actual = run_engine(upstream, steps, patched=True, seed=seed,
                        block_counts=block_counts)
    assert [e["what"] for e in expected] == [a["what"] for a in actual]
    assert any(s["paused"] for s in steps) and any(s["hits"].any() for s in steps)
    assert {s["graphed"] for s in steps} == {False, True}
    assert any((s["counts"] == 0).any() for s in steps)
    for index, (want, got) in enumerate(zip(expected, actual)):
        where = f"event {index} ({want['what']})"
        assert torch.equal(want["view"], got["view"]), f"{where}: view bytes differ"
        assert want["calls"] == got["calls"], where
        assert want["call"] == got["call"], f"{where}: {want['call']} != {got['call']}"
        assert want["mode"] == got["mode"], where
        assert got["cost"]["syncs"] <= want["cost"]["syncs"], (where, want, got)
    # Device data ops (ops the simulated device runs), over the whole run.
    assert 3 * sum(a["device_ops"] for a in actual) <= sum(e["device_ops"] for e in expected)


@counts_syncs
@pytest.mark.parametrize("seed", range(2))
def test_engine_placement_costs_per_helper(upstream, seed):
    """Commit pass: one sync (upstream's one) and 16 bytes per request read back, the
    table never; begin: no sync and no read-back; eager depth over requests: upstream's
    one sync (the longest KV length, which only the device knows); graphed depth:
    none. No allocation in the draft loop, nor in a commit pass after the first."""
    steps = engine_steps(seed)
    trace = run_engine(upstream, steps, patched=True, seed=seed)
    commits = [e for e in trace if e["what"] == "commit"]
    sizes = [s["total"] - s["paused"] for s in steps if int(s["counts"].sum())]
    assert commits and len(commits) == len(sizes)
    for event, size in zip(commits, sizes):
        assert event["cost"] == dict(syncs=1, reads=16 * size), event["cost"]
    # The packed read goes through the metadata's fixed device and pinned buffers,
    # made at its first commit pass: the passes after it allocate nothing.
    assert [e["allocations"] for e in commits[1:]] == [0] * (len(commits) - 1)
    begins = [e for e in trace if e["what"] == "begin"]
    assert all(e["cost"] == dict(syncs=0, reads=0) for e in begins)
    # The pinned table's active rows cross once, contiguous: nothing staged, nothing
    # sent twice, nothing from pageable memory.
    for event in begins:
        n = event["n"]
        assert event["copies"] == dict(h2d=int(n > 0), h2d_bytes=4 * n * W, staged=0,
                                       pageable=0), event["copies"]
        # The copies, then every planned depth at once (device_draft_plan): 7 ops (8
        # when an older loop's longer rows are zeroed), into fixed scratch.
        assert event["device_ops"] <= 8 and event["allocations"] == 0, event
    events = iter(trace)
    for step in steps:
        for event in events:
            if event["what"] == "begin":
                break
        for _ in range(step["depths"]):
            depth = next(events)
            eager = not step["graphed"] and step["total"] > step["paused"]
            # eager: the int32 longest KV length, read back into fixed buffers
            assert depth["cost"] == dict(syncs=int(eager), reads=4 * eager), depth["cost"]
            # A planned depth: one placement; eager, the bound's reduction besides,
            # into a fixed scalar: no allocation (upstream's .max() makes one).
            assert depth["device_ops"] == 1 + eager, depth["device_ops"]
            assert depth["allocations"] == 0, depth["allocations"]


def _one_commit(modules: Dict[str, Any], *, device_table: bool, total_offset: int = 0):
    """One commit pass of 5 requests behind a paused row (patched); its cost."""
    megatron.patch()
    sim = CudaSim(0)
    with sim:
        place = Placement(modules, sim, patched=True)
        context = place.context
        host = torch.arange(R * W, dtype=torch.int32).view(R, W)  # every block allocated
        if device_table:  # no host copy to take the rows from
            context.request_to_kv_block_ids = place.device(host)
        else:
            context.request_to_kv_block_ids.copy_(host)
        context.paused_request_count, context.total_request_count = 1, 6
        counts = place.device(torch.tensor([3, 2, 0, 1, 2]))
        starts = place.device(torch.tensor([0, 4, 2, 5, 1]))
        table = place.device(host[1:6])
        return place, place.counted(lambda: context._mtp_setup_prefill_step(
            counts, table, padded_token_count=10, request_start_positions=starts,
            total=8 + total_offset))


@counts_syncs
def test_a_device_context_table_travels_in_the_one_packed_read(upstream):
    """Outside upstream's placement (the context's table itself on the device) there
    is no host copy: the rows come back in the same single read."""
    _, cost = _one_commit(upstream, device_table=True)
    assert cost == dict(syncs=1, reads=16 * 5 + 8 * 5 * W)
    _, cost = _one_commit(upstream, device_table=False)
    assert cost == dict(syncs=1, reads=16 * 5)


def test_a_total_other_than_the_counts_sum_is_refused_before_any_write(upstream):
    with pytest.raises(ValueError, match=r"total: 9, expected the sum of append_counts 8"):
        _one_commit(upstream, device_table=False, total_offset=1)


def test_drafts_read_the_pre_rewind_table_when_the_engine_keeps_one(upstream):
    """An engine that snapshots its table before the speculative rewind keeps it as
    ``mtp_metadata.prerewind_block_table``; the drafts read it (the rewound table has
    -1 where the deepest drafts write), as the newer upstream helper does."""
    snapshot = torch.arange(R * W, dtype=torch.int32).view(R, W)
    rewound = snapshot.clone()
    rewound[:, 1:] = -1  # the blocks past the first were released

    def draft(context, table, keep=None):
        context.paused_request_count, context.total_request_count = 0, 2
        context.request_to_kv_block_ids.copy_(table)
        if keep is not None:
            context.mtp_metadata.prerewind_block_table = keep
        context._mtp_begin_decode(2, 2, torch.tensor([BS - 1, BS - 1]), graphed=False)
        for _ in range(2):  # the second depth writes column 1
            context._mtp_setup_decode_step()
            context.mtp_metadata.advance_decode_step()
        return context.gpu_view._buf.clone()

    expected = draft(make_context(upstream), snapshot)
    megatron.patch()
    for mirror in (False, True):
        assert torch.equal(draft(make_context(upstream, mirror=mirror), rewound, snapshot),
                           expected)


def test_meta_inputs_are_refused_with_a_value_error_naming_them(upstream):
    megatron.patch()
    context = make_context(upstream, mirror=True)
    context.paused_request_count, context.total_request_count = 0, 2
    counts = torch.ones(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="append_counts.*meta tensor"):
        context._mtp_setup_prefill_step(counts, context.request_to_kv_block_ids[:2],
                                        total=2)


def test_the_invariant_checks_hold_right_after_each_helper_on_this_placement(upstream,
                                                                           monkeypatch):
    """``check_invariants`` straight after every helper call, with the view's writes
    still queued on the simulated device: its reads go through the runtime's blocking
    ``to_host``, so they see those writes, and every KV-protecting invariant holds."""
    checked, record = [], Placement.record

    def checked_record(self, what, cost):
        self.context.mtp_metadata.check_invariants(self.context.gpu_view)
        checked.append(what)
        return record(self, what, cost)

    monkeypatch.setattr(Placement, "record", checked_record)
    for seed in range(2):
        run_engine(upstream, engine_steps(seed), patched=True, seed=seed)
    assert {"commit", "begin", "depth"} <= set(checked)
