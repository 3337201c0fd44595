"""Bound scans for the validating wrappers: each returns the index of the first
offending element, or -1 when every element is in bounds."""

import numpy as np
from numba import njit


@njit(cache=True)
def first_outside(values, low, high):
    """First ``i`` with ``not (low <= values[i] < high)``, else -1. values: int [K].

    >>> first_outside(np.array([0, 5, -1, 9]), 0, 8), first_outside(np.array([7]), 0, 8)
    (2, -1)
    """
    for i in range(values.shape[0]):
        value = values[i]
        if value < low or value >= high:
            return i
    return -1


@njit(cache=True)
def min_max(values, count):
    """``(min, max)`` of ``values[:count]`` as int64; ``(0, -1)`` when count is 0.

    >>> min_max(np.array([4, -2, 9, 1]), 3), min_max(np.array([4]), 0)
    ((-2, 9), (0, -1))
    """
    if count == 0:
        return 0, -1
    low = values[0]
    high = values[0]
    for i in range(1, count):
        value = values[i]
        if value < low:
            low = value
        if value > high:
            high = value
    return low, high


@njit(cache=True)
def total_of(values):
    """The sum of ``values`` as int64 (a commit pass's token total).

    >>> total_of(np.array([3, 0, 5]))
    8
    """
    total = 0
    for i in range(values.shape[0]):
        total += values[i]
    return total


@njit(cache=True)
def first_outside_closed(values, low, high):
    """First ``i`` with ``not (low <= values[i] <= high)``, else -1: ``first_outside``
    with an inclusive upper bound, so ``high`` may be a dtype's maximum. values: int [K].

    >>> first_outside_closed(np.array([0, 127, 128]), -128, 127)
    2
    """
    for i in range(values.shape[0]):
        value = values[i]
        if value < low or value > high:
            return i
    return -1


# Codes of ``first_bad_token_block`` and ``staging.first_bad_commit_block`` (the two
# block scans the staging kernels run first live in ``staging``: numba's on-disk cache
# does not track other files).
from .staging import (BAD_WRITTEN_BLOCK, BLOCKS_OK, INHERITED_OUT_OF_RANGE,  # noqa: E402,F401
                      first_bad_commit_block)
# Codes of ``check_token_inputs`` / ``check_commit_inputs`` below: defined with every
# other kernel status code in ``staging``, the module ``mtpmeta.validation.bounds`` decodes.
from .staging import (BLOCK_COLUMN_TOO_LARGE, NEGATIVE_COUNT, NEGATIVE_POSITION,  # noqa: E402,F401
                      ROW_OUT_OF_INHERITED, ROW_OUT_OF_TABLE, TOKENS_OK)


@njit(cache=True)
def check_token_inputs(rows, positions, num_table_rows, num_inherited, has_inherited,
                       max_columns, block_size):
    """Scan ``(rows, positions)`` [T] for the first bad token; return ``(code, t)``.

    Codes: ROW_OUT_OF_TABLE (row not in [0, num_table_rows)), ROW_OUT_OF_INHERITED
    (row >= num_inherited), NEGATIVE_POSITION, BLOCK_COLUMN_TOO_LARGE
    (position // block_size >= max_columns); ``(TOKENS_OK, -1)`` when all are good.

    >>> rows, positions = np.array([0, 1, 1]), np.array([3, 9, 16])  # block size 8
    >>> check_token_inputs(rows, positions, 2, 0, False, 2, 8)  # 16 // 8 = 2 >= 2 columns
    (4, 2)
    >>> check_token_inputs(rows, positions, 2, 1, True, 2, 8)  # row 1 >= 1 inherited
    (2, 1)
    """
    for t in range(positions.shape[0]):
        row = rows[t]
        if row < 0 or row >= num_table_rows:
            return ROW_OUT_OF_TABLE, t
        if has_inherited and row >= num_inherited:
            return ROW_OUT_OF_INHERITED, t
        position = np.int64(positions[t])
        if position < 0:
            return NEGATIVE_POSITION, t
        if position // block_size >= max_columns:
            return BLOCK_COLUMN_TOO_LARGE, t
    return TOKENS_OK, -1


@njit(cache=True)
def check_commit_inputs(counts, starts, has_starts, max_columns, block_size):
    """Scan a commit pass's per-request spans; return ``(code, r, total, max_count)``.

    Request ``r`` writes positions ``starts[r] .. starts[r] + counts[r] - 1`` (start 0
    without starts). Codes: NEGATIVE_COUNT (a count outside ``[0, 2**31)``: negative,
    or beyond int32), NEGATIVE_POSITION (a negative start),
    BLOCK_COLUMN_TOO_LARGE (its last position's column >= max_columns). ``total`` is
    ``sum(counts)`` and ``max_count`` the largest count (both valid only when OK).

    >>> counts = np.array([2, 1])  # block size 8, 2 columns: positions 0..15
    >>> check_commit_inputs(counts, np.array([7, 3]), True, 2, 8)
    (0, -1, 3, 2)
    >>> check_commit_inputs(counts, np.array([15, 3]), True, 2, 8)  # 16 is in column 2
    (4, 0, 0, 0)
    """
    total = 0
    max_count = 0
    # The last position's column is >= max_columns exactly when the position is >=
    # limit (both are >= 0 there): a compare, no division per request.
    limit = np.int64(max_columns) * block_size
    for r in range(counts.shape[0]):
        count = np.int64(counts[r])
        if count < 0 or count >= 2**31:  # the view's lengths are int32
            return NEGATIVE_COUNT, r, 0, 0
        start = np.int64(starts[r]) if has_starts else np.int64(0)
        if start < 0:
            return NEGATIVE_POSITION, r, 0, 0
        # Bound start and count before adding them, so the sum cannot wrap in int64.
        if count > 0 and (start >= limit or count > limit or start + count > limit):
            return BLOCK_COLUMN_TOO_LARGE, r, 0, 0
        total += count
        if count > max_count:
            max_count = count
    return TOKENS_OK, -1, total, max_count


@njit(cache=True)
def first_bad_draft_block(offsets, block_table, count, block_size, high):
    """One draft depth's written blocks: the first row ``i < count`` whose block
    ``block_table[i, offsets[i] // BS]`` is negative (an unallocated block) or above
    ``high``, else -1. Offsets outside the table are skipped (the depth's own check
    refuses them). offsets: int32 [>= count]; block_table: int [>= count, W].

    >>> table = np.array([[3, -1], [-1, 4]])  # block size 8
    >>> first_bad_draft_block(np.array([7, 8]), table, 2, 8, 127)
    -1
    >>> first_bad_draft_block(np.array([8, 8]), table, 2, 8, 127)  # row 0: column 1
    0
    """
    width = block_table.shape[1]
    for i in range(count):
        position = np.int64(offsets[i])
        column = position // block_size
        if position < 0 or column >= width:
            continue
        block = block_table[i, column]
        if block < 0 or block > high:
            return i
    return -1


@njit(cache=True)
def first_bad_token_block(rows, positions, block_table, inherited, has_inherited,
                          block_size, width, high):
    """Scan ``write_token_maps``' tokens; return ``(code, t)``, ``(BLOCKS_OK, -1)``
    when all are good. INHERITED_OUT_OF_RANGE: token ``t``'s row has an inherited
    count outside ``[0, width]``. BAD_WRITTEN_BLOCK: the block token ``t`` writes,
    ``block_table[rows[t], positions[t] // BS]`` (a token not redirected to the dummy
    block by ``inherited``), is negative (an unallocated block) or above ``high`` (does
    not fit the destination). Rows and columns must already be in range
    (``check_token_inputs``). rows, positions: int [T]; block_table: int [B, W];
    inherited: int [> max(rows)].

    >>> table = np.array([[3, -1], [5, 300]])  # block size 8, width 2
    >>> first_bad_token_block(np.array([0, 1, 0]), np.array([7, 9, 8]), table,
    ...                       np.zeros(1, np.int64), False, 8, 2, 127)  # 300 > 127
    (2, 1)
    >>> first_bad_token_block(np.array([0, 0]), np.array([7, 8]), table,
    ...                       np.array([2, 0]), True, 8, 2, 127)  # -1 is redirected
    (0, -1)
    >>> first_bad_token_block(np.array([1]), np.array([0]), table, np.array([0, 3]),
    ...                       True, 8, 2, 127)  # row 1 inherits 3 > width 2
    (1, 0)
    """
    for t in range(positions.shape[0]):
        row = rows[t]
        column = np.int64(positions[t]) // block_size
        if has_inherited:
            protected = inherited[row]
            if protected < 0 or protected > width:
                return INHERITED_OUT_OF_RANGE, t
            if column < protected:
                continue
        block = block_table[row, column]
        if block < 0 or block > high:
            return BAD_WRITTEN_BLOCK, t
    return BLOCKS_OK, -1


@njit(cache=True)
def first_past_count(counts, starts, has_starts, block_counts, block_size):
    """The opt-in block counts of a commit pass: the first request ``r`` with a token
    whose block column is ``>= block_counts[r]`` (its span's last position, the spans
    being consecutive), else -1. Spans must already be in the table
    (``check_commit_inputs``). block_counts: int [>= P].

    >>> counts, starts = np.array([2, 3]), np.array([7, 6])  # block size 8
    >>> first_past_count(counts, starts, True, np.array([1, 2]), 8)  # 7..8: column 1
    0
    >>> first_past_count(counts, starts, True, np.array([2, 2]), 8)
    -1
    """
    for r in range(counts.shape[0]):
        count = np.int64(counts[r])
        if count <= 0:
            continue
        start = np.int64(starts[r]) if has_starts else np.int64(0)
        if (start + count - 1) // block_size >= block_counts[r]:
            return r
    return -1


@njit(cache=True)
def first_bad_commit_count(counts, starts, has_starts, block_counts, width, block_size):
    """The opt-in block counts of a commit pass in one scan: ``(1, i)`` for the first
    count ``block_counts[i]`` (``i < P``) outside ``[0, width]``; else ``(2, r)`` for
    the first request ``r`` with a token whose block column is ``>= block_counts[r]``
    (its span's last position, the spans being consecutive); else ``(0, -1)``. Spans
    must already be in the table (``check_commit_inputs``). block_counts: int [>= P].

    >>> counts, starts = np.array([2, 3]), np.array([7, 6])  # block size 8
    >>> first_bad_commit_count(counts, starts, True, np.array([1, 2]), 4, 8)  # 7..8
    (2, 0)
    >>> first_bad_commit_count(counts, starts, True, np.array([2, 5]), 4, 8)
    (1, 1)
    >>> first_bad_commit_count(counts, starts, True, np.array([2, 2]), 4, 8)
    (0, -1)
    """
    bad = first_outside_closed(block_counts[:counts.shape[0]], 0, width)
    if bad >= 0:
        return 1, bad
    r = first_past_count(counts, starts, has_starts, block_counts, block_size)
    return (2, r) if r >= 0 else (0, -1)


@njit(cache=True)
def first_counted_outside(table, rows, block_counts, low, high):
    """The first ``(row, column)`` with ``column < block_counts[row]``, ``row < rows``,
    whose entry is outside the closed ``[low, high]``, else ``(-1, -1)``: the block-id
    fit scan of the used columns only. table: int [>= rows, W].

    >>> table = np.array([[1, 300], [2, 3]])
    >>> first_counted_outside(table, 2, np.array([1, 2]), 0, 127)
    (-1, -1)
    >>> first_counted_outside(table, 2, np.array([2, 2]), 0, 127)
    (0, 1)
    """
    for i in range(rows):
        for col in range(block_counts[i]):
            value = table[i, col]
            if value < low or value > high:
                return i, col
    return -1, -1


@njit(cache=True)
def first_unallocated_inherited(block_table, inherited, count, block_counts, has_counts):
    """The first ``(r, column)``, ``r < count``, with ``column < inherited[r]`` whose
    block ``block_table[r, column]`` is negative: an inherited block is a shared prefix
    block, so it is allocated, and a count that covers an unallocated column is wrong
    (it would send the request's own KV to the dummy block). ``(-1, -1)`` when none.
    Counts are cut to the table's width (and to ``block_counts[r]``, the columns the
    caller holds, when ``has_counts``); a count outside ``[0, W]`` is its own refusal.

    >>> table = np.array([[3, 4, -1], [5, -1, -1]])
    >>> first_unallocated_inherited(table, np.array([2, 2]), 2, table[0], False)
    (1, 1)
    >>> first_unallocated_inherited(table, np.array([2, 1]), 2, table[0], False)
    (-1, -1)
    """
    width = block_table.shape[1]
    for r in range(count):
        protected = np.int64(inherited[r])
        if protected > width:
            protected = width
        if has_counts and protected > block_counts[r]:
            protected = np.int64(block_counts[r])
        for column in range(protected):
            if block_table[r, column] < 0:
                return r, column
    return -1, -1


@njit(cache=True)
def record_commit_spans(counts, starts, has_starts, first_row, spans):
    """Keep a commit pass's spans by context row: ``spans[:, first_row + r] = (start,
    start + counts[r])`` for its requests, ``(0, 0)`` (empty) for every other row.
    spans: int64 [2, R].

    >>> spans = np.full((2, 4), 7, np.int64)
    >>> record_commit_spans(np.array([2, 3]), np.array([0, 5]), True, 1, spans)
    >>> spans.tolist()
    [[0, 0, 5, 0], [0, 2, 8, 0]]
    """
    spans[:, :] = 0
    for r in range(counts.shape[0]):
        start = np.int64(starts[r]) if has_starts else np.int64(0)
        spans[0, first_row + r] = start
        spans[1, first_row + r] = start + counts[r]


@njit(cache=True)
def first_protected_start(starts, count, first_row, annotations, block_size, spans,
                          has_spans):
    """The first draft row ``i < count`` (context row ``first_row + i``) whose start
    lies where a draft must not write: ``(1, i)`` inside the row's inherited blocks
    (``start // BS < annotations[first_row + i]``), ``(2, i)`` inside the span the
    commit pass just before wrote for the row (``spans``, when ``has_spans``); ``(0,
    -1)`` when none. A negative start is left to the begin's own refusal.

    >>> spans = np.array([[0, 3], [0, 7]])  # row 1 committed positions 3..6
    >>> first_protected_start(np.array([6]), 1, 1, np.array([0, 1]), 4, spans, True)
    (2, 0)
    >>> first_protected_start(np.array([2]), 1, 1, np.array([0, 1]), 4, spans, False)
    (1, 0)
    >>> first_protected_start(np.array([7]), 1, 1, np.array([0, 1]), 4, spans, True)
    (0, -1)
    """
    for i in range(count):
        row = first_row + i
        start = np.int64(starts[i])
        if start < 0:
            continue
        if start // block_size < annotations[row]:
            return 1, i
        if has_spans and spans[0, row] <= start and start < spans[1, row]:
            return 2, i
    return 0, -1
