"""Differential tests, one operation at a time: library vs pure-torch reference.

Every test drives ``MTPMetadata`` (on the ``path`` fixture: direct or mirror) and
``ReferenceMTPMetadata`` with identical, freshly built inputs and demands exact equality
of results, of the ten destination-view fields, of every persistent buffer and of the
scalar state after every call (``DifferentialPair``). The input strategies live here and
are reused by the sequence tests in ``test_differential_steps.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings

from tests.helpers import VIEW, Arg, DifferentialPair, Own

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
quick = settings(max_examples=40, **SETTINGS)
OWN_ANNOTATIONS = Own("request_matched_prefix_blocks")


# ------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Geometry:
    R: int  # max_requests
    W: int  # max_kv_block_count (and the view's block-table width)
    BS: int  # block_size_tokens
    table_dtype: torch.dtype
    D: int = 997  # dummy block: outside the drawn block ids, so a redirect shows
    H: int = 8  # hidden_size

    @property
    def span(self) -> int:
        """Positions one request can address: ``W * BS``."""
        return self.W * self.BS

    @property
    def max_tokens(self) -> int:
        """View token capacity: every request's whole span fits, plus pad room."""
        return self.R * self.span + 8

    def pair(self, path: str, junk_seed: int = 0, **overrides) -> DifferentialPair:
        kwargs = dict(max_requests=self.R, max_kv_block_count=self.W,
                      block_size_tokens=self.BS, dummy_block_idx=self.D,
                      block_table_dtype=self.table_dtype, hidden_size=self.H)
        kwargs.update(overrides)
        return DifferentialPair(path, max_tokens=self.max_tokens, junk_seed=junk_seed,
                                **kwargs)


geometries = st.builds(Geometry, R=st.integers(4, 8), W=st.integers(4, 6),
                       BS=st.integers(2, 4),
                       table_dtype=st.sampled_from([torch.int32, torch.int64]))


def new_pair(data, path: str, g: Geometry = None, **overrides) -> DifferentialPair:
    g = data.draw(geometries, label="geometry") if g is None else g
    return g.pair(path, data.draw(st.integers(0, 2**16), label="junk_seed"), **overrides)


# ------------------------------------------------------------------------ input forms
LAYOUTS = ("dense", "strided", "offset", "transposed")
INT_FORMS = st.one_of(st.just(("list", "int64", "dense")), st.tuples(
    st.sampled_from(["numpy", "torch"]), st.sampled_from(["int32", "int64"]),
    st.sampled_from(LAYOUTS)))


@st.composite
def ints(draw, values, shape=None):
    """``values`` as a list, numpy array or tensor, int32 or int64, in any layout."""
    return Arg(list(values), *draw(INT_FORMS), shape=shape)


def edge_count(low: int, high: int):
    """A count in ``[low, high]`` that is often exactly ``low`` or ``high``."""
    return st.one_of(st.sampled_from([low, high]), st.integers(low, high))


@st.composite
def int_list(draw, size: int, low: int, high: int):
    """``size`` ints in ``[low, high]``: drawn one by one when few (they shrink), else
    from a seeded generator (keeps hypothesis' buffer small at the larger geometry)."""
    if size <= 32:
        return draw(st.lists(st.integers(low, high), min_size=size, max_size=size))
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(
        low, high + 1, size).tolist()


@st.composite
def table(draw, g: Geometry, rows: int, width: int = None):
    width = g.W if width is None else width
    return draw(ints(draw(int_list(rows * width, 0, 63)), shape=(rows, width)))


@st.composite
def row_index(draw, rows, R: int, *, as_range=None):
    """``rows`` as a slice (when they are ``range(*as_range)``), an int, or any form."""
    forms = ["seq", "seq"] + (["slice"] if as_range else []) + (["int"] if len(rows) == 1
                                                                  else [])
    form = draw(st.sampled_from(forms))
    if form == "slice":
        return slice(*as_range)
    if form == "int":
        return rows[0]
    return draw(ints(rows))


@st.composite
def reset_index(draw, R: int):
    kind = draw(st.sampled_from(["all", "slice", "int", "rows", "mask"]))
    event(f"reset index: {kind}")
    if kind == "all":
        return slice(None)
    if kind == "slice":
        return slice(draw(st.integers(-R, R)), draw(st.integers(-R, R)),
                     draw(st.integers(1, 3)))
    if kind == "int":
        return draw(st.integers(-R, R - 1))
    if kind == "rows":  # duplicates and negative indices allowed: only zeros are written
        return draw(ints(draw(int_list(draw(st.integers(0, 2 * R)), -R, R - 1))))
    mask = draw(st.lists(st.booleans(), min_size=R, max_size=R))
    return Arg(mask, draw(st.sampled_from(["numpy", "torch"])), "bool")


@st.composite
def move_indices(draw, R: int):
    """(src, dst): overlapping ranges, duplicated sources, or random distinct rows.
    Destinations are always distinct (a duplicated destination has no defined winner)."""
    kind = draw(st.sampled_from(["overlapping ranges", "duplicate src", "random"]))
    event(f"move: {kind}")
    k = draw(st.integers(0, R))
    if kind == "overlapping ranges":
        a, b = draw(st.integers(0, R - k)), draw(st.integers(0, R - k))
        src, dst = list(range(a, a + k)), list(range(b, b + k))
        return (draw(row_index(src, R, as_range=(a, a + k))),
                draw(row_index(dst, R, as_range=(b, b + k))))
    dst = draw(st.permutations(range(R)))[:k]
    if kind == "duplicate src":
        src = draw(int_list(k, -R, R - 1))
    else:
        src = draw(st.permutations(range(R)))[:k]
    return draw(row_index(src, R)), draw(row_index(dst, R))


@st.composite
def swap_indices(draw, R: int):
    """(src, dst), each distinct, overlapping ranges or rows shared by both sides."""
    kind = draw(st.sampled_from(["overlapping ranges", "index on both sides"]))
    event(f"swap: {kind}")
    k = draw(st.integers(0, R))
    if kind == "overlapping ranges":
        a, b = draw(st.integers(0, R - k)), draw(st.integers(0, R - k))
        return (draw(row_index(list(range(a, a + k)), R, as_range=(a, a + k))),
                draw(row_index(list(range(b, b + k)), R, as_range=(b, b + k))))
    src = draw(st.permutations(range(R)))[:k]
    dst = draw(st.permutations(range(R)))[:k]
    return draw(row_index(src, R)), draw(row_index(dst, R))


@st.composite
def hidden(draw, g: Geometry):
    """A hidden state of ``H`` exactly representable values, in some shape and dtype."""
    shape = draw(st.sampled_from([(g.H,), (1, 1, g.H), (1, g.H), (2, g.H // 2)]))
    values = [v / 4 for v in draw(int_list(g.H, -16, 16))]
    dtype = draw(st.sampled_from(["float32", "float64", "bfloat16"]))
    return Arg(values, "torch", dtype, draw(st.sampled_from(LAYOUTS)), shape=shape)


# --------------------------------------------------------------------- writer inputs
@st.composite
def token_map_args(draw, g: Geometry):
    """(rows, positions, block_table, padded_token_count, inherited_blocks)."""
    B = draw(st.integers(1, g.R + 2))
    width = draw(st.integers(g.W - 1, g.W + 1))
    T = draw(st.integers(0, 3 * g.R))
    rows = draw(int_list(T, 0, B - 1))
    positions = draw(int_list(T, 0, min(width, g.W) * g.BS - 1))
    padded = T + draw(st.sampled_from([0, 0, 1, 2 * g.BS, g.max_tokens - T]))
    inherited = None
    if draw(st.booleans()):
        length = draw(st.integers(max(rows, default=-1) + 1, B + 1))
        inherited = draw(ints(draw(int_list(length, 0, g.W))))
    event(f"token maps: {'token padding' if padded > T else 'no padding'}")
    return (draw(ints(rows)), draw(ints(positions)), draw(table(g, B, width)), padded,
            inherited)


@st.composite
def mha_args(draw, g: Geometry):
    """(query_lengths, kv_lengths, block_table, padded_request_count)."""
    n = draw(edge_count(0, g.R))
    q = draw(ints(draw(int_list(n, 0, 40))))
    same = draw(st.booleans())
    kv = q if same else draw(ints(draw(int_list(n, 0, 40))))
    B = draw(edge_count(0, n))
    padded = draw(edge_count(n, g.R))
    event(f"mha: kv is q={same}, B<n={B < n}, request padding={padded > n}")
    return q, kv, draw(table(g, B)), padded


@st.composite
def prefill_args(draw, g: Geometry):
    """(append_counts, pad_tokens), hitting spare-slot and full-batch absorption."""
    P = draw(edge_count(0, g.R))
    pad = draw(st.sampled_from([0, draw(st.integers(1, 12))]))
    event("prefill: " + ("no pad" if pad == 0 else
                         "spare slot" if P < g.R else "full batch"))
    return draw(ints(draw(int_list(P, 0, 20)))), pad


def annotate(pair: DifferentialPair, data, g: Geometry) -> None:
    """The scheduler writes prefix-match counts straight into the host annotations,
    each in ``[0, W]`` (a request inherits at most its whole table; the writers refuse
    an inherited count past that, which upstream accepts)."""
    values = torch.tensor(data.draw(int_list(g.R, 0, g.W), label="annotations"),
                          dtype=torch.int32)
    for meta in (pair.lib, pair.ref):
        if meta.request_matched_prefix_blocks is not None:
            meta.request_matched_prefix_blocks.copy_(values)
    pair.check("annotate")


# ---------------------------------------------------------------------------- tests
@quick
@given(data=st.data())
def test_row_lifecycle_ops_match_reference(path, data):
    """Row moves snapshot their sources and swaps apply the SPEC's second-assignment-wins
    order; if the kernel read a source after writing an overlapping destination, or the
    swap ran its two assignments the other way, a prefix-cache count would land on the
    wrong request and its inherited KV blocks would be rewritten."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    for _ in range(data.draw(st.integers(4, 12), label="ops")):
        annotate(pair, data, g)
        op = data.draw(st.sampled_from(["reset", "move", "swap"]), label="op")
        if op == "reset":
            pair.call("reset_request_rows", data.draw(reset_index(g.R), label="rows"))
        else:
            src, dst = data.draw((move_indices if op == "move" else swap_indices)(g.R),
                                 label="src, dst")
            pair.call(f"{op}_request_rows", src, dst)


@quick
@given(data=st.data())
def test_chunk_carry_take_matches_reference_for_right_and_wrong_keys(path, data):
    """A take with the recorded keys returns equal hidden buffers on both sides; any
    other key, or no carry, raises an AssertionError on both. A take that returned a
    stale hidden (or skipped the seam) would write a wrong committed position."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    keys = None
    for _ in range(data.draw(st.integers(3, 10), label="ops")):
        op = data.draw(st.sampled_from(["carry", "take", "wrong", "invalidate"]),
                       label="op")
        if op == "carry":
            keys = (data.draw(st.integers(0, 5)), data.draw(st.integers(0, 40)))
            pair.call("carry_chunk_boundary", data.draw(hidden(g)), *keys)
        elif op == "take" and keys is not None:
            taken = pair.call("take_chunk_boundary", *keys)
            assert taken.data_ptr() == pair.lib.chunk_boundary_hidden.data_ptr()
        elif op == "invalidate":
            keys = None
            pair.call("invalidate_chunk_boundary")
        else:  # a wrong request or seam, or no live carry at all
            req, seam = keys or (data.draw(st.integers(0, 5)),
                                 data.draw(st.integers(0, 40)))
            if keys is not None:
                req, seam = data.draw(st.sampled_from([(req + 1, seam), (req, seam + 1),
                                                       (req, seam - 1), (req + 2, seam)]))
            pair.call("take_chunk_boundary", req, seam, raises=AssertionError)


@quick
@given(data=st.data())
def test_direct_writer_calls_match_reference(path, data):
    """``write_token_maps``, ``write_mha_metadata`` and ``stage_prefill_lengths`` called
    directly with random valid inputs (lists, numpy, tensors, int32/int64, any layout) write
    exactly what the reference writes and nothing past the padded counts; a stray pad-row
    write would send a padded token into a real KV block."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g)
    for _ in range(data.draw(st.integers(2, 6), label="ops")):
        annotate(pair, data, g)
        op = data.draw(st.sampled_from(["token_maps", "mha", "prefill"]), label="op")
        if op == "token_maps":
            rows, positions, tab, padded, inherited = data.draw(token_map_args(g))
            if inherited is None and data.draw(st.booleans()):
                inherited = OWN_ANNOTATIONS if tab.shape[0] <= g.R else None
            pair.call("write_token_maps", VIEW, rows, positions, tab, padded,
                      inherited_blocks=inherited)
        elif op == "mha":
            pair.call("write_mha_metadata", VIEW, *data.draw(mha_args(g)))
        else:
            pair.call("stage_prefill_lengths", *data.draw(prefill_args(g)))


@quick
@given(data=st.data())
def test_disabled_object_is_inert_on_both_sides(path, data):
    """``enabled=False``: allocate reserves nothing, row ops and carry are no-ops, the
    mode stays NONE, take and begin_decode_for_capture raise AssertionError on both. A
    disabled object that allocated or recorded a carry would leak memory or hand a stale
    hidden to a later request."""
    g = data.draw(geometries, label="geometry")
    pair = new_pair(data, path, g, enabled=False)
    for _ in range(data.draw(st.integers(3, 10), label="ops")):
        op = data.draw(st.sampled_from(["reset", "move", "swap", "carry", "take",
                                        "capture", "cycle", "end"]), label="op")
        if op == "reset":
            pair.call("reset_request_rows", data.draw(reset_index(g.R)))
        elif op in ("move", "swap"):
            pair.call(f"{op}_request_rows",
                      *data.draw((move_indices if op == "move" else swap_indices)(g.R)))
        elif op == "carry":
            pair.call("carry_chunk_boundary", data.draw(hidden(g)), 1, 2)
        elif op == "take":
            pair.call("take_chunk_boundary", 1, 2, raises=AssertionError)
        elif op == "capture":
            pair.call("begin_decode_for_capture", data.draw(st.integers(0, g.R)),
                      raises=AssertionError)
        elif op == "cycle":
            pair.reallocate()
        else:
            pair.call("end_forward")
        for meta in (pair.lib, pair.ref):
            assert meta.forward_mode.name == "NONE" and meta.offsets is None
            assert not meta.chunk_boundary_valid
