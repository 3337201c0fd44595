"""Debug checks of ``MTPMetadata``'s invariants (``meta.check_invariants(view)``).

A debug tool, not a hot-path one: every check is plain numpy over ``.cpu().numpy()``
reads of the persistent buffers and of the destination view, so on CUDA it syncs. Each
check raises ``InvariantError`` explicitly (it still fires under ``python -O``) with a
message that starts with the invariant's name and names the offending row, token or
slot, e.g. ``"padded token rows: token 5 (pad rows [3, 6) of the last decode forward)
has token_to_block_idx 12, expected dummy_block_idx 999"``.

The invariants, in the order they are checked:

- ``forward mode``: a disabled object is NONE and holds no buffers; an unallocated one
  holds no buffers; DRAFT has active views (prefixes of the buffers, ``n`` long);
  COMMIT was entered by ``setup_commit_pass``: the last view-writing call is that pass
  or a writer call made during it (kind commit/tokens/mha), never a draft depth.
- ``annotations``: ``request_matched_prefix_blocks`` lie in ``[0, W]``.
- ``draft offsets``: while DRAFT, ``offsets[:n]`` lie in ``[0, W * BS]``. The upper
  end is inclusive: a loop that drafts into a request's last slot leaves that offset one
  past it after its final ``advance_decode_step`` (``setup_decode_step`` refuses to
  write from there).
- ``padded token rows`` (last forward of kind decode/commit/tokens): token rows
  ``[T, padded)`` point at ``dummy_block_idx`` with local offset 0.
- ``padded request slots`` (kinds decode/commit/mha): slots ``[n, padded)`` have zero
  query and KV lengths, both ``cu_*`` arrays flat at ``cu[n]``, all -1 block rows.
- ``cu arrays`` (same kinds): ``cu[0] == 0``, non-decreasing over ``[0, padded]``; after
  a commit pass ``mha_cu_query_seq_lengths[padded]`` is the padded token count.
- ``block ids`` (kinds decode/commit/tokens): no real token holds a negative block
  (unallocated, or an id wrapped into a narrower dtype); a draft token's block in the
  draft loop's ``block_table`` fits the view's ``token_to_block_idx`` dtype (else the
  view holds a wrapped id); a device-route ``write_token_maps`` (record
  ``block_table``) and ``begin_decode`` (``meta._unchecked_table``), whose ids the
  host did not check, hold exactly the ids they were given: compared once, at the
  first check after the call.
- ``inherited blocks`` (a last forward with ``inherited``): no real token whose block
  column is below its row's inherited count points at a real block. A draft depth
  (kind decode) has no redirect at all, so there the rule catches a broken scheduler:
  draft row ``i`` belongs to annotation row ``meta.draft_annotation_offset + i`` (the
  active slice; the offset is the paused-row count when paused rows come first, 0 by
  default), and its token must not land in one of that row's inherited blocks.
- ``committed KV`` (kinds commit/decode): a depth of the draft loop whose
  ``begin_decode`` came right after a commit pass (no view-writing call between) does
  not write a KV slot (block, local offset; the dummy block aside) that pass wrote:
  the loop writes past what the pass committed. The pass's slots are read at its first
  check, so this needs a check after the commit pass (``MTPMETA_DEBUG=1`` makes one).

The view checks read ``gpu_view`` when given, else ``meta.last_forward.gpu_view``; they
assume the view still holds what the last MTP write put there (a view another writer
shares must be checked right after the MTP forward). ``last_forward.inherited`` is a
copy the call took of the caller's counts, which the scheduler may legitimately change
afterwards (a row move of the annotations, a new prefix hit). A draft depth has no such
input: its counts are read from ``request_matched_prefix_blocks`` at the first check of
its record and kept for later checks of that record.

``install_debug_checks(cls)`` wraps the public methods so each call is followed by a
check; ``mtpmeta.metadata`` calls it at import when ``MTPMETA_DEBUG=1``.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import weakref
from typing import Any, Dict, Optional

import numpy as np
import torch

from .buffers import BUFFER_NAMES
from .errors import InvariantError
from .gpu_view import ViewTarget
from .types import ForwardRecord, MTPForwardMode

__all__ = ["check_invariants", "install_debug_checks", "InvariantError"]

TOKEN_KINDS = ("decode", "commit", "tokens")  # records that wrote token rows
REQUEST_KINDS = ("decode", "commit", "mha")  # records that wrote request slots
# Records a COMMIT forward can end on: its pass, or writer calls made during it (the
# writers run in any mode; setup_decode_step needs DRAFT, so "decode" never follows).
COMMIT_KINDS = ("commit", "tokens", "mha")

# meta -> (record, _record_key, copy of record.inherited at the record's first check)
_INHERITED_SEEN: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
# meta -> the record whose device-route block_table was compared (at its first check)
_TABLES_SEEN: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
# meta -> (commit record, _record_key, [T] int64 KV slots it wrote, -1 for the dummy)
_COMMITS_SEEN: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _fail(invariant: str, detail: str) -> None:
    raise InvariantError(f"{invariant}: {detail}")


def _host(value: Any) -> np.ndarray:
    """A numpy array of ``value`` (a tensor anywhere, an array or a sequence)."""
    if isinstance(value, torch.Tensor):
        return value.cpu().numpy()
    return np.asarray(value)


# ---------------------------------------------------------------------- object state
def _check_forward_mode(meta: Any) -> bool:
    """The mode/buffer checks; returns whether the object holds buffers."""
    mode = meta.forward_mode
    held = [name for name in BUFFER_NAMES if getattr(meta, name) is not None]
    if not meta.enabled:
        if mode is not MTPForwardMode.NONE:
            _fail("forward mode", f"a disabled object must stay NONE, found {mode.name}")
        if held or meta.mirror is not None:
            _fail("forward mode", f"a disabled object must hold no buffers, holds "
                                  f"{held or ['a backend']}")
        return False
    if meta.mirror is None:  # enabled, not allocated (or deallocated)
        if held:
            _fail("forward mode", f"an unallocated object must hold no buffers, holds "
                                  f"{held}")
    elif len(held) != len(BUFFER_NAMES):
        missing = sorted(set(BUFFER_NAMES) - set(held))
        _fail("forward mode", f"an allocated object must hold every buffer, missing "
                              f"{missing}")
    if mode is MTPForwardMode.DRAFT:
        _check_active_views(meta)
    elif mode is MTPForwardMode.COMMIT:
        record = meta.last_forward
        kind = None if record is None else record.kind
        if kind not in COMMIT_KINDS:
            _fail("forward mode", f"COMMIT is entered by setup_commit_pass (writer calls "
                                  f"may follow it), but the last view-writing call was "
                                  f"{kind!r}")
    return bool(held)


def _check_active_views(meta: Any) -> None:
    offsets, table = meta.active_offsets, meta.active_block_table
    if offsets is None or table is None:
        _fail("forward mode", "DRAFT needs the active views (active_offsets, "
                              "active_block_table) that begin_decode sets; they are None")
    n, padded = meta.active_request_count, meta.padded_count
    if offsets.shape[0] != n or table.shape[0] != n:
        _fail("forward mode", f"DRAFT active views hold {offsets.shape[0]} offsets and "
                              f"{table.shape[0]} table rows, active_request_count is {n}")
    if not n <= padded <= meta.max_requests:
        _fail("forward mode", f"DRAFT padded_count {padded} outside [active_request_count "
                              f"{n}, max_requests {meta.max_requests}]")
    if meta.offsets is not None and n and (
            offsets.data_ptr() != meta.offsets.data_ptr()
            or table.data_ptr() != meta.block_table.data_ptr()):
        _fail("forward mode", "DRAFT active views are not prefixes of the persistent "
                              "offsets/block_table buffers")


def _check_annotations(meta: Any) -> None:
    annotations = _host(meta.request_matched_prefix_blocks)
    W = meta.max_kv_block_count
    bad = np.flatnonzero((annotations < 0) | (annotations > W))
    if bad.size:
        row = int(bad[0])
        _fail("annotations", f"request_matched_prefix_blocks[{row}] = "
                             f"{int(annotations[row])} outside [0, max_kv_block_count {W}]")


def _check_draft_offsets(meta: Any) -> None:
    if meta.forward_mode is not MTPForwardMode.DRAFT:
        return
    n = meta.active_request_count
    offsets = _host(meta.offsets)[:n].astype(np.int64)
    limit = meta.max_kv_block_count * meta.block_size_tokens
    bad = np.flatnonzero((offsets < 0) | (offsets > limit))
    if bad.size:
        i = int(bad[0])
        _fail("draft offsets", f"offsets[{i}] = {int(offsets[i])} (request {i} of {n}) "
                               f"outside [0, max_kv_block_count * block_size_tokens = "
                               f"{limit}]")


def _check_device_table_copy(meta: Any) -> None:
    """A ``begin_decode`` given a device block table (not value-checked on the host):
    at the first check after it, ``block_table[:n]`` must equal what it was given; an
    id that ``block_table_dtype`` cannot hold differs (the copy wrapped it)."""
    pending = getattr(meta, "_unchecked_table", None)
    if pending is None or meta.block_table is None:
        return
    meta._unchecked_table = None  # compared once: the caller may reuse its tensor
    source, count = pending
    given = _host(source)[:count].astype(np.int64)
    held = _host(meta.block_table)[:count].astype(np.int64)
    bad = np.argwhere(given != held)
    if bad.size:
        i, c = (int(x) for x in bad[0])
        _fail("block ids", f"block_table[{i}, {c}] = {int(held[i, c])}, but begin_decode "
                           f"was given {int(given[i, c])}: an id block_table_dtype "
                           f"{meta.block_table_dtype} cannot hold wrapped around into "
                           f"another block (device inputs are not value-checked)")


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
        array = tensor.cpu().numpy()
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
        _check_inherited(meta, record, f, T, draft_offset=_draft_offset(meta, T))
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
    if record.kind == "decode" and getattr(meta, "_decode_record", None) is record:
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


def _draft_offset(meta: Any, count: int) -> int:
    """``meta.draft_annotation_offset``, checked to put ``count`` draft rows inside the
    annotations."""
    offset = getattr(meta, "draft_annotation_offset", 0)
    R = meta.max_requests
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
    begun right after it (``meta._loop_after`` is that pass's record) must not write
    one that the same request committed (draft row ``i`` and commit-pass request ``i``
    are one request: both are annotation row ``draft_annotation_offset + i``): depth
    ``d`` writes ``start + d``, past what the pass committed, so a hit means the draft
    overwrites committed KV (e.g. ``begin_decode`` given the per-row start positions
    instead of the active requests' ``start + count``). Slots of other requests are
    not compared: whether two requests may share a block is the scheduler's business."""
    if record.kind == "commit":
        seen = _COMMITS_SEEN.get(meta)
        if seen is None or seen[0] is not record or seen[1] != _record_key(record):
            _COMMITS_SEEN[meta] = (record, _record_key(record), _slots(meta, f, T),
                                   f["token_to_request_idx"][:T].astype(np.int64))
        return
    if record.kind != "decode" or not T or \
            getattr(meta, "_decode_record", None) is not record:
        return
    commit = getattr(meta, "_loop_after", None)
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


# ---------------------------------------------------------------------------- entry
def check_invariants(meta: Any, gpu_view: Optional[Any] = None) -> None:
    """Check every invariant of ``meta`` and of its last forward's destination view.

    ``gpu_view`` defaults to ``meta.last_forward.gpu_view``; the view checks are skipped
    when there is no last forward or no view. Raises ``InvariantError`` (an
    ``AssertionError``, raised explicitly) naming the first broken invariant and the
    offending row, token or slot. May sync (it reads device buffers back).
    """
    if gpu_view is not None:
        ViewTarget(gpu_view)  # a ValueError naming the field for a non-view argument
    if not _check_forward_mode(meta):
        return
    _check_annotations(meta)
    _check_draft_offsets(meta)
    _check_device_table_copy(meta)
    record = meta.last_forward
    if record is None:
        return
    view = gpu_view if gpu_view is not None else record.gpu_view
    if view is None:
        return
    if record.kind in TOKEN_KINDS:
        _check_token_rows(meta, record, view)
    if record.kind in REQUEST_KINDS:
        _check_request_slots(record, view)


# ------------------------------------------------------------------- debug wrapping
_IN_CALL = threading.local()  # ids of objects inside a checked call, per thread


def _checked(method: types.FunctionType) -> Any:
    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        busy = _IN_CALL.__dict__.setdefault("ids", set())
        if id(self) in busy:  # a public method called from another: check once, outside
            return method(self, *args, **kwargs)
        busy.add(id(self))
        try:
            result = method(self, *args, **kwargs)
        finally:
            busy.discard(id(self))
        check_invariants(self)
        return result

    checked.__invariant_checked__ = True
    return checked


def install_debug_checks(cls: type) -> None:
    """Wrap every public method of ``cls`` (properties and ``check_invariants`` aside)
    so that ``check_invariants(self)`` runs after each call that returns normally (a
    call that raises keeps its own exception). Nested public calls are checked once, by
    the outermost. Idempotent; a subclass can be wrapped without touching its base."""
    for name in dir(cls):
        if name.startswith("_") or name == "check_invariants":
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, types.FunctionType) and \
                not getattr(member, "__invariant_checked__", False):
            setattr(cls, name, _checked(member))
