"""``patch()``'s block counts: the commit pass takes the context's
``request_kv_block_counts`` by default, the draft loop never.

Failure story: with counts the host reads and ships only the blocks in use, and the
view holds the dummy block where upstream copies ``-1`` past a row's count; a helper
that passed the counts where upstream's engine writes past them (the draft loop's
deeper depths, into blocks the speculative rewind released) would refuse a step
upstream runs, and one that lost ``patch(block_counts=False)`` could no longer give
upstream's exact bytes. So both settings run seeded steps against the stand-in
engine, and a draft past the count runs as upstream runs it.
"""

from __future__ import annotations

import pytest
import torch

from mtpmeta.integrations import megatron
from tests.test_megatron_engine_placement import same_but_dummy_past_counts
from tests.test_megatron_integration import upstream  # noqa: F401 (the fixture)
from tests.test_megatron_integration import (BS, R, W, assert_same_trace, make_context,
                                             random_steps, run)


@pytest.mark.parametrize("mirror", [False, True], ids=["direct", "mirror"])
@pytest.mark.parametrize("block_counts", [False, True], ids=["exact", "counts"])
def test_block_counts_differ_only_by_the_dummy_block_past_a_rows_count(upstream, mirror,
                                                                       block_counts):
    """Host inputs: ``patch(block_counts=False)`` is byte-exact; ``patch()`` passes the
    context's ``request_kv_block_counts`` to the commit pass and differs only where
    upstream copies a ``-1`` past a row's count into ``mha_block_table``: ``D`` there,
    until a draft depth rewrites those rows."""
    steps = random_steps(30, count=6)
    expected = run(make_context(upstream), steps)
    if block_counts:
        megatron.patch()
    else:
        megatron.patch(block_counts=False)
    context = make_context(upstream, mirror=mirror)
    actual = run(context, steps, check=True)
    differing = [same_but_dummy_past_counts(want, got, context.gpu_view)
                 for want, got in zip(expected, actual)]
    assert (sum(differing) > 0) == block_counts
    assert_same_trace(expected, actual)


def test_the_draft_loop_takes_no_counts_because_drafts_write_past_them(upstream):
    """A draft writes past the committed tokens into a block the speculative rewind
    released (the count dropped; the pre-rewind table still names the block). Upstream
    writes it, and so does ``patch()``'s default: its block counts reach the commit
    pass only; a count-limited draft depth (``begin_decode(block_counts=...)``) would
    refuse it."""
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    counts = torch.full((R,), 1, dtype=torch.int32)  # one block kept, the rest released

    def draft(context):
        context.paused_request_count, context.total_request_count = 0, 2
        context.request_to_kv_block_ids.copy_(table)
        context.block_counts_override = counts
        context._mtp_begin_decode(2, 2, torch.tensor([BS - 1, BS - 1]), graphed=False)
        context._mtp_setup_decode_step()
        context.mtp_metadata.advance_decode_step()
        context._mtp_setup_decode_step()  # position BS: column 1, past the count
        return context.gpu_view._buf.clone()

    expected = draft(make_context(upstream))
    megatron.patch()
    assert torch.equal(draft(make_context(upstream, mirror=True)), expected)
    context = make_context(upstream, mirror=True)
    context.request_to_kv_block_ids.copy_(table)
    context.mtp_metadata.set_request_rows(0, 2)
    context.mtp_metadata.begin_decode(2, 2, torch.tensor([BS - 1, BS - 1]),
                                      context.request_to_kv_block_ids, False,
                                      block_counts=counts)
    context.mtp_metadata.setup_decode_step(context.gpu_view)
    context.mtp_metadata.advance_decode_step()
    with pytest.raises(ValueError, match="block_counts"):
        context.mtp_metadata.setup_decode_step(context.gpu_view)


def test_patch_refuses_a_block_counts_that_is_not_a_bool(upstream):
    with pytest.raises(TypeError, match="block_counts"):
        megatron.patch(block_counts=1)
    assert not megatron.is_patched()


def test_a_second_patch_sets_block_counts_and_unpatch_restores_the_default(upstream):
    """Block counts on, then off by a second ``patch``: the commit pass's table rows
    then hold upstream's ``-1`` past the count again; after ``unpatch`` the default
    is back."""
    step = dict(random_steps(30, count=1)[0], depths=0)  # the commit's rows stay

    def commit_table(context):
        run(context, [step])
        start, stop = context.gpu_view.spans["mha_block_table"]
        return context.gpu_view._buf[start:stop].view(torch.int32)

    expected = commit_table(make_context(upstream))
    megatron.patch()
    assert not torch.equal(commit_table(make_context(upstream, mirror=True)), expected)
    megatron.patch(block_counts=False)
    assert torch.equal(commit_table(make_context(upstream, mirror=True)), expected)
    megatron.unpatch()
    megatron.patch()
    assert not torch.equal(commit_table(make_context(upstream, mirror=True)), expected)
