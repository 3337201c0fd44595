"""A commit pass into a view larger than the mirror path's forward staging.

Failure story: the commit stage of a view is sized from the view's ``max_tokens`` and,
when that does not fit one staging slot, from what a slot holds. Building the view's
fields over the landing zone before that size is known breaks on any view of at least
twice ``allocate``'s ``max_tokens``: a production view of 32k tokens could not run a
commit pass. Here views from 1x to 8x the staging's tokens, in both view layouts (one
packed buffer, ten separate tensors), run commit passes of every size up to the view's
and each is checked field by field against the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpmeta import MTPMetadata, VIEW_FIELDS
from mtpmeta.reference import ReferenceMTPMetadata
from tests.helpers import config, make_view

STAGING_TOKENS = 16  # allocate()'s max_tokens
R, W, BS = 8, 6, 4   # config(): up to R * W * BS = 192 positions per pass


def _passes(view_tokens: int, seed: int):
    """Random commit passes ``(append_counts, block_table, start_positions)`` of ``R``
    requests whose totals reach the view's whole token range, the largest first."""
    rng = np.random.default_rng(seed)
    for total in (view_tokens, int(rng.integers(R, view_tokens + 1)),
                  min(view_tokens, STAGING_TOKENS + 1)):
        counts = 1 + rng.multinomial(total - R, [1 / R] * R)
        while counts.max() > W * BS:  # keep every request inside its table row
            counts[counts.argmax()] -= 1
            counts[counts.argmin()] += 1
        starts = np.array([rng.integers(0, W * BS - c + 1) for c in counts])
        table = torch.tensor(rng.integers(0, 50, (R, W)), dtype=torch.int32)
        yield (torch.tensor(counts, dtype=torch.int32), table,
               torch.tensor(starts, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["context", "namespace"])
@pytest.mark.parametrize("factor", range(1, 9))
def test_commit_pass_on_views_up_to_8x_the_staging_matches_the_reference(layout, factor):
    view_tokens = STAGING_TOKENS * factor
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=True, max_tokens=STAGING_TOKENS)
    ref = ReferenceMTPMetadata(**config())
    ref.allocate("cpu")
    view = make_view(layout, R, view_tokens, W)
    ref_view = make_view("reference", R, view_tokens, W)
    ran = 0
    for counts, table, starts in _passes(view_tokens, seed=factor):
        got = meta.setup_commit_pass(view, counts, table, start_positions=starts,
                                     padded_token_count=view_tokens)
        want = ref.setup_commit_pass(ref_view, counts, table, start_positions=starts,
                                     padded_token_count=view_tokens)
        assert got == want
        for f in VIEW_FIELDS:
            assert torch.equal(getattr(view, f.name), getattr(ref_view, f.name)), f.name
        ran += 1
    assert ran == 3


@pytest.mark.parametrize("view_tokens", [32768, 65536])
def test_production_size_view_runs_a_commit_pass_with_the_default_staging(view_tokens):
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=True)  # max_tokens 16384
    ref = ReferenceMTPMetadata(**config())
    ref.allocate("cpu")
    view = make_view("context", R, view_tokens, W)
    ref_view = make_view("reference", R, view_tokens, W)
    args = (torch.tensor([3, 2], dtype=torch.int32), torch.zeros((R, W), dtype=torch.int32))
    assert meta.setup_commit_pass(view, *args, padded_token_count=8) == \
        ref.setup_commit_pass(ref_view, *args, padded_token_count=8)
    for f in VIEW_FIELDS:
        assert torch.equal(getattr(view, f.name), getattr(ref_view, f.name)), f.name
