"""contract §8 under fuzz: generated bad input at every public method, on both paths.

Failure story: a scheduler bug hands the library a float tensor, a transposed table, a
row index past the batch, a count that overflows. If any of it slips past validation, or
is refused only after a kernel has written half a forward, the next forward reads block
ids from two different steps and KV lands in the wrong block, silently.
``test_bad_input.py`` pins the messages of hand-written cases; this file generates them
(value strategies: ``tests/_fuzz_values.py``).

* Bad input: against a fully staged object (annotations set, a live carry, an active
  draft loop, a sentinel-filled view), ONE call with at least one bad argument must
  raise ``ValueError``, ``IndexError`` or ``TypeError`` -- nothing else, never a crash --
  and leave every buffer (values and addresses), the host truth and every view exactly
  as they were, and the object as usable as an untouched twin. One test per method and
  kind of bad argument, so that every kind gets its share of examples.
* Non-contiguous input: a valid call whose arrays are strided (``t[::2]``, transposed
  tables, negative numpy strides, broadcast rows, a strided view) must do exactly what
  the same call with ``.contiguous()`` copies does on a twin object.

A wrong but valid-typed carry key is valid input here: ``take_chunk_boundary`` answers
it with ``ChunkCarryError``. Each bug this fuzz found keeps a minimal reproducer at the
end of the file.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from mtpmeta import VIEW_FIELDS, ChunkCarryError, MTPMetadata
from mtpmeta.validation.inputs import as_row_indices
from tests import _fuzz_values as fv
from tests._fuzz_values import BS, H, INT32_MAX, INT64_MAX, LIMIT, TOKENS, R, W
from tests.helpers import BUFFER_NAMES, assert_same_state, buffer_state, config, make_view

ALLOWED = (ValueError, IndexError, TypeError)
PRIMED = "<the primed view>"  # stands for the primed view among generated arguments
T3 = np.array([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]])

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow, HealthCheck.filter_too_much])
BAD = settings(max_examples=15, **_SETTINGS)  # x ~100 method/kind pairs x 2 paths
STRIDED = settings(max_examples=25, **_SETTINGS)  # x 10 methods x 2 paths


# ------------------------------------------------------------------ state and views
def _primed(path: str):
    """Annotations 1..W cycling, a draft loop (n 2, padded 3, offsets [5, 9]) with staged
    lengths, a live carry (request 42 at 17), and a sentinel-filled view."""
    meta = MTPMetadata(**config())
    meta.allocate("cpu", mirror=(path == "mirror"), max_tokens=TOKENS)  # small staging: cheap
    meta.request_matched_prefix_blocks[:] = torch.arange(R, dtype=torch.int32) % W + 1
    meta.begin_decode(2, 3, [5, 9], T3, graphed=False)
    meta.stage_decode_lengths()
    meta.carry_chunk_boundary(torch.arange(H, dtype=torch.float32), 42, 17)
    return meta, make_view("context", max_requests=R, max_tokens=TOKENS, max_kv_blocks=W)


def _view_tensors(view: Any) -> Dict[str, torch.Tensor]:
    """The readable (CPU) tensor fields of any view-like object (or dict)."""
    fields = {}
    for f in VIEW_FIELDS:
        tensor = view.get(f.name) if isinstance(view, dict) else getattr(view, f.name, None)
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            fields[f.name] = tensor
    return fields


def _snapshot(meta: Any, views: List[Any], identity: bool = True) -> Dict[str, Any]:
    """Every buffer, the host truth and the scalar state of ``meta``, plus the readable
    fields of ``views``; ``identity``: also buffer addresses and the last-forward record."""
    state = buffer_state(meta)
    if identity:
        for name in BUFFER_NAMES:
            tensor = getattr(meta, name)
            state[f"{name} address"] = None if tensor is None else tensor.data_ptr()
        state["last_forward"] = id(getattr(meta, "last_forward", None))
    state["mirror"], state["device"] = meta.mirror, meta.device
    backend = getattr(meta, "_backend", None)
    for name in ("host_offsets", "host_block_table"):  # the mirror path's host truth
        array = getattr(backend, name, None)
        if array is not None:
            state[f"host {name}"] = torch.from_numpy(np.array(array))
    state["host_offsets_known"] = getattr(backend, "host_offsets_known", None)
    for number, view in enumerate(views):
        for name, tensor in _view_tensors(view).items():
            state[f"view {number} {name}"] = tensor.clone()
    return state


def _outcome(call: Callable[[], Any]) -> Tuple[str, Any]:
    try:
        result = call()
    except ALLOWED + (ChunkCarryError,) as error:
        return "raised", (type(error), str(error))
    if isinstance(result, torch.Tensor):
        return "ok", result.clone()
    if isinstance(result, tuple):
        return "ok", tuple(r.clone() for r in result)
    return "ok", result


def _assert_same_outcome(ours: Tuple[str, Any], theirs: Tuple[str, Any]) -> None:
    assert ours[0] == theirs[0], f"{ours} vs {theirs}"
    a, b = ours[1], theirs[1]
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{a} vs {b}"
    elif isinstance(a, tuple) and a and isinstance(a[0], torch.Tensor):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{a} vs {b}"
    else:
        assert a == b, f"{a} vs {b}"


# ----------------------------------------------------------------- the methods
class Spec(NamedTuple):
    """One public method: how to call it from a dict of arguments; how to draw valid
    arguments (``valid(draw, strided) -> (args, facts)``, facts: the canonical values);
    and, per kind of bad argument, how to draw overrides that make the call bad
    (``bad(draw, args, facts) -> {kind: thunk}``, holding only the kinds that can be
    made bad given these valid arguments)."""

    invoke: Callable[[Any, Any, Dict[str, Any]], Any]
    valid: Callable[..., Tuple[Dict[str, Any], Dict[str, Any]]]
    bad: Callable[..., Dict[str, Callable[[], Dict[str, Any]]]]
    kinds: Tuple[str, ...]


def _with(array: np.ndarray, draw, position_high: int, value: int) -> np.ndarray:
    """A copy of ``array`` with ``value`` at a drawn position in ``[0, position_high]``."""
    bad = array.copy()
    bad[draw(st.integers(0, position_high))] = value
    return bad


# reset / move / swap ---------------------------------------------------------------
def _valid_reset(draw, strided):
    return {"idx": draw(fv.index(strided=strided))}, {}


def _bad_reset(draw, args, facts):
    return {kind: (lambda kind=kind: {"idx": draw(fv.bad_index(kind))})
            for kind in fv.INDEX_KINDS}


def _valid_pair(draw, strided):
    src = draw(fv.index(strided=strided))
    return {"src": src, "dst": draw(fv.index(fv.index_length(src), strided))}, {}


def _valid_move(draw, strided):
    """A valid pair whose destinations name a row at most once (a move refuses a repeated
    destination: one of the two annotations would be lost)."""
    args, facts = _valid_pair(draw, strided)
    rows = as_row_indices(args["dst"], R, "dst")
    if type(rows) is not slice:
        assume(np.unique(np.asarray(rows) % R).size == len(rows))
    return args, facts


def _valid_swap(draw, strided):
    """A valid pair whose sides each name a row at most once (a swap refuses repeats)."""
    args, facts = _valid_pair(draw, strided)
    for side in ("src", "dst"):
        rows = as_row_indices(args[side], R, side)
        if type(rows) is not slice:
            assume(np.unique(np.asarray(rows) % R).size == len(rows))
    return args, facts


def _bad_pair(draw, args, facts):
    length = fv.index_length(args["src"])
    return {
        "src": lambda: {"src": draw(fv.bad_index())},
        "dst": lambda: {"dst": draw(fv.bad_index())},
        "length": lambda: {draw(st.sampled_from(["src", "dst"])): draw(fv.container(fv.ints(
            draw, fv.other_length(draw, length, 12), -R, R - 1)))},
    }


# carry / take ------------------------------------------------------------------------
@st.composite
def _hidden(draw, strided=None):
    values = np.array(draw(st.lists(st.floats(-1e3, 1e3, width=16), min_size=H, max_size=H)))
    shape = draw(st.sampled_from([(H,), (1, 1, H), (2, 4), (4, 2), (H, 1)]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    tensor = torch.from_numpy(values).reshape(shape).to(dtype)
    if strided is None and draw(st.booleans()):
        return draw(st.sampled_from([values.tolist(), values.reshape(shape)]))
    if not strided:
        return tensor
    if tensor.dim() == 2 and draw(st.booleans()):
        return tensor.t().contiguous().t()
    return torch.stack([tensor, torch.zeros_like(tensor)], dim=-1)[..., 0]


def _valid_carry(draw, strided):
    return {"hidden": draw(_hidden(strided)),
            "req_id": draw(fv.scalar(draw(st.integers(0, INT64_MAX)))),
            "position": draw(fv.scalar(draw(st.integers(0, 2**40))))}, {}


@st.composite
def _bad_key(draw):
    """A carry key of the wrong type, negative, or past int64 (the carry state's type)."""
    value = draw(st.sampled_from(fv.JUNK_COUNTS) | fv.beyond(0, INT64_MAX))
    if isinstance(value, int) and not isinstance(value, bool) and fv.in_int64(value):
        return draw(fv.scalar(value))
    return value


def _bad_carry(draw, args, facts):
    def numel():
        count = fv.other_length(draw, H, 3 * H)
        shape = draw(st.sampled_from([(count,), (1, 1, count), (count, 1)]))
        return draw(st.sampled_from([torch.ones(shape), torch.ones(shape, dtype=torch.float64),
                                     np.ones(shape), torch.ones(shape).tolist()]))

    def dtype():
        kind = draw(st.sampled_from([torch.int32, torch.int64, torch.bool, torch.complex64,
                                     torch.uint8]))
        return draw(st.sampled_from([torch.ones(H, dtype=kind), torch.ones(H, dtype=kind)
                                     .numpy(), [True] * H, list(range(H))]))

    def junk():
        return draw(st.sampled_from(["abc", ["a"] * H, np.array([None] * H), None, object(),
                                     {"h": 1}, [None] * H, torch.ones(H, device="meta")]))

    return {"hidden-numel": lambda: {"hidden": numel()},
            "hidden-dtype": lambda: {"hidden": dtype()},
            "hidden-junk": lambda: {"hidden": junk()},
            "req_id": lambda: {"req_id": draw(_bad_key())},
            "position": lambda: {"position": draw(_bad_key())}}


def _valid_take(draw, strided):
    key = st.integers(-2**63, INT64_MAX) | st.just(42) | st.just(17)
    return {"req_id": draw(fv.scalar(draw(key))), "seam": draw(fv.scalar(draw(key)))}, {}


def _bad_take(draw, args, facts):
    key = st.sampled_from(fv.JUNK_COUNTS) | st.integers(-2**70, -2**63 - 1) | \
        st.integers(2**63, 2**70)  # keys live in int64
    return {name: (lambda name=name: {name: draw(key)}) for name in ("req_id", "seam")}


# draft loop -------------------------------------------------------------------------
def _valid_begin(draw, strided):
    n = draw(st.integers(0, R))
    padded = draw(st.integers(n, R))
    # Entries past n are never read, so they may hold anything.
    starts = np.concatenate([fv.ints(draw, n, 0, LIMIT - 1),
                             fv.ints(draw, draw(st.integers(0, 3)), -100, 10**6)])
    table = fv.table(draw, n + draw(st.integers(0, 2)), W)
    return {"n": draw(fv.scalar(n)), "padded": draw(fv.scalar(padded)),
            "starts": draw(fv.container(starts, strided)),
            "table": draw(fv.container(table, strided)), "graphed": draw(st.booleans())}, \
        {"n": n, "starts": starts, "table": table}


def _bad_begin(draw, args, facts):
    n, starts, table = facts["n"], facts["starts"], facts["table"]
    options = {
        "n": lambda: {"n": draw(fv.bad_count(0, R))},
        "padded": lambda: {"padded": draw(fv.bad_count(n, R))},
        "starts-junk": lambda: {"starts": draw(fv.bad_array(starts.shape))},
        "table-junk": lambda: {"table": draw(fv.bad_array(table.shape))},
        "table-width": lambda: {"table": draw(fv.container(fv.table(
            draw, n + draw(st.integers(0, 2)), draw(st.sampled_from([0, 1, W - 1, W + 1])))))},
    }
    if n:
        options.update({
            "starts-short": lambda: {"starts": draw(fv.container(
                starts[:draw(st.integers(0, n - 1))]))},
            "starts-negative": lambda: {"starts": draw(fv.container(_with(
                starts, draw, n - 1, draw(st.integers(-2**63, -1)))))},
            "starts-column": lambda: {"starts": draw(fv.container(_with(
                starts, draw, n - 1, draw(st.integers(LIMIT, INT64_MAX)))))},
            "table-short": lambda: {"table": draw(fv.container(
                table[:draw(st.integers(0, n - 1))]))},
        })
    return options


def _valid_capture(draw, strided):
    return {"padded": draw(fv.scalar(draw(st.integers(0, R))))}, {}


def _bad_capture(draw, args, facts):
    return {"padded": lambda: {"padded": draw(fv.bad_count(0, R))}}


def _valid_decode(draw, strided):
    return {"view": fv.namespace_view(strided=True) if strided else PRIMED}, {}


def _bad_decode(draw, args, facts):  # the primed draft loop stages n 2, padded 3
    return {f"view-{kind}": (lambda kind=kind: {"view": draw(fv.bad_view(kind, 3, 3))})
            for kind in fv.view_kinds(3, 3)}


# commit pass -----------------------------------------------------------------------
def _valid_prefill(draw, strided):
    counts = fv.ints(draw, draw(st.integers(0, R)), 0, 100)
    return {"counts": draw(fv.container(counts, strided)),
            "pad": draw(fv.scalar(draw(st.integers(0, 100))))}, {"counts": counts}


def _bad_prefill(draw, args, facts):
    counts = facts["counts"]
    options = {
        "counts-junk": lambda: {"counts": draw(fv.bad_array(counts.shape))},
        "counts-too-many": lambda: {"counts": draw(fv.container(fv.ints(
            draw, draw(st.integers(R + 1, 3 * R)), 0, 100)))},
        "pad": lambda: {"pad": draw(fv.bad_count(0, INT32_MAX))},  # int32 query_lengths
    }
    if counts.size:
        options["counts-negative"] = lambda: {"counts": draw(fv.container(_with(
            counts, draw, counts.size - 1, draw(st.integers(-2**63, -1)))))}
        options["counts-beyond-int32"] = lambda: {"counts": draw(fv.container(_with(
            counts, draw, counts.size - 1, draw(st.integers(INT32_MAX + 1, INT64_MAX)))))}
    return options


def _view_arg(strided):
    return fv.namespace_view(strided=True) if strided else PRIMED


def _valid_token_maps(draw, strided):
    table_rows = draw(st.integers(1, 4))
    width = draw(st.integers(1, W + 2))  # a table wider than W is read up to column W
    count = draw(st.integers(0, TOKENS))
    rows = fv.ints(draw, count, 0, table_rows - 1)
    positions = fv.ints(draw, count, 0, min(W, width) * BS - 1)
    table = fv.table(draw, table_rows, width)
    padded = draw(st.integers(count, TOKENS))
    inherited = None if draw(st.booleans()) else fv.ints(  # counts in [0, W]
        draw, table_rows + draw(st.integers(0, 2)), 0, W)
    form = lambda value: None if value is None else draw(fv.container(value, strided))  # noqa: E731
    return {"view": _view_arg(strided), "rows": form(rows), "positions": form(positions),
            "table": form(table), "padded": draw(fv.scalar(padded)),
            "inherited": form(inherited)}, \
        {"rows": rows, "positions": positions, "table": table, "padded": padded}


def _bad_token_maps(draw, args, facts):
    rows, positions, table, padded = facts["rows"], facts["positions"], facts["table"], \
        facts["padded"]
    count = rows.size
    options = {
        "view": lambda: {"view": draw(fv.bad_view(draw(st.sampled_from(fv.view_kinds(
            padded, 0, width_checked=False))), padded))},
        "rows-junk": lambda: {"rows": draw(fv.bad_array(rows.shape))},
        "positions-junk": lambda: {"positions": draw(fv.bad_array(positions.shape))},
        "table-junk": lambda: {"table": draw(fv.bad_array(table.shape))},
        "inherited-junk": lambda: {"inherited": draw(fv.bad_array((table.shape[0],), True))},
        "padded": lambda: {"padded": draw(fv.bad_count(count, TOKENS))},
        "length": lambda: {draw(st.sampled_from(["rows", "positions"])): draw(fv.container(
            fv.ints(draw, fv.other_length(draw, count, TOKENS), 0, 0)))},
    }
    if count:
        top_row, top_column = int(rows.max()), int(positions.max()) // BS
        options.update({
            "rows-range": lambda: {"rows": draw(fv.container(_with(rows, draw, count - 1, draw(
                st.integers(table.shape[0], INT64_MAX) | st.integers(-2**63, -1)))))},
            "positions-negative": lambda: {"positions": draw(fv.container(_with(
                positions, draw, count - 1, draw(st.integers(-2**63, -1)))))},
            "positions-column": lambda: {"positions": draw(fv.container(_with(
                positions, draw, count - 1, draw(st.integers(
                    min(W, table.shape[1]) * BS, INT64_MAX)))))},
            "table-rows": lambda: {"table": draw(fv.container(
                table[:draw(st.integers(0, top_row))]))},
            "table-narrow": lambda: {"table": draw(fv.container(table[:, :top_column]))},
            "inherited-short": lambda: {"inherited": draw(fv.container(fv.ints(
                draw, draw(st.integers(0, top_row)), 0, W)))},
        })
    return options


def _valid_mha(draw, strided):
    n = draw(st.integers(0, R))
    q, kv = fv.ints(draw, n, 0, 100), fv.ints(draw, n, 0, 100)
    table = fv.table(draw, draw(st.integers(0, n)), W)  # rows [B, n) read the dummy block
    padded = draw(st.integers(n, R))
    args = {"view": _view_arg(strided), "q": draw(fv.container(q, strided)),
            "kv": draw(fv.container(kv, strided)),
            "table": draw(fv.container(table, strided)), "padded": draw(fv.scalar(padded))}
    if draw(st.booleans()):
        args["kv"] = args["q"]  # the commit pass passes one buffer as both
    return args, {"n": n, "table": table, "padded": padded}


def _bad_mha(draw, args, facts):
    n, table, padded = facts["n"], facts["table"], facts["padded"]

    def beyond_view():
        count = draw(st.integers(R + 1, R + 4))
        return {"q": draw(fv.container(fv.ints(draw, count, 0, 9))),
                "kv": draw(fv.container(fv.ints(draw, count, 0, 9)))}

    options = {
        "view": lambda: {"view": draw(fv.bad_view(draw(st.sampled_from(fv.view_kinds(
            0, padded))), 0, padded))},
        "q-junk": lambda: {"q": draw(fv.bad_array((n,)))},
        "kv-junk": lambda: {"kv": draw(fv.bad_array((n,)))},
        "table-junk": lambda: {"table": draw(fv.bad_array(table.shape))},
        "padded": lambda: {"padded": draw(fv.bad_count(n, R))},
        "length": lambda: {draw(st.sampled_from(["q", "kv"])): draw(fv.container(fv.ints(
            draw, fv.other_length(draw, n, R + 2), 0, 9)))},
        "n-beyond-view": beyond_view,
        "table-rows": lambda: {"table": draw(fv.container(fv.table(
            draw, draw(st.integers(n + 1, n + 3)), W)))},
        "table-width": lambda: {"table": draw(fv.container(fv.table(
            draw, table.shape[0], draw(st.sampled_from([0, 1, W - 1, W + 1])))))},
    }
    if n:
        for name in ("q", "kv"):
            options[f"{name}-negative"] = lambda name=name: {name: draw(fv.container(_with(
                fv.ints(draw, n, 0, 9), draw, n - 1, draw(st.integers(-2**63, -1)))))}
            options[f"{name}-beyond-int32"] = lambda name=name: {name: draw(fv.container(
                _with(fv.ints(draw, n, 0, 9), draw, n - 1, draw(st.integers(
                    INT32_MAX + 1, INT64_MAX)))))}
    return options


def _valid_commit(draw, strided):
    num = draw(st.integers(0, R))
    counts = fv.ints(draw, num, 0, 6)
    while counts.sum() > TOKENS:  # keep the pass inside the view
        counts[int(np.argmax(counts))] -= 1
    starts = None
    if draw(st.booleans()):  # each span inside the table; entries past num unread
        starts = np.array([draw(st.integers(0, LIMIT - c)) for c in counts] +
                          [draw(st.integers(0, 1000)) for _ in range(draw(st.integers(0, 2)))],
                          dtype=np.int64)
    inherited = None if draw(st.booleans()) else fv.ints(  # counts in [0, W]
        draw, num + draw(st.integers(0, 2)), 0, W)
    table = fv.table(draw, num + draw(st.integers(0, 2)), W)
    total = int(counts.sum())
    padded_tokens = draw(st.none() | st.integers(total, TOKENS))
    padded_requests = draw(st.none() | st.integers(num, R))
    form = lambda value: None if value is None else draw(fv.container(value, strided))  # noqa: E731
    args = {"view": _view_arg(strided), "counts": form(counts), "table": form(table),
            "starts": form(starts), "inherited": form(inherited),
            "padded_tokens": None if padded_tokens is None else draw(fv.scalar(padded_tokens)),
            "padded_requests": None if padded_requests is None else draw(fv.scalar(
                padded_requests))}
    pad = (padded_tokens or total) - total
    staged = num + 1 if pad and num < R else num  # a trailing request absorbs the pad
    return args, {"counts": counts, "starts": starts, "table": table, "total": total,
                  "need_tokens": padded_tokens or total,
                  "need_requests": max(padded_requests or num, staged)}


def _bad_commit(draw, args, facts):
    counts, starts, table, total = facts["counts"], facts["starts"], facts["table"], \
        facts["total"]
    num = counts.size
    need = facts["need_tokens"], facts["need_requests"]
    options = {
        "view": lambda: {"view": draw(fv.bad_view(draw(st.sampled_from(fv.view_kinds(
            *need))), *need))},
        "counts-junk": lambda: {"counts": draw(fv.bad_array(counts.shape))},
        "counts-too-many": lambda: {"counts": draw(fv.container(fv.ints(
            draw, draw(st.integers(R + 1, 3 * R)), 0, 1)))},
        "table-junk": lambda: {"table": draw(fv.bad_array(table.shape))},
        "table-width": lambda: {"table": draw(fv.container(fv.table(
            draw, table.shape[0], draw(st.sampled_from([0, 1, W - 1, W + 1])))))},
        "starts-junk": lambda: {"starts": draw(fv.bad_array((num,), True))},
        "inherited-junk": lambda: {"inherited": draw(fv.bad_array((num,), True))},
        "padded-tokens": lambda: {"padded_tokens": draw(fv.bad_count(total, TOKENS, True))},
        "padded-requests": lambda: {"padded_requests": draw(fv.bad_count(num, R, True))},
    }
    if not num:
        return options
    starts_or_zeros = np.zeros(num, dtype=np.int64) if starts is None else starts[:num]

    def beyond_table():  # one request's last position lands in block column >= W
        r = draw(st.integers(0, num - 1))
        bad = counts.copy()
        bad[r] = LIMIT - int(starts_or_zeros[r]) + draw(st.integers(1, 40))
        return {"counts": draw(fv.container(bad))}

    def beyond_view():  # every span inside the table, the total past the view
        bad = counts.copy()
        bad[0] = draw(st.integers(TOKENS + 1, LIMIT))
        overrides = {"counts": draw(fv.container(bad))}
        if starts is not None:
            overrides["starts"] = draw(fv.container(_with(starts, draw, 0, 0)))
        return overrides

    options.update({
        "counts-negative": lambda: {"counts": draw(fv.container(_with(
            counts, draw, num - 1, draw(st.integers(-2**63, -1)))))},
        "counts-beyond-int32": lambda: {"counts": draw(fv.container(_with(
            counts, draw, num - 1, draw(st.integers(INT32_MAX + 1, INT64_MAX)))))},
        "counts-beyond-table": beyond_table,
        "total-beyond-view": beyond_view,
        "table-short": lambda: {"table": draw(fv.container(
            table[:draw(st.integers(0, num - 1))]))},
        "starts-short": lambda: {"starts": draw(fv.container(fv.ints(
            draw, draw(st.integers(0, num - 1)), 0, 0)))},
        "starts-negative": lambda: {"starts": draw(fv.container(_with(
            starts_or_zeros, draw, num - 1, draw(st.integers(-2**63, -1)))))},
        "inherited-short": lambda: {"inherited": draw(fv.container(fv.ints(
            draw, draw(st.integers(0, num - 1)), 0, W)))},
    })
    if total:
        r = int(np.argmax(counts))  # up to INT64_MAX: start + count - 1 must not wrap
        options["starts-column"] = lambda: {"starts": draw(fv.container(np.where(
            np.arange(num) == r, draw(st.integers(LIMIT - int(counts[r]) + 1, INT64_MAX)),
            starts_or_zeros)))}
        options["padded-tokens-short"] = lambda: {"padded_tokens": draw(fv.scalar(draw(
            st.integers(0, total - 1))))}
    return options


# allocate ---------------------------------------------------------------------------
def _valid_allocate(draw, strided):
    return {"device": draw(st.sampled_from(["cpu", torch.device("cpu")])),
            "mirror": draw(st.sampled_from([None, True, False])),
            "max_tokens": draw(fv.scalar(draw(st.integers(1, 512))))}, {}


def _bad_allocate(draw, args, facts):
    devices = [None, 3.5, ["cpu"], object(), {"type": "cpu"}, "gpu", "", "cpu:x", "cpu:-1",
               -1]
    return {
        "device": lambda: {"device": draw(st.sampled_from(devices))},
        # "cuda" is a fine device string; mirror=False refuses it before any allocation.
        "cuda-without-mirror": lambda: {"device": "cuda", "mirror": False},
        "max_tokens": lambda: {"max_tokens": draw(fv.bad_count(1, INT32_MAX))},
    }


def _spec(invoke, valid, bad, kinds) -> Spec:
    return Spec(invoke, valid, bad, tuple(kinds))


SPECS: Dict[str, Spec] = {
    "reset_request_rows": _spec(
        lambda m, v, a: m.reset_request_rows(a["idx"]), _valid_reset, _bad_reset,
        fv.INDEX_KINDS),
    "move_request_rows": _spec(
        lambda m, v, a: m.move_request_rows(a["src"], a["dst"]), _valid_move, _bad_pair,
        ["src", "dst", "length"]),
    "swap_request_rows": _spec(
        lambda m, v, a: m.swap_request_rows(a["src"], a["dst"]), _valid_swap, _bad_pair,
        ["src", "dst", "length"]),
    "carry_chunk_boundary": _spec(
        lambda m, v, a: m.carry_chunk_boundary(a["hidden"], a["req_id"], a["position"]),
        _valid_carry, _bad_carry,
        ["hidden-numel", "hidden-dtype", "hidden-junk", "req_id", "position"]),
    "take_chunk_boundary": _spec(
        lambda m, v, a: m.take_chunk_boundary(a["req_id"], a["seam"]), _valid_take,
        _bad_take, ["req_id", "seam"]),
    "begin_decode": _spec(
        lambda m, v, a: m.begin_decode(a["n"], a["padded"], a["starts"], a["table"],
                                       a["graphed"]), _valid_begin, _bad_begin,
        ["n", "padded", "starts-junk", "starts-short", "starts-negative", "starts-column",
         "table-junk", "table-width", "table-short"]),
    "begin_decode_for_capture": _spec(
        lambda m, v, a: m.begin_decode_for_capture(a["padded"]), _valid_capture,
        _bad_capture, ["padded"]),
    "stage_prefill_lengths": _spec(
        lambda m, v, a: m.stage_prefill_lengths(a["counts"], a["pad"]), _valid_prefill,
        _bad_prefill, ["counts-junk", "counts-too-many", "counts-negative",
                       "counts-beyond-int32", "pad"]),
    "write_token_maps": _spec(
        lambda m, v, a: m.write_token_maps(v, a["rows"], a["positions"], a["table"],
                                           a["padded"], a["inherited"]),
        _valid_token_maps, _bad_token_maps,
        ["view", "rows-junk", "rows-range", "positions-junk", "positions-negative",
         "positions-column", "length", "table-junk", "table-rows", "table-narrow",
         "padded", "inherited-junk", "inherited-short"]),
    "write_mha_metadata": _spec(
        lambda m, v, a: m.write_mha_metadata(v, a["q"], a["kv"], a["table"], a["padded"]),
        _valid_mha, _bad_mha,
        ["view", "q-junk", "q-negative", "q-beyond-int32", "kv-junk", "kv-negative",
         "kv-beyond-int32", "length", "n-beyond-view", "table-junk", "table-rows",
         "table-width", "padded"]),
    "setup_decode_step": _spec(
        lambda m, v, a: m.setup_decode_step(v), _valid_decode, _bad_decode,
        [f"view-{kind}" for kind in fv.view_kinds(3, 3)]),
    "setup_commit_pass": _spec(
        lambda m, v, a: m.setup_commit_pass(
            v, a["counts"], a["table"], start_positions=a["starts"],
            inherited_blocks=a["inherited"], padded_token_count=a["padded_tokens"],
            padded_request_count=a["padded_requests"]), _valid_commit, _bad_commit,
        ["view", "counts-junk", "counts-too-many", "counts-negative", "counts-beyond-int32",
         "counts-beyond-table", "total-beyond-view", "table-junk", "table-width",
         "table-short", "starts-junk", "starts-short", "starts-negative", "starts-column",
         "inherited-junk", "inherited-short", "padded-tokens", "padded-tokens-short",
         "padded-requests"]),
    "allocate": _spec(
        lambda m, v, a: m.allocate(a["device"], mirror=a["mirror"], max_tokens=a["max_tokens"]),
        _valid_allocate, _bad_allocate, ["device", "cuda-without-mirror", "max_tokens"]),
}
BAD_CASES = [(method, kind) for method, spec in SPECS.items() for kind in spec.kinds]
# Methods that take arrays or a view, i.e. something that can be strided.
STRIDED_METHODS = [name for name in SPECS if name not in
                   ("take_chunk_boundary", "begin_decode_for_capture", "allocate")]


def _call(method: str, meta: Any, primed_view: Any, args: Dict[str, Any]):
    view = args.get("view", PRIMED)
    view = primed_view if isinstance(view, str) and view == PRIMED else view
    return lambda: SPECS[method].invoke(meta, view, args)


def _is_primed(view: Any) -> bool:
    return isinstance(view, str) and view == PRIMED


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("method, kind", BAD_CASES, ids=[f"{m}-{k}" for m, k in BAD_CASES])
@BAD
@given(data=st.data())
def test_generated_bad_input_raises_cleanly_and_changes_nothing(path, method, kind, data):
    """One call with a bad argument: ValueError/IndexError/TypeError and not one element,
    address or scalar changed; afterwards the object stages a draft depth exactly like
    an untouched twin (no poisoned cache, no half-written host truth)."""
    spec = SPECS[method]
    args, facts = spec.valid(data.draw, None)
    options = spec.bad(data.draw, args, facts)
    assume(kind in options)  # e.g. a negative start needs a request to put it in
    bad = options[kind]()
    args.update(bad)
    meta, view = _primed(path)
    views = [view] + ([] if _is_primed(args.get("view", PRIMED)) else [args["view"]])
    before = _snapshot(meta, views)
    try:
        _call(method, meta, view, args)()
    except ALLOWED as error:
        event(f"{type(error).__name__}: {str(error).split(':')[0][:40]}")
    except BaseException as error:  # anything else is the failure
        pytest.fail(f"{method}({kind}: {bad!r}) raised {type(error).__name__}: {error}")
    else:
        pytest.fail(f"{method} accepted bad input ({kind}: {bad!r})")
    assert_same_state(before, _snapshot(meta, views))

    twin, twin_view = _primed(path)
    assert meta.setup_decode_step(view) == twin.setup_decode_step(twin_view)
    assert_same_state(_snapshot(twin, [twin_view], False), _snapshot(meta, [view], False))


def _contiguous(value: Any, memo: Dict[int, Any]) -> Any:
    """A contiguous copy of a tensor, array or view (the same copy for the same input,
    so ``kv is q`` survives); anything else as it is."""
    if id(value) not in memo:
        if isinstance(value, torch.Tensor):
            memo[id(value)] = value.contiguous().clone()
        elif isinstance(value, np.ndarray):
            memo[id(value)] = np.array(value, order="C")
        elif isinstance(value, SimpleNamespace):
            memo[id(value)] = SimpleNamespace(**{k: _contiguous(t, memo)
                                                 for k, t in vars(value).items()})
        else:
            memo[id(value)] = value
    return memo[id(value)]


def _copies(args: Dict[str, Any]) -> Dict[str, Any]:
    return {name: value.clone() if isinstance(value, torch.Tensor) else np.array(value)
            for name, value in args.items() if isinstance(value, (torch.Tensor, np.ndarray))}


@pytest.mark.parametrize("method", STRIDED_METHODS)
@STRIDED
@given(data=st.data())
def test_strided_inputs_give_what_their_contiguous_copies_give(path, method, data):
    """A transposed block table or a ``t[::2]`` row index must be read by value, not by
    its storage: the same result, buffers and view as contiguous copies give a twin, and
    the caller's arrays untouched. Never silent garbage."""
    args, _ = SPECS[method].valid(data.draw, True)
    memo: Dict[int, Any] = {}
    contiguous = {name: _contiguous(value, memo) for name, value in args.items()}
    inputs = _copies(args)
    ours, our_view = _primed(path)
    theirs, their_view = _primed(path)
    our_outcome = _outcome(_call(method, ours, our_view, args))
    their_outcome = _outcome(_call(method, theirs, their_view, contiguous))
    assert their_outcome[0] == "ok", their_outcome  # the generated call is valid
    _assert_same_outcome(our_outcome, their_outcome)
    extra = [] if _is_primed(args.get("view", PRIMED)) else ["view"]
    assert_same_state(
        _snapshot(theirs, [their_view] + [contiguous[k] for k in extra], False),
        _snapshot(ours, [our_view] + [args[k] for k in extra], False))
    for name, before in inputs.items():
        after = args[name]
        same = torch.equal(before, after) if isinstance(before, torch.Tensor) else \
            np.array_equal(before, after)
        assert same, f"{name} was written"


# ------------------------------------------- reproducers of bugs this fuzz found
# One minimal call per bug; a path is parametrized only where the
# paths differ.
def _raises_cleanly_and_changes_nothing(meta, view, call, exc=ALLOWED):
    before = _snapshot(meta, [view])
    with pytest.raises(exc):
        call()
    assert_same_state(before, _snapshot(meta, [view]))


def test_commit_span_that_wraps_int64_is_refused(path):
    """``start + count - 1`` for ``start_positions=[2**63 - 1]`` wrapped negative in the
    int64 block-column check; the commit pass then staged a block id read from past the
    table (161 for this [3, 6] table of 10..27) and position ids 2**63 - 1, -2**63."""
    meta, view = _primed(path)
    table = np.arange(10, 28, dtype=np.int64).reshape(3, 6)
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.setup_commit_pass(
        view, np.array([2]), table, start_positions=np.array([INT64_MAX])), ValueError)


@pytest.mark.parametrize("key", ["req_id", "position"])
def test_carry_key_beyond_int64_is_refused_before_the_copy(key):
    """A key of 2**63 overflowed in ``native.carry.record`` (OverflowError) after the
    hidden was copied: the live carry of request 42 then handed out another request's
    hidden to ``take_chunk_boundary(42, 17)``."""
    meta, view = _primed("direct")
    keys = {"req_id": 1, "position": 2, key: 2**63}
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.carry_chunk_boundary(
        torch.full((H,), 5.0), keys["req_id"], keys["position"]))


@pytest.mark.parametrize("hidden", [None, object(), [None] * H],
                         ids=["None", "object", "list-of-None"])
def test_hidden_that_is_not_array_like_raises_type_error(hidden):
    """torch.as_tensor's RuntimeError ('Could not infer dtype of NoneType') escaped."""
    meta, view = _primed("direct")
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.carry_chunk_boundary(
        hidden, 1, 2), TypeError)


META = torch.zeros(2, dtype=torch.int64, device="meta")


@pytest.mark.parametrize("path, call", [
    ("direct", lambda m, v: m.begin_decode(2, 2, META, T3, False)),
    ("direct", lambda m, v: m.stage_prefill_lengths(META, 0)),
    ("direct", lambda m, v: m.write_token_maps(v, META, [0, 1], T3, 2)),
    ("mirror", lambda m, v: m.setup_commit_pass(v, META, T3)),
    ("mirror", lambda m, v: m.reset_request_rows(META)),
    ("mirror", lambda m, v: m.carry_chunk_boundary(torch.ones(H, device="meta"), 1, 2)),
], ids=["begin_decode", "stage_prefill_lengths", "write_token_maps", "setup_commit_pass",
        "reset_request_rows", "carry_chunk_boundary"])
def test_data_less_tensor_input_raises_value_error(path, call):
    """A tensor on another device than the buffers is routed to device ops (the mirror
    path checks its device) or read back; a meta tensor has nothing to read, and the
    NotImplementedError of ``.cpu()`` / ``copy_`` escaped."""
    meta, view = _primed(path)
    _raises_cleanly_and_changes_nothing(meta, view, lambda: call(meta, view), ValueError)


@pytest.mark.parametrize("value", [2**63, -2**63 - 1, np.uint64(2**64 - 1)],
                         ids=["2**63", "-2**63-1", "uint64-max"])
def test_row_index_beyond_int64_raises_index_error(value):
    """``np.asarray([value], dtype=np.int64)`` raised OverflowError for a single row
    outside int64 (move/swap share the code)."""
    meta, view = _primed("direct")
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.reset_request_rows(value),
                                        IndexError)


def test_take_key_beyond_uint64_is_a_clean_error():
    """A key of 2**64 reached the jitted ``native.carry.check_take``, and numba's
    TypingError escaped (with the JIT off it was a ChunkCarryError)."""
    meta, view = _primed("direct")
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.take_chunk_boundary(
        2**64, 17), ValueError)


@pytest.mark.parametrize("device", ["gpu", "", "cpu:x", -1])
def test_allocate_unknown_device_raises_value_error(device):
    """torch.device's RuntimeError ('Expected one of cpu, cuda, ...') escaped allocate."""
    meta, view = _primed("direct")
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.allocate(device),
                                        ValueError)


def test_allocate_max_tokens_beyond_int64_raises_value_error():
    """max_tokens was bounded below only; 2**64 overflowed sizing the mirror staging."""
    meta, view = _primed("mirror")
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.allocate(
        "cpu", mirror=True, max_tokens=2**64), ValueError)


@pytest.mark.parametrize("pad", [2**31, 2**40, 2**64])
def test_pad_tokens_beyond_int32_raises_value_error(path, pad):
    """pad_tokens was bounded below only: 2**40 staged [1, 2, 0] into the int32
    query_lengths (wrapped, silently) and 2**64 raised numba's TypingError."""
    meta, view = _primed(path)
    _raises_cleanly_and_changes_nothing(meta, view, lambda: meta.stage_prefill_lengths(
        [1, 2], pad), ValueError)
