"""Differential tests over whole steps and scheduler-like sequences.

Draft loops (begin_decode / begin_decode_for_capture, several setup_decode_step +
advance_decode_step, end_forward), fused commit passes (setup_commit_pass with and
without start positions, inherited blocks and padding), and a centrepiece that
interleaves every operation for 20-40 calls per example. After every call the library
(``path`` fixture) and the pure-torch reference must agree exactly (``DifferentialPair``).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, given, settings

from mtpmeta import ForwardModeError
from tests.helpers import VIEW
from tests.test_differential import (
    OWN_ANNOTATIONS,
    SETTINGS,
    Geometry,
    annotate,
    edge_count,
    geometries,
    hidden,
    int_list,
    ints,
    mha_args,
    move_indices,
    new_pair,
    prefill_args,
    reset_index,
    swap_indices,
    table,
    token_map_args,
)

quick = settings(max_examples=40, **SETTINGS)


# ------------------------------------------------------------------ step strategies
@st.composite
def draft_inputs(draw, g: Geometry, *, cross: bool = False):
    """begin_decode arguments plus a depth count whose every setup stays in the table.

    Starts are often one short of a block boundary (``c * BS - 1``) so the next
    ``advance_decode_step`` steps into a new block column; ``cross`` forces that on
    request 0 with at least two depths.
    """
    depths = draw(st.integers(2 if cross else 1, 4))
    n = draw(edge_count(1 if cross else 0, g.R))
    limit = g.span - depths  # start + depths - 1 is the last position a setup reads
    boundary = st.integers(1, max(1, (limit + 1) // g.BS)).map(lambda c: c * g.BS - 1)
    extra = draw(st.integers(0, g.R - n))
    starts = [draw(boundary) if b else s for b, s in zip(
        draw(st.lists(st.booleans(), min_size=n + extra, max_size=n + extra))
        if n + extra <= 32 else [False] * (n + extra), draw(int_list(n + extra, 0, limit)))]
    if cross:
        starts[0] = draw(boundary)
    crossing = any(s // g.BS != (s + depths - 1) // g.BS for s in starts[:n])
    event(f"draft: block-boundary crossing={crossing}")
    padded = draw(edge_count(n, g.R))
    event(f"draft: request padding={padded > n}")
    rows = n + draw(st.integers(0, g.R - n))
    return dict(n=n, padded=padded, starts=draw(ints(starts)), table=draw(table(g, rows)),
                graphed=draw(st.booleans()), depths=depths)


@st.composite
def commit_inputs(draw, g: Geometry, *, P=None, pad=None, starts=None, inherited=None,
                  cross=False, request_padding=None):
    """setup_commit_pass arguments; keyword constraints force the named edge case.

    pad: True forces padded_token_count > T, False forces None or T. request_padding:
    True forces padded_request_count > P. cross: request 0's span crosses a block.
    inherited: True forces inherited_blocks (own annotations or an explicit array).
    """
    P = draw(edge_count(1 if cross else 0, g.R)) if P is None else P
    use_starts = draw(st.booleans()) if starts is None else starts
    first = [draw(st.integers(0, g.span - 1)) if use_starts else 0 for _ in range(P)]
    counts = [draw(st.integers(0, g.span - s)) for s in first]
    if cross:  # column c, offset l: at least one token past the block's end
        c, l = draw(st.integers(0, g.W - 2)), draw(st.integers(0, g.BS - 1))
        first[0] = c * g.BS + l if use_starts else 0
        counts[0] = draw(st.integers(g.BS - first[0] % g.BS + 1, g.span - first[0]))
    T = sum(counts)
    kwargs = {}
    if use_starts:
        kwargs["start_positions"] = draw(ints(first + draw(int_list(
            draw(st.integers(0, g.R - P)), 0, g.span - 1))))
    want_inherited = draw(st.booleans()) if inherited is None else inherited
    if want_inherited:
        length = P + draw(st.integers(0, g.R - P))
        kwargs["inherited_blocks"] = draw(st.one_of(st.just(OWN_ANNOTATIONS), ints(
            draw(int_list(length, 0, g.W)))))
    want_pad = draw(st.booleans()) if pad is None else pad
    if want_pad:
        kwargs["padded_token_count"] = T + draw(st.sampled_from(
            [1, draw(st.integers(1, 2 * g.BS)), g.max_tokens - T]))
    elif draw(st.booleans()):
        kwargs["padded_token_count"] = T
    want_rpad = draw(st.booleans()) if request_padding is None else request_padding
    if want_rpad and P < g.R:
        kwargs["padded_request_count"] = draw(st.integers(P + 1, g.R))
    elif draw(st.booleans()):
        kwargs["padded_request_count"] = P
    pad_tokens = kwargs.get("padded_token_count", T) - T
    event("commit: " + ("no pad" if not pad_tokens else
                        "spare-slot absorption" if P < g.R else "full-batch absorption"))
    event(f"commit: request padding={kwargs.get('padded_request_count', P) > P}, "
          f"inherited={want_inherited}, starts={use_starts}")
    tab = draw(table(g, P + draw(st.integers(0, 2))))
    counts_arg = draw(ints(counts))
    return counts_arg, tab, kwargs


def draft_loop(pair, data, g: Geometry, *, capture=False, cross=False) -> None:
    """begin (or capture) -> depths x (setup_decode_step, advance) -> end_forward."""
    if capture:
        pair.call("begin_decode_for_capture", data.draw(st.integers(0, g.R),
                                                        label="capture padded"))
        depths = data.draw(st.integers(1, 3), label="depths")
    else:
        args = data.draw(draft_inputs(g, cross=cross), label="draft")
        pair.call("begin_decode", args["n"], args["padded"], args["starts"],
                  args["table"], args["graphed"])
        depths = args["depths"]
    for _ in range(depths):
        pair.call("setup_decode_step", VIEW)
        pair.call("advance_decode_step")
    if data.draw(st.booleans(), label="stage lengths directly"):
        pair.call("stage_decode_lengths")
    pair.call("end_forward")


def commit(pair, data, g: Geometry, **constraints) -> None:
    counts, tab, kwargs = data.draw(commit_inputs(g, **constraints), label="commit")
    pair.call("setup_commit_pass", VIEW, counts, tab, **kwargs)


# ------------------------------------------------------------------ loop/pass tests
@quick
@given(data=st.data())
def test_draft_loops_match_reference_across_block_boundaries(path, data):
    """Every depth of a draft loop (graphed or not, with request padding) writes the
    same token maps, MHA metadata and launch shape as the reference, including the depth
    whose advanced offset steps into the next block column: a stale column there would
    write the draft KV into the previous block."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    for _ in range(data.draw(st.integers(1, 3), label="loops")):
        draft_loop(pair, data, g, cross=True)
        draft_loop(pair, data, g, capture=data.draw(st.booleans(), label="capture"))


@quick
@given(data=st.data())
def test_commit_pass_with_token_and_request_padding_matches_reference(path, data):
    """Token padding (padded_token_count > T) and request padding (padded_request_count
    > P) together: pad tokens must reach the dummy block and pad slots must get zero
    lengths, flat cu entries and -1 rows, exactly as the reference writes them."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    annotate(pair, data, g)
    commit(pair, data, g, P=data.draw(st.integers(0, g.R - 1)), pad=True,
           request_padding=True)


@quick
@given(data=st.data())
def test_spare_slot_pad_absorption_matches_reference(path, data):
    """P < R with pad > 0: the pad rows get their own trailing request (P + 1 slots,
    block row all dummy). If the spare slot were skipped, varlen attention would see
    fewer cu rows than query rows."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    commit(pair, data, g, P=data.draw(st.integers(0, g.R - 1)), pad=True)


@quick
@given(data=st.data())
def test_full_batch_pad_absorption_matches_reference(path, data):
    """P == R with pad > 0: no spare slot, so the last real request grows by the pad. A
    P + 1-th slot here would index past the request arrays."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    commit(pair, data, g, P=g.R, pad=True)


@quick
@given(data=st.data())
def test_inherited_blocks_redirect_and_block_crossing_spans_match_reference(path, data):
    """A commit span that crosses a block boundary, with inherited blocks redirected to
    the dummy: the tokens before the inherited bound must go to D and the ones after to
    the table, or a shared, ref-counted prefix block gets rewritten."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    annotate(pair, data, g)
    commit(pair, data, g, inherited=True, cross=True)
    commit(pair, data, g, inherited=True, starts=data.draw(st.booleans()))


@quick
@given(data=st.data())
def test_empty_forwards_match_reference(path, data):
    """A forward with no real request (n = 0 or P = 0), padded or not, still writes
    ``cu[0] = 0`` and its pad slots (SPEC 7). A writer that skips the MHA write when
    there is nothing to launch leaves whatever the previous forward left in the cu head,
    and the next padded launch reads it as its first offset."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    padded = data.draw(edge_count(0, g.R), label="padded")
    kind = data.draw(st.sampled_from(["mha", "commit", "decode", "capture"]), label="kind")
    event(f"empty forward: {kind}, padded={padded > 0}")
    empty = data.draw(ints([]), label="empty")
    if kind == "mha":
        pair.call("write_mha_metadata", VIEW, empty, empty, data.draw(table(g, 0)), padded)
    elif kind == "commit":
        pad = data.draw(st.sampled_from([0, 0, 3]), label="pad tokens")
        pair.call("setup_commit_pass", VIEW, empty, data.draw(table(g, 0)),
                  padded_token_count=pad, padded_request_count=padded)
    else:
        if kind == "decode":
            pair.call("begin_decode", 0, padded, empty, data.draw(table(g, 0)),
                      data.draw(st.booleans()))
        else:
            pair.call("begin_decode_for_capture", padded)
        pair.call("setup_decode_step", VIEW)
        pair.call("end_forward")


# -------------------------------------------------------------- scheduler sequences
OPS = ("annotate", "reset", "move", "swap", "carry", "take", "invalidate", "draft loop",
       "begin", "capture", "setup decode", "advance", "stage decode", "end", "commit",
       "stage prefill", "token maps", "mha", "cycle")


def run_sequence(pair, data, g: Geometry, num_ops: int) -> None:
    """Random valid scheduler-like operations; every call is checked by ``pair``."""
    keys = None
    for _ in range(num_ops):
        op = data.draw(st.sampled_from(OPS), label="op")
        lib = pair.lib
        if op == "annotate":
            annotate(pair, data, g)
        elif op == "reset":
            pair.call("reset_request_rows", data.draw(reset_index(g.R), label="rows"))
        elif op in ("move", "swap"):
            indices = (move_indices if op == "move" else swap_indices)(g.R)
            pair.call(f"{op}_request_rows", *data.draw(indices, label="src, dst"))
        elif op == "carry":
            keys = (data.draw(st.integers(0, 9)), data.draw(st.integers(0, 50)))
            pair.call("carry_chunk_boundary", data.draw(hidden(g), label="hidden"), *keys)
        elif op == "take" and keys is not None and data.draw(st.booleans()):
            pair.call("take_chunk_boundary", *keys)
        elif op == "take":
            req, seam = keys if keys is not None else (0, 0)
            pair.call("take_chunk_boundary", req + 1, seam, raises=AssertionError)
        elif op == "invalidate":
            keys = None
            pair.call("invalidate_chunk_boundary")
        elif op == "draft loop":
            draft_loop(pair, data, g, capture=data.draw(st.booleans(), label="capture"))
        elif op == "begin":
            args = data.draw(draft_inputs(g), label="draft")
            pair.call("begin_decode", args["n"], args["padded"], args["starts"],
                      args["table"], args["graphed"])
        elif op == "capture":
            pair.call("begin_decode_for_capture", data.draw(st.integers(0, g.R)))
        elif op == "setup decode":
            n = lib.active_request_count
            if lib.forward_mode.name == "DRAFT" and (
                    n == 0 or int(lib.offsets[:n].max()) // g.BS < g.W):
                pair.call("setup_decode_step", VIEW)
        elif op in ("advance", "stage decode"):
            method = "advance_decode_step" if op == "advance" else "stage_decode_lengths"
            if lib.forward_mode.name == "DRAFT":
                pair.call(method)
            elif lib.active_offsets is not None:
                # Upstream runs them after the loop ended; mtpmeta refuses, changing
                # nothing: the library side must still equal the reference's state.
                with pytest.raises(ForwardModeError, match=f"{method}: forward_mode"):
                    getattr(lib, method)()
                pair.check(f"{method} refused outside DRAFT")
        elif op == "end":
            pair.call("end_forward")
        elif op == "commit":
            commit(pair, data, g)
        elif op == "stage prefill":
            pair.call("stage_prefill_lengths", *data.draw(prefill_args(g), label="prefill"))
        elif op == "token maps":
            pair.call("write_token_maps", VIEW, *data.draw(token_map_args(g), label="maps"))
        elif op == "mha":
            pair.call("write_mha_metadata", VIEW, *data.draw(mha_args(g), label="mha"))
        else:  # suspend/resume mid-sequence
            keys = None
            pair.reallocate()


@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_interleaved_scheduler_sequences_match_reference(path, data):
    """The centrepiece: 20-40 interleaved row ops, carries, draft loops (and loose draft
    calls), commit passes, direct writer calls and suspend/resume cycles. State carried
    from one operation into the next (offsets advanced past a commit pass, a carry that
    survives row moves, query_lengths shared by decode and prefill staging) must evolve
    identically on both sides; a divergence is reported at the first call showing it."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    run_sequence(pair, data, g, data.draw(st.integers(20, 40), label="ops"))


@quick
@given(data=st.data())
def test_suspend_resume_mid_sequence_gives_fresh_state_on_both_sides(path, data):
    """deallocate + allocate after a random prefix of work: both sides come back with
    zeroed buffers, mode NONE, no carry and no active views (a fresh object), then keep
    agreeing. A resume that kept a stale carry or offsets would replay a dead request."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    run_sequence(pair, data, g, data.draw(st.integers(3, 10), label="ops before"))
    pair.reallocate()
    run_sequence(pair, data, g, data.draw(st.integers(3, 10), label="ops after"))


@settings(max_examples=6, **SETTINGS)
@given(data=st.data())
def test_interleaved_sequences_match_reference_at_a_larger_geometry(path, data):
    """The same sequences at a production-like size (64 requests, 32 block columns of
    16 tokens, int64 tables, a 32k-token view): catches any size-dependent path the
    small geometries never reach (staging sized from defaults, cached plans, chunked
    loops), where a forward would silently be cut short or rejected."""
    g = Geometry(R=64, W=32, BS=16, table_dtype=torch.int64, H=64)
    pair = new_pair(data, path, g)
    run_sequence(pair, data, g, data.draw(st.integers(8, 16), label="ops"))
