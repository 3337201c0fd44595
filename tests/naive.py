"""Plain numpy twins of the numba kernels in ``native/`` (stumpy's ``tests/naive.py``).

Each twin takes the kernel's inputs and returns what the kernel returns plus fresh copies
of the arrays it writes, instead of writing in place. They are written the obvious way
(fancy indexing, ``cumsum``, Python ints) so that they share no loop with the kernels;
where the kernels trust their caller, so do the twins. No numba here.

Terms as in ``native/staging.py``: ``BS`` block size, ``D`` the dummy block. The five
token outputs are ``(pos_ids, block_idx, local_pos, request_idx, position_in_request)``
and the five MHA outputs ``(query_lengths, kv_lengths, cu_query, cu_kv, block_table)``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

# Codes of native.checks.check_token_inputs / check_commit_inputs, restated so that a
# renumbering in the kernel module shows up as a failure.
TOKENS_OK, ROW_OUT_OF_TABLE, ROW_OUT_OF_INHERITED = 0, 1, 2
NEGATIVE_POSITION, BLOCK_COLUMN_TOO_LARGE, NEGATIVE_COUNT = 3, 4, 5
# Codes of native.carry.check_take.
CARRY_OK, CARRY_NOT_VALID, CARRY_OTHER_REQUEST, CARRY_OTHER_POSITION = 0, 1, 2, 3

Arrays = List[np.ndarray]


def _first(mask: np.ndarray) -> int:
    """Index of the first True, else -1."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else -1


# ------------------------------------------------------------------------------ rows
def first_row_outside(rows: np.ndarray, num_rows: int) -> int:
    return _first((rows < -num_rows) | (rows >= num_rows))


def first_pair_outside(src: np.ndarray, dst: np.ndarray, num_rows: int) -> int:
    bad = first_row_outside(src, num_rows)
    if bad >= 0:
        return bad
    bad = first_row_outside(dst, num_rows)
    return len(src) + bad if bad >= 0 else -1


def reset_rows(values: np.ndarray, rows: np.ndarray) -> Tuple[int, np.ndarray]:
    out = values.copy()
    bad = first_row_outside(rows, len(values))
    if bad < 0:
        out[rows] = 0  # numpy wraps negative rows the same way
    return bad, out


def move_rows(values: np.ndarray, src: np.ndarray,
              dst: np.ndarray) -> Tuple[int, np.ndarray]:
    """``out[dst[i]] = values[src[i]]`` in order (a repeated destination: the last wins)."""
    out = values.copy()
    bad = first_pair_outside(src, dst, len(values))
    if bad < 0:
        for s, d in zip(src, dst):
            out[d] = values[s]
    return bad, out


def swap_rows(values: np.ndarray, src: np.ndarray,
              dst: np.ndarray) -> Tuple[int, np.ndarray]:
    """All ``out[dst[i]] = values[src[i]]``, then all ``out[src[i]] = values[dst[i]]``."""
    out = values.copy()
    bad = first_pair_outside(src, dst, len(values))
    if bad < 0:
        for s, d in zip(src, dst):
            out[d] = values[s]
        for s, d in zip(src, dst):
            out[s] = values[d]
    return bad, out


# ----------------------------------------------------------------------------- carry
def check_take(state: Sequence[int], req_id: int, seam_position: int) -> int:
    valid, owner, position = (int(v) for v in state)
    if not valid:
        return CARRY_NOT_VALID
    if owner != req_id:
        return CARRY_OTHER_REQUEST
    return CARRY_OTHER_POSITION if position != seam_position else CARRY_OK


# ---------------------------------------------------------------------------- checks
def first_outside(values: np.ndarray, low: int, high: int) -> int:
    return _first((values < low) | (values >= high))


def first_outside_closed(values: np.ndarray, low: int, high: int) -> int:
    return _first((values < low) | (values > high))


def first_bad_token_block(rows: np.ndarray, positions: np.ndarray, table: np.ndarray,
                          inherited: Optional[np.ndarray], block_size: int, width: int,
                          high: int) -> Tuple[int, int]:
    for t, (row, position) in enumerate(zip(rows.tolist(), positions.tolist())):
        column = position // block_size
        if inherited is not None:
            protected = int(inherited[row])
            if not 0 <= protected <= width:
                return 1, t
            if column < protected:
                continue
        if not 0 <= int(table[row, column]) <= high:
            return 2, t
    return 0, -1


def first_bad_commit_block(counts: np.ndarray, starts: Optional[np.ndarray],
                           table: np.ndarray, inherited: Optional[np.ndarray],
                           block_size: int, width: int, high: int) -> Tuple[int, int, int]:
    for r, count in enumerate(counts.tolist()):
        protected = 0 if inherited is None else int(inherited[r])
        if not 0 <= protected <= width:
            return 1, r, -1
        start = 0 if starts is None else int(starts[r])
        columns = sorted({p // block_size for p in range(start, start + count)})
        for column in columns:
            if column >= protected and not 0 <= int(table[r, column]) <= high:
                return 2, r, column
    return 0, -1, -1


def first_bad_draft_block(offsets: np.ndarray, table: np.ndarray, count: int,
                          block_size: int, high: int) -> int:
    head = offsets[:count].astype(np.int64)
    columns = head // block_size
    inside = (head >= 0) & (columns < table.shape[1])
    blocks = np.where(inside, table[np.arange(count), np.clip(columns, 0,
                                                               table.shape[1] - 1)], 0)
    return _first(inside & ((blocks < 0) | (blocks > high)))


def min_max(values: np.ndarray, count: int) -> Tuple[int, int]:
    if count == 0:
        return 0, -1
    head = values[:count]
    return int(head.min()), int(head.max())


# --------------------------------------------------------------------------- staging
def offsets_in_table(offsets: np.ndarray, count: int, block_size: int, width: int) -> bool:
    head = offsets[:count].astype(np.int64)
    return bool(np.all((head >= 0) & (head // block_size < width)))


def copy_decode_inputs(start_positions: np.ndarray, table_src: np.ndarray, count: int,
                       block_size: int, offsets: np.ndarray,
                       block_table: np.ndarray) -> Tuple[bool, np.ndarray, np.ndarray]:
    offsets, block_table = offsets.copy(), block_table.copy()
    ok = offsets_in_table(start_positions, count, block_size, block_table.shape[1])
    if ok:
        offsets[:count] = start_positions[:count]
        block_table[:count] = table_src[:count]
    return ok, offsets, block_table


def fill_capture_state(offsets: np.ndarray, block_table: np.ndarray, count: int,
                       dummy: int) -> Tuple[np.ndarray, np.ndarray]:
    offsets, block_table = offsets.copy(), block_table.copy()
    offsets[:count] = 0
    block_table[:count] = dummy
    return offsets, block_table


def advance_offsets(offsets: np.ndarray, count: int) -> np.ndarray:
    out = offsets.copy()
    out[:count] += 1
    return out


def stage_decode_lengths(offsets: np.ndarray, count: int, query_lengths: np.ndarray,
                         kv_lengths: np.ndarray) -> Tuple[int, np.ndarray, np.ndarray]:
    q, kv = query_lengths.copy(), kv_lengths.copy()
    q[:count] = 1
    kv[:count] = offsets[:count].astype(np.int64) + 1
    return (int(kv[:count].max()) if count else 0), q, kv


def check_token_inputs(rows: np.ndarray, positions: np.ndarray, num_table_rows: int,
                       num_inherited: Optional[int], max_columns: int,
                       block_size: int) -> Tuple[int, int]:
    """``num_inherited`` None: no inherited counts were given."""
    positions = positions.astype(np.int64)
    codes = np.select(
        [(rows < 0) | (rows >= num_table_rows),
         np.full(rows.shape, num_inherited is not None)
         & (rows >= (num_inherited if num_inherited is not None else 0)),
         positions < 0,
         positions // block_size >= max_columns],
        [ROW_OUT_OF_TABLE, ROW_OUT_OF_INHERITED, NEGATIVE_POSITION, BLOCK_COLUMN_TOO_LARGE],
        TOKENS_OK)
    bad = _first(codes != TOKENS_OK)
    return (int(codes[bad]), bad) if bad >= 0 else (TOKENS_OK, -1)


def token_maps(rows: np.ndarray, positions: np.ndarray, block_table: np.ndarray,
               inherited: Optional[np.ndarray], padded: int, block_size: int, dummy: int,
               outputs: Sequence[np.ndarray]) -> Arrays:
    """The five token outputs after ``write_token_maps`` (copies of ``outputs``)."""
    pos_ids, block_idx, local_pos, request_idx, position_in_request = (
        o.copy() for o in outputs)
    count = len(positions)
    positions = positions.astype(np.int64)
    columns = positions // block_size
    blocks = block_table[rows, columns].astype(np.int64)
    if inherited is not None:
        blocks[columns < inherited[rows]] = dummy
    block_idx[:count] = blocks
    local_pos[:count] = positions % block_size
    request_idx[:count] = rows
    position_in_request[:count] = positions
    pos_ids[:count] = positions
    block_idx[count:padded] = dummy
    local_pos[count:padded] = 0
    return [pos_ids, block_idx, local_pos, request_idx, position_in_request]


def check_commit_inputs(counts: np.ndarray, starts: Optional[np.ndarray], max_columns: int,
                        block_size: int) -> Tuple[int, int, int, int]:
    """In Python ints, so no sum can wrap."""
    counts = [int(c) for c in counts]
    for r, count in enumerate(counts):
        start = int(starts[r]) if starts is not None else 0
        if count < 0 or count >= 2**31:
            return NEGATIVE_COUNT, r, 0, 0
        if start < 0:
            return NEGATIVE_POSITION, r, 0, 0
        if count > 0 and (start + count - 1) // block_size >= max_columns:
            return BLOCK_COLUMN_TOO_LARGE, r, 0, 0
    return TOKENS_OK, -1, sum(counts), max(counts, default=0)


def commit_rows_positions(counts: np.ndarray,
                          starts: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """Request ``r`` owns row ``r`` and writes ``starts[r] + 0 .. counts[r] - 1``."""
    counts = counts.astype(np.int64)
    rows = np.repeat(np.arange(len(counts)), counts)
    first_token = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    offsets = np.arange(len(rows)) - first_token[rows]
    base = starts.astype(np.int64)[rows] if starts is not None else 0
    return rows, base + offsets


def stage_prefill_lengths(counts: np.ndarray, pad_tokens: int, max_requests: int,
                          lengths: np.ndarray) -> Tuple[int, np.ndarray]:
    out = lengths.copy()
    staged = list(counts)
    if pad_tokens > 0:
        if len(staged) < max_requests:
            staged.append(pad_tokens)
        else:
            staged[-1] += pad_tokens
    out[:len(staged)] = staged
    return len(staged), out


def mha_metadata(query_lengths: np.ndarray, kv_lengths: np.ndarray, count: int,
                 block_table: np.ndarray, num_table_rows: int, padded: int, dummy: int,
                 outputs: Sequence[np.ndarray]) -> Tuple[Tuple[int, int], Arrays]:
    """``((max_q, max_kv), the five MHA outputs)`` after ``write_mha_metadata``."""
    q_out, kv_out, cu_q, cu_kv, table = (o.copy() for o in outputs)
    q = query_lengths[:count].astype(np.int64)
    kv = kv_lengths[:count].astype(np.int64)
    padding = max(padded - count, 0)
    q_out[:count], kv_out[:count] = q, kv
    q_out[count:padded] = 0
    kv_out[count:padded] = 0
    cu_q[:count + 1 + padding] = np.concatenate([[0], np.cumsum(q), np.full(padding, q.sum())])
    cu_kv[:count + 1 + padding] = np.concatenate([[0], np.cumsum(kv),
                                                  np.full(padding, kv.sum())])
    table[:num_table_rows] = block_table[:num_table_rows]
    table[num_table_rows:count] = dummy
    table[count:padded] = -1
    maxima = (int(q.max()) if count else 0, int(kv.max()) if count else 0)
    return maxima, [q_out, kv_out, cu_q, cu_kv, table]


def decode_step(offsets: np.ndarray, block_table: np.ndarray, count: int, padded: int,
                block_size: int, dummy: int, high: int, query_lengths: np.ndarray,
                kv_lengths: np.ndarray,
                kernel_outputs: Sequence[np.ndarray]
                ) -> Tuple[int, np.ndarray, np.ndarray, Arrays]:
    """``(max_kv, query_lengths, kv_lengths, the ten view outputs)``; max_kv is
    ``-2 - row`` for the first row writing a bad block, -1 for a bad offset."""
    bad_row = first_bad_draft_block(offsets, block_table, count, block_size, high)
    if bad_row >= 0 or not offsets_in_table(offsets, count, block_size,
                                            block_table.shape[1]):
        return (-2 - bad_row if bad_row >= 0 else -1), query_lengths.copy(), \
            kv_lengths.copy(), [v.copy() for v in kernel_outputs]
    tokens = token_maps(np.arange(count), offsets[:count], block_table, None, padded,
                        block_size, dummy, kernel_outputs[:5])
    max_kv, q, kv = stage_decode_lengths(offsets, count, query_lengths, kv_lengths)
    _, mha = mha_metadata(q, kv, count, block_table, count, padded, dummy, kernel_outputs[5:])
    return max_kv, q, kv, tokens + mha


def commit_pass(counts: np.ndarray, starts: Optional[np.ndarray], block_table: np.ndarray,
                inherited: Optional[np.ndarray], padded_tokens: int, pad_tokens: int,
                max_requests: int, min_padded_requests: int, block_size: int, dummy: int,
                lengths: np.ndarray, kernel_outputs: Sequence[np.ndarray],
                first_table_row: int = 0, width: int = 0, high: int = 2**62
                ) -> Tuple[Tuple[int, int, int, int], np.ndarray, Arrays]:
    """``((T, m, padded_requests, max_len), lengths, the ten view outputs)``; with
    ``first_table_row`` the table output holds the full table's rows from there on,
    shifted to row 0, and nothing else changes in it. A bad written block or inherited
    count (``first_bad_commit_block`` with ``width``, ``high``) returns
    ``((-code, r, column, 0), ...)`` with nothing changed."""
    code, r, column = first_bad_commit_block(counts, starts, block_table, inherited,
                                             block_size, width, high)
    if code:
        return (-code, r, column, 0), lengths.copy(), [v.copy() for v in kernel_outputs]
    rows, positions = commit_rows_positions(counts, starts)
    protected = None if inherited is None else inherited[:len(counts)]
    tokens = token_maps(rows, positions, block_table, protected, padded_tokens,
                        block_size, dummy, kernel_outputs[:5])
    staged, lengths = stage_prefill_lengths(counts, pad_tokens, max_requests, lengths)
    padded_requests = max(min_padded_requests, staged)
    (max_len, _), mha = mha_metadata(lengths, lengths, staged, block_table, len(counts),
                                     padded_requests, dummy, kernel_outputs[5:])
    if pad_tokens > 0 and staged == len(counts):  # the last request absorbs the pad
        last = len(counts) - 1
        span_end = int(counts[last]) + (0 if starts is None else int(starts[last]))
        first_unwritten = -(-span_end // block_size)
        mha[-1][last, first_unwritten:] = dummy
    if first_table_row:
        shifted = kernel_outputs[-1].copy()
        kept = padded_requests - first_table_row
        shifted[:kept] = mha[-1][first_table_row:padded_requests]
        mha[-1] = shifted
    return (len(rows), staged, padded_requests, max_len), lengths, tokens + mha


def matching_rows(block_table: np.ndarray, truth: np.ndarray, count: int) -> int:
    width = truth.shape[1]
    for i in range(count):
        if not np.array_equal(block_table[i, :width].astype(np.int64),
                              truth[i].astype(np.int64)):
            return i
    return count


def used_columns(table_src: np.ndarray, count: int, counts_out: np.ndarray) -> int:
    """Per row, 1 + the last column that is not -1 (0 for a row of -1 only)."""
    largest = 0
    for i in range(count):
        real = np.flatnonzero(table_src[i] != -1)
        counts_out[i] = int(real[-1]) + 1 if real.size else 0
        largest = max(largest, int(counts_out[i]))
    return largest
