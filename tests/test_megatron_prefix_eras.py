"""Where the patched commit pass finds each row's prefix hit, in both of upstream's
engines.

Failure story: the engine the helpers were first written against keeps
``request_matched_prefix_blocks`` on its context, and its mixin redirects inherited
blocks by that array; the newer engine keeps it on ``mtp_metadata`` alone, and its
mixin reads it there. A patched helper that reads only the context's array fails on
the newer engine (no such attribute); one that reads only the metadata's misses the
older engine's hits and rewrites shared prefix blocks. Each engine is run unpatched
and patched over seeded steps with prefix hits, and every byte must agree.
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
    metadata's (left at zeros, so reading it would redirect nothing)."""
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
    actual = run(context, steps, hits=context.own_hits)
    assert not context.mtp_metadata.request_matched_prefix_blocks.any()
    assert_same_trace(expected, actual)


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
    assert_same_trace(expected, run(context, steps))
