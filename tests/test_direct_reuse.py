"""The direct path's per-call work reuses what it owns: a commit pass with the opt-in
block counts allocates no per-row buffer of its own (``DirectBackend._known``), and a
destination view holding more requests than ``max_requests`` grows it once, with the
view still equal to the reference's on the masked table; a draft depth calls the
compiled entry point pinned to its own view's field types."""

from __future__ import annotations

import numpy as np
import torch

from mtpmeta import ContextGPUView
import mtpmeta.direct.backend as direct
from mtpmeta.kernels import native
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata
from tests.helpers import assert_views_equal
from tests.test_block_counts import (BS, KWARGS, R, TOKENS, W, build,
                                     full_batch_inputs, masked)


class _CountingNumpy:
    """numpy as ``mtpmeta.direct.backend`` sees it, counting the arrays it allocates."""

    def __init__(self) -> None:
        self.allocations = 0

    def __getattr__(self, name):
        value = getattr(np, name)
        if name in ("zeros", "empty", "full", "array", "zeros_like", "empty_like"):
            def counted(*args, **kwargs):
                self.allocations += 1
                return value(*args, **kwargs)
            return counted
        return value


def _counted_commit(meta, view, inputs, padded_requests=None):
    spans, starts, table, counts, inherited, padded_tokens, prequests = inputs
    t = torch.from_numpy
    return meta.setup_commit_pass(
        view, t(spans), t(table), start_positions=t(starts), inherited_blocks=t(inherited),
        padded_token_count=padded_tokens,
        padded_request_count=prequests if padded_requests is None else padded_requests,
        block_counts=t(counts))


def test_a_counted_commit_allocates_no_buffer_per_call(monkeypatch):
    """A counted commit's ``known`` record is one buffer of the backend. Failure story: a
    record allocated anew per call (one ``np.zeros``) costs every commit pass."""
    meta, view, _ = build("direct")
    _counted_commit(meta, view, full_batch_inputs())
    meta.end_forward()
    counting = _CountingNumpy()
    monkeypatch.setattr(direct, "np", counting)
    for _ in range(3):
        _counted_commit(meta, view, full_batch_inputs())
        meta.end_forward()
    assert counting.allocations == 0


def test_a_view_wider_than_max_requests_grows_the_buffer_once():
    """``padded_request_count`` past ``R`` (a view with ``3 R`` request slots): the
    buffer grows to hold every padded row, and rows past the batch are -1 as the
    reference writes them."""
    meta, _, _ = build("direct")
    view = ContextGPUView(3 * R, TOKENS, W, "cpu")
    ref = ReferenceMTPMetadata(**KWARGS)
    ref.allocate("cpu")
    ref_view = ReferenceGPUView(3 * R, TOKENS, W, "cpu")
    inputs = full_batch_inputs()
    spans, starts, table, counts, inherited, padded_tokens, _ = inputs
    padded = 2 * R + 3
    for _ in range(2):  # the second pass reuses the grown buffer
        _counted_commit(meta, view, inputs, padded_requests=padded)
        meta.end_forward()
        t = torch.from_numpy
        ref.setup_commit_pass(ref_view, t(spans), t(masked(table, counts)),
                              start_positions=t(starts), inherited_blocks=t(inherited),
                              padded_token_count=padded_tokens,
                              padded_request_count=padded)
        ref.end_forward()
        assert_views_equal(view, ref_view)
    assert meta._backend._known.shape[0] > padded


def test_each_view_gets_the_entry_point_of_its_own_field_types():
    """A draft depth calls the compiled entry point of its view's field types, never
    the dispatcher's typing (``mtpmeta.kernels.entry.pinned_entry``): depths alternating between a
    view of the default dtypes and one whose block fields are rebound to int64, and a
    field rebound mid-loop, each equal the reference's view. Failure story: one entry
    point kept for every view would unbox an int64 field as int32 (wrong ids or worse)."""
    meta, view, _ = build("direct")
    wide = ContextGPUView(R, TOKENS, W, "cpu")
    ref = ReferenceMTPMetadata(**KWARGS)
    ref.allocate("cpu")
    ref_view = ReferenceGPUView(R, TOKENS, W, "cpu")
    rng = np.random.default_rng(5)
    starts = torch.from_numpy(rng.integers(0, W * BS - 4, size=R).astype(np.int32))
    table = torch.from_numpy(rng.permutation(R * W).reshape(R, W).astype(np.int32))
    for name in ("token_to_block_idx", "mha_block_table"):
        setattr(wide, name, getattr(wide, name).to(torch.int64))
    meta.begin_decode(R - 1, R, starts, table, False)
    ref.begin_decode(R - 1, R, starts, table, False)
    for depth, target in enumerate((view, wide, view, wide)):
        if depth == 2:  # a rebound field: the view resolves anew, with new types
            view.token_to_block_idx = view.token_to_block_idx.to(torch.int64)
        meta.setup_decode_step(target)
        ref.setup_decode_step(ref_view)
        assert_views_equal(target, ref_view)
        meta.advance_decode_step()
        ref.advance_decode_step()
    jitted = hasattr(native.staging.decode_step, "compile")  # not NUMBA_DISABLE_JIT=1
    assert (meta._backend._decode_tail[2] is not native.staging.decode_step) == jitted
