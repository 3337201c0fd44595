"""Where the patched commit pass finds each row's prefix hit, in both of upstream's
engines.

Failure story: the engine the helpers were first written against keeps
``request_matched_prefix_blocks`` on its context, and its mixin redirects inherited
blocks by that array; the newer engine keeps it on ``mtp_metadata`` alone, and its
mixin reads it there. A patched helper that reads only the context's array fails on
the newer engine (no such attribute); one that reads only the metadata's misses the
older engine's hits and rewrites shared prefix blocks; and one that leaves the
metadata's array at zeros on the older engine makes ``check_invariants`` (run after
every call under ``MTPMETA_DEBUG=1``) report a prefix block sent to the dummy block as
the request's own KV lost. Each engine is run unpatched and patched over seeded steps
with prefix hits, the patched run checked after every view-writing call, and every byte
must agree.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from mtpmeta.integrations import megatron
from tests import standin_megatron
from tests.test_megatron_integration import upstream  # noqa: F401 (the fixture)
from tests.test_megatron_integration import (BS, D, GRAPH_MAX_SEQLEN, MAX_TOKENS, R, W,
                                             assert_same_trace, random_steps, run)


def _context_class(modules: Dict[str, Any]) -> Any:
    return modules[f"{standin_megatron.PACKAGE}.dynamic_context"].StandInContext


def _own_hits_context(modules: Dict[str, Any]) -> Any:
    """The older engine: the context keeps the hits in its own array, apart from the
    metadata's (which the engine never writes)."""
    base = _context_class(modules)

    class OwnHitsContext(base):
        request_matched_prefix_blocks = property(lambda self: self.own_hits)

        def __init__(self) -> None:
            super().__init__(R, W, BS, D, MAX_TOKENS, GRAPH_MAX_SEQLEN)
            self.own_hits = torch.zeros(R, dtype=torch.int32)

    return OwnHitsContext()


def _metadata_hits_context(modules: Dict[str, Any]) -> Any:
    """The newer engine: no ``request_matched_prefix_blocks`` on the context."""
    base = _context_class(modules)

    def absent(self: Any) -> Any:
        raise AttributeError("request_matched_prefix_blocks")

    class MetadataHitsContext(base):
        request_matched_prefix_blocks = property(absent)

        def __init__(self) -> None:
            super().__init__(R, W, BS, D, MAX_TOKENS, GRAPH_MAX_SEQLEN)

    return MetadataHitsContext()


def _steps(seed: int):
    steps = random_steps(seed)
    assert any(step["hits"][step["paused"]:step["total"]].any() for step in steps)
    return steps


@pytest.mark.parametrize("seed", range(3))
def test_the_context_s_own_hits_redirect_the_commit_pass(upstream, seed):
    steps = _steps(seed)
    reference = _own_hits_context(upstream)
    expected = run(reference, steps, hits=reference.own_hits)
    megatron.patch(block_counts=False)
    context = _own_hits_context(upstream)
    context.mtp_metadata.allocate("cpu", mirror=True)
    actual = run(context, steps, check=True, hits=context.own_hits)
    assert_same_trace(expected, actual)
    # the last pass's hits, copied where the checks and the draft loop read them
    assert torch.equal(context.mtp_metadata.request_matched_prefix_blocks,
                       context.own_hits)


def test_int64_hits_in_range_are_copied_too(upstream):
    """The older engine's hits as int64: copied into the metadata's int32 array when
    every count lies in ``[0, W]`` (exact), so the checks read them as well."""
    steps = _steps(0)
    reference = _own_hits_context(upstream)
    reference.own_hits = reference.own_hits.to(torch.int64)
    expected = run(reference, steps, hits=reference.own_hits)
    megatron.patch(block_counts=False)
    context = _own_hits_context(upstream)
    context.own_hits = context.own_hits.to(torch.int64)
    context.mtp_metadata.allocate("cpu", mirror=True)
    assert_same_trace(expected, run(context, steps, check=True, hits=context.own_hits))
    assert torch.equal(context.mtp_metadata.request_matched_prefix_blocks,
                       context.own_hits.to(torch.int32))


def test_int64_hits_out_of_range_are_refused_not_wrapped(upstream):
    """An int64 count of ``2**32 + 1`` would wrap to 1 in the metadata's int32 array and
    redirect one block: it is passed as it is instead, and the commit pass refuses it,
    naming ``inherited_blocks`` and the count, with nothing written."""
    megatron.patch(block_counts=False)
    context = _own_hits_context(upstream)
    context.own_hits = context.own_hits.to(torch.int64)
    context.mtp_metadata.allocate("cpu", mirror=True)
    step = _steps(0)[0]
    context.paused_request_count, context.total_request_count = 0, step["total"]
    context.request_to_kv_block_ids.copy_(step["table"])
    context.own_hits[0] = 2 ** 32 + 1
    view = context.gpu_view.token_to_block_idx.clone()
    with pytest.raises(ValueError, match="inherited_blocks: request 0 inherits 4294967297"):
        context._mtp_setup_prefill_step(
            step["counts"][:step["total"]], context.request_to_kv_block_ids[:step["total"]],
            padded_token_count=step["padded_tokens"],
            padded_request_count=step["padded_requests"],
            request_start_positions=step["starts"][:step["total"]])
    assert torch.equal(context.gpu_view.token_to_block_idx, view)
    assert not context.mtp_metadata.request_matched_prefix_blocks.any()


@pytest.mark.parametrize("seed", range(3))
def test_without_the_context_s_array_the_metadata_s_hits_redirect(upstream, seed):
    """Upstream's newer mixin reads the metadata's array; the stand-in context's
    property hands its helpers that very array, so it plays the newer engine's
    reference."""
    steps = _steps(seed)
    expected = run(_context_class(upstream)(R, W, BS, D, MAX_TOKENS, GRAPH_MAX_SEQLEN),
                   steps)
    megatron.patch(block_counts=False)
    context = _metadata_hits_context(upstream)
    context.mtp_metadata.allocate("cpu", mirror=True)
    assert not hasattr(context, "request_matched_prefix_blocks")
    assert_same_trace(expected, run(context, steps, check=True))
