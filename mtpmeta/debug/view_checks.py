"""The destination-view half of ``mtpmeta.debug.invariants``: the checks of the last
forward's view (padded token rows, padded request slots, cu arrays, block ids,
inherited blocks, committed KV; the list and the entry ``check_invariants`` are in
``invariants.py``, with the object-state checks), and the helpers both halves use.

The view checks read ``gpu_view`` when given, else ``meta.last_forward.gpu_view``; they
assume the view still holds what the last MTP write put there (a view another writer
shares must be checked right after the MTP forward). ``last_forward.inherited`` is a
copy the call took of the caller's counts, which the scheduler may legitimately change
afterwards (a row move of the annotations, a new prefix hit). A draft depth has no such
input: its counts are read from ``request_matched_prefix_blocks`` at the first check of
its record and kept for later checks of that record.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import numpy as np
import torch

from mtpmeta.buffers.device_runtime import get_runtime
from mtpmeta.errors import InvariantError
from mtpmeta.types import ForwardRecord

__all__: list = []  # private to mtpmeta.debug.invariants, whose entry calls these

# meta -> (record, _record_key, copy of record.inherited at the record's first check)
_INHERITED_SEEN: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
# meta -> the record whose device-route block_table was compared (at its first check)
_TABLES_SEEN: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
# meta -> (commit record, _record_key, [T] int64 KV slots it wrote, -1 for the dummy)
_COMMITS_SEEN: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _fail(invariant: str, detail: str) -> None:
    raise InvariantError(f"{invariant}: {detail}")


def _host(value: Any) -> np.ndarray:
    """A numpy array of ``value`` (a tensor anywhere, an array or a sequence). A device
    tensor is read through the runtime's blocking ``to_host``, ordered after the work
    queued before the check (a sync on CUDA: the checks are for debugging)."""
    if isinstance(value, torch.Tensor):
        runtime = get_runtime()
        return (runtime.to_host(value) if runtime.is_device(value) else value).numpy()
    return np.asarray(value)


# ----------------------------------------------------------------------- view state
_TOKEN_NAMES = ("token_to_block_idx", "token_to_local_position_within_kv_block",
                "token_to_request_idx", "token_to_position_in_request")
_REQUEST_NAMES = ("mha_query_lengths", "mha_kv_seq_lengths", "mha_cu_query_seq_lengths",
                  "mha_cu_kv_seq_lengths", "mha_block_table")


def _read_fields(view: Any, names: tuple, rows: int) -> Dict[str, np.ndarray]:
    """Host int64 copies of the first ``rows`` rows of each field (``rows + 1`` for the
    cumulative ones); a view too small for the last forward is reported, not indexed."""
    fields = {}
    for name in names:
        tensor = getattr(view, name, None)
        if not isinstance(tensor, torch.Tensor):
            _fail("gpu_view", f"missing tensor field {name!r}")
        array = _host(tensor)
        needed = rows + 1 if name.startswith("mha_cu_") else rows
        if array.shape[0] < needed:
            _fail("gpu_view", f"{name} holds {array.shape[0]} rows, the last forward "
                              f"wrote {needed}")
        fields[name] = array[:needed].astype(np.int64)
    return fields


def _describe(record: ForwardRecord) -> str:
    return f"the last {record.kind} forward"


def _check_token_rows(meta: Any, record: ForwardRecord, view: Any) -> None:
    T, padded = record.token_count, record.padded_token_count
    f = _read_fields(view, _TOKEN_NAMES, padded)
    expected = (("token_to_block_idx", meta.dummy_block_idx, "dummy_block_idx "),
                ("token_to_local_position_within_kv_block", 0, ""))
    for name, value, what in expected:
        values = f[name]
        bad = np.flatnonzero(values[T:] != value)
        if bad.size:
            t = T + int(bad[0])
            _fail("padded token rows", f"token {t} (pad rows [{T}, {padded}) of "
                                       f"{_describe(record)}) has {name} {int(values[t])}, "
                                       f"expected {what}{value}")
    _check_block_ids(meta, record, f, T, view.token_to_block_idx.dtype)
    if record.inherited is not None:
        _check_inherited(meta, record, f, T)
    elif record.kind == "decode" and T:
        _check_inherited(meta, record, f, T, draft_offset=_draft_offset(meta, record))
    _check_committed_slots(meta, record, f, T)


def _check_block_ids(meta: Any, record: ForwardRecord, f: Dict[str, np.ndarray],
                     T: int, view_dtype: torch.dtype) -> None:
    """Real tokens write allocated blocks that are the ids they were given: no negative
    id (an unallocated block, or an id wrapped into a narrower dtype); a draft depth's
    token reads a block of the draft loop's ``block_table`` that the view's
    ``token_to_block_idx`` dtype holds (else the view got a wrapped id); a device-route writer's
    token holds the block of the table it was given (first check of the record)."""
    blocks = f["token_to_block_idx"][:T]
    negative = np.flatnonzero(blocks < 0)
    if negative.size:
        t = int(negative[0])
        _fail("block ids", f"token {t} of {_describe(record)} has token_to_block_idx "
                           f"{int(blocks[t])}: a negative block is unallocated (or an id "
                           f"that wrapped around in a narrower dtype)")
    rows = f["token_to_request_idx"][:T]
    columns = f["token_to_position_in_request"][:T] // meta.block_size_tokens
    if record.kind == "decode" and _draft_field(meta, "record") is record:
        # The draft loop of this record is still the staged one: its table is the
        # buffer (on the mirror path, the snapshot begin_decode staged).
        _check_draft_ids_fit(meta, record, view_dtype, rows, columns)
    source = record.block_table
    if source is not None and _TABLES_SEEN.get(meta) is not record:
        _TABLES_SEEN[meta] = record  # compared once: the caller may reuse its table
        inherited = None if record.inherited is None else \
            _host(record.inherited).astype(np.int64).reshape(-1)
        _compare_blocks(record, blocks, rows, columns, _host(source).astype(np.int64),
                        inherited, "the block_table it was given")


def _check_draft_ids_fit(meta: Any, record: ForwardRecord, view_dtype: torch.dtype,
                         rows: np.ndarray, columns: np.ndarray) -> None:
    table = _host(meta.block_table).astype(np.int64)
    inside = np.flatnonzero(_in_table(rows, columns, table.shape))
    info = torch.iinfo(view_dtype)
    values = table[rows[inside], columns[inside]]
    bad = np.flatnonzero((values < info.min) | (values > info.max))
    if bad.size:
        t = int(inside[bad[0]])
        _fail("block ids", f"token {t} of {_describe(record)} writes block "
                           f"{int(values[bad[0]])} of the draft loop's block_table (at "
                           f"[{int(rows[t])}, {int(columns[t])}]), which the view's "
                           f"token_to_block_idx dtype {view_dtype} cannot hold: the view "
                           f"holds a wrapped id, another block")


def _in_table(rows: np.ndarray, columns: np.ndarray, shape: tuple) -> np.ndarray:
    """[T] bool: token ``t``'s ``(rows[t], columns[t])`` lies inside a table of ``shape``."""
    return (rows >= 0) & (rows < shape[0]) & (columns >= 0) & (columns < shape[1])


def _compare_blocks(record: ForwardRecord, blocks: np.ndarray, rows: np.ndarray,
                    columns: np.ndarray, table: np.ndarray,
                    inherited: Optional[np.ndarray], what: str) -> None:
    """Each real token not redirected by ``inherited`` holds ``table[row, column]``."""
    inside = _in_table(rows, columns, table.shape)
    if inherited is not None:
        inside &= ~((rows < inherited.shape[0]) &
                    (columns < inherited[np.clip(rows, 0, max(inherited.shape[0] - 1, 0))]))
    tokens = np.flatnonzero(inside)
    expected = table[rows[tokens], columns[tokens]]
    bad = np.flatnonzero(blocks[tokens] != expected)
    if bad.size:
        t = int(tokens[bad[0]])
        _fail("block ids", f"token {t} of {_describe(record)} has token_to_block_idx "
                           f"{int(blocks[t])}, but {what} holds block "
                           f"{int(expected[bad[0]])} at [{int(rows[t])}, "
                           f"{int(columns[t])}]: the id wrapped around in the view's "
                           f"dtype (or the table changed before this check)")


def _record_key(record: ForwardRecord) -> tuple:
    """What identifies one forward's record (also if a record object is ever reused)."""
    return (id(record), record.kind, id(record.gpu_view), id(record.inherited),
            record.token_count, record.padded_token_count, record.request_count,
            record.padded_request_count)


def _draft_offset(meta: Any, record: ForwardRecord) -> int:
    """The annotation row of draft row 0: ``record.first_row``, the
    ``draft_annotation_offset`` its loop began with (a later step's offset describes
    later rows), else the object's; checked to put the draft rows inside the
    annotations."""
    offset = record.first_row
    if offset is None:
        offset = getattr(meta, "draft_annotation_offset", 0)
    count, R = record.token_count, meta.max_requests
    if not isinstance(offset, (int, np.integer)) or not 0 <= offset <= R - count:
        _fail("inherited blocks", f"draft_annotation_offset {offset!r} puts the {count} "
                                  f"draft rows outside the {R} annotation rows")
    return int(offset)


def _inherited_counts(meta: Any, record: ForwardRecord,
                      draft_offset: Optional[int] = None) -> np.ndarray:
    """The inherited counts of ``record``'s forward, copied at its first check: the
    caller's ``inherited`` array, or for a draft depth the annotation rows
    ``[draft_offset, draft_offset + n)``."""
    key = _record_key(record)
    seen = _INHERITED_SEEN.get(meta)
    if seen is not None and seen[0] is record and seen[1] == key:
        return seen[2]
    if draft_offset is None:
        counts = _host(record.inherited).astype(np.int64).reshape(-1).copy()
    else:
        annotations = _host(meta.request_matched_prefix_blocks).astype(np.int64)
        counts = annotations[draft_offset:draft_offset + record.token_count].copy()
    _INHERITED_SEEN[meta] = (record, key, counts)
    return counts


def _check_inherited(meta: Any, record: ForwardRecord, f: Dict[str, np.ndarray],
                     T: int, draft_offset: Optional[int] = None) -> None:
    inherited = _inherited_counts(meta, record, draft_offset)
    rows = f["token_to_request_idx"][:T]
    size = inherited.shape[0]
    outside = np.flatnonzero((rows < -size) | (rows >= size))
    if outside.size:
        t = int(outside[0])
        _fail("inherited blocks", f"token {t} of {_describe(record)} has "
                                  f"token_to_request_idx {int(rows[t])}, outside the "
                                  f"{size} inherited_blocks entries")
    columns = f["token_to_position_in_request"][:T] // meta.block_size_tokens
    blocks = f["token_to_block_idx"][:T]
    bad = np.flatnonzero((columns < inherited[rows]) & (blocks != meta.dummy_block_idx))
    if bad.size and draft_offset is not None:
        t = int(bad[0])
        row = int(rows[t])
        _fail("inherited blocks", f"draft token {t} (draft row {row} = annotation row "
                                  f"{draft_offset + row}, block column {int(columns[t])} "
                                  f"< inherited {int(inherited[row])}) of "
                                  f"{_describe(record)} writes shared block "
                                  f"{int(blocks[t])}; draft depths have no inherited-"
                                  f"block redirect, so a scheduler must never draft into "
                                  f"a request's inherited prefix (with paused rows first, "
                                  f"set draft_annotation_offset to their count)")
    if bad.size:
        t = int(bad[0])
        row = int(rows[t])
        _fail("inherited blocks", f"token {t} (row {row}, block column "
                                  f"{int(columns[t])} < inherited {int(inherited[row])}) "
                                  f"of {_describe(record)} points at block "
                                  f"{int(blocks[t])}, expected dummy_block_idx "
                                  f"{meta.dummy_block_idx}")


def _slots(meta: Any, f: Dict[str, np.ndarray], T: int) -> np.ndarray:
    """The KV slots ``block * BS + local`` the real tokens ``[0, T)`` write, the dummy
    block's left out (redirected, padding or scratch tokens)."""
    blocks = f["token_to_block_idx"][:T]
    local = f["token_to_local_position_within_kv_block"][:T]
    slots = blocks * meta.block_size_tokens + local
    return np.where(blocks == meta.dummy_block_idx, -1, slots)


def _check_committed_slots(meta: Any, record: ForwardRecord, f: Dict[str, np.ndarray],
                           T: int) -> None:
    """A commit pass's slots are kept at its first check; a depth of the draft loop
    begun right after it (``meta._draft.loop_after`` is that pass's record) must not write
    one that the same request committed (draft row ``i`` and commit-pass request ``i``
    are one request: both are annotation row ``draft_annotation_offset + i``): depth
    ``d`` writes ``start + d``, past what the pass committed, so a hit means the draft
    overwrites committed KV (e.g. ``begin_decode`` given the per-row start positions
    instead of the active requests' ``start + count``). Slots of other requests are
    not compared: whether two requests may share a block is the scheduler's business.
    Only while ``draft_annotation_offset`` is non-zero (paused rows first): that is
    when a per-row array differs from the active requests' starts, and a start at or
    before a committed position is otherwise valid input (the spec tests use them)."""
    if record.kind == "commit":
        seen = _COMMITS_SEEN.get(meta)
        if seen is None or seen[0] is not record or seen[1] != _record_key(record):
            _COMMITS_SEEN[meta] = (record, _record_key(record), _slots(meta, f, T),
                                   f["token_to_request_idx"][:T].astype(np.int64))
        return
    offset = record.first_row if record.first_row is not None else \
        meta.draft_annotation_offset
    if record.kind != "decode" or not T or not offset or \
            _draft_field(meta, "record") is not record:
        return  # with no paused rows first, the per-row starts are the active ones
    commit = _draft_field(meta, "loop_after")
    seen = _COMMITS_SEEN.get(meta)
    if commit is None or seen is None or seen[0] is not commit or \
            seen[1] != _record_key(commit):
        return  # no commit pass right before this loop, or none that was checked
    draft = _slots(meta, f, T)
    committed = {(int(r), int(slot)) for r, slot in zip(seen[3], seen[2]) if slot >= 0}
    requests = f["token_to_request_idx"][:T]
    hits = [t for t in range(T)
            if draft[t] >= 0 and (int(requests[t]), int(draft[t])) in committed]
    if hits:
        t = hits[0]
        row, position = (int(f[name][t]) for name in ("token_to_request_idx",
                                                      "token_to_position_in_request"))
        block, local = divmod(int(draft[t]), meta.block_size_tokens)
        _fail("committed KV", f"draft token {t} (draft row {row}, "
                              f"position {position}) of {_describe(record)} writes block "
                              f"{block} local {local}, a slot the commit pass before this "
                              f"draft loop wrote (its token "
                              f"{_first(seen, draft[t], requests[t])}): depth 0 "
                              f"writes start_positions[i], which must lie past what the "
                              f"pass committed (start + count of active request i), not a "
                              f"per-row array that paused rows shift")


def _draft_field(meta: Any, name: str) -> Any:
    """Field ``name`` of ``meta``'s draft loop (``mtpmeta.calls.draft_loop``), None for
    an object without one."""
    draft = getattr(meta, "_draft", None)
    return None if draft is None else getattr(draft, name)


def _first(seen: Any, slot: int, request: int) -> int:
    """The commit token of ``request`` that wrote ``slot`` (``seen`` as kept above)."""
    return int(np.flatnonzero((seen[2] == slot) & (seen[3] == request))[0])


def _check_request_slots(record: ForwardRecord, view: Any) -> None:
    n, padded = record.request_count, record.padded_request_count
    f = _read_fields(view, _REQUEST_NAMES, padded)
    where = f"pad slots [{n}, {padded}) of {_describe(record)}"
    for name in ("mha_query_lengths", "mha_kv_seq_lengths"):
        values = f[name]
        bad = np.flatnonzero(values[n:] != 0)
        if bad.size:
            i = n + int(bad[0])
            _fail("padded request slots", f"slot {i} ({where}) has {name} "
                                          f"{int(values[i])}, expected 0")
    for name in ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths"):
        cu = f[name]
        bad = np.flatnonzero(cu[n + 1:padded + 1] != cu[n])
        if bad.size:
            i = n + 1 + int(bad[0])
            _fail("padded request slots", f"{name}[{i}] = {int(cu[i])} ({where}), "
                                          f"expected flat at cu[{n}] = {int(cu[n])}")
    table = f["mha_block_table"]
    bad_rows = np.flatnonzero((table[n:] != -1).any(axis=1))
    if bad_rows.size:
        i = n + int(bad_rows[0])
        _fail("padded request slots", f"slot {i} ({where}) has mha_block_table row "
                                      f"{table[i].tolist()}, expected all -1")
    for name in ("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths"):
        cu = f[name]
        if cu[0] != 0:
            _fail("cu arrays", f"{name}[0] = {int(cu[0])} after {_describe(record)}, "
                               "expected 0")
        drops = np.flatnonzero(np.diff(cu) < 0)
        if drops.size:
            i = int(drops[0]) + 1
            _fail("cu arrays", f"{name} decreases at slot {i}: cu[{i - 1}] = "
                               f"{int(cu[i - 1])} > cu[{i}] = {int(cu[i])} (over [0, "
                               f"{padded}] of {_describe(record)})")
    if record.kind == "commit":
        total = int(f["mha_cu_query_seq_lengths"][padded])
        if total != record.padded_token_count:
            _fail("cu arrays", f"mha_cu_query_seq_lengths[{padded}] = {total} after the "
                               f"last commit pass, expected the padded token count "
                               f"{record.padded_token_count}")
