"""Draft-loop and commit-pass staging kernels, token maps and MHA metadata.

Terms: ``R`` max requests, ``W`` block-table width, ``BS`` block size in tokens, ``D``
the dummy block, ``n`` requests in a forward, ``T`` real tokens, ``p``/``padded`` the
padded count. All block/slot arithmetic is int64. The kernels that call each other live
in this one file because numba's on-disk cache does not track other files.

The output arrays are either numpy views of the destination view's fields (direct path)
or of pinned staging buffers (mirror path); the kernels do not care which.
"""

import numpy as np
from numba import njit

# Codes of ``checks.check_token_inputs`` / ``check_commit_inputs`` (culprit beside).
TOKENS_OK = 0
ROW_OUT_OF_TABLE = 1
ROW_OUT_OF_INHERITED = 2
NEGATIVE_POSITION = 3
BLOCK_COLUMN_TOO_LARGE = 4
NEGATIVE_COUNT = 5


# Codes of ``first_bad_token_block`` / ``first_bad_commit_block`` (culprit beside).
BLOCKS_OK = 0
INHERITED_OUT_OF_RANGE = 1  # an inherited count outside [0, W]
BAD_WRITTEN_BLOCK = 2  # a written block that is negative or above ``high``


# --------------------------------------------------------------------------- draft loop


@njit(cache=True)
def stage_decode_lengths(offsets, count, query_lengths, kv_lengths):
    """One query row, ``position + 1`` keys: ``q[:n] = 1``, ``kv[:n] = offsets[:n] + 1``.

    Returns the largest KV length (0 when count is 0). All arrays int32 [R].
    Example: offsets [5, 11] -> q [1, 1], kv [6, 12], returns 12.

    >>> q, kv = np.zeros(3, np.int32), np.zeros(3, np.int32)
    >>> offsets = np.array([5, 11, 0], np.int32)
    >>> stage_decode_lengths(offsets, 2, q, kv), q.tolist(), kv.tolist()
    (12, [1, 1, 0], [6, 12, 0])
    """
    max_kv = 0
    for i in range(count):
        query_lengths[i] = 1
        kv = np.int64(offsets[i]) + 1
        kv_lengths[i] = kv
        if kv > max_kv:
            max_kv = kv
    return max_kv


# --------------------------------------------------------------------------- token maps


@njit(cache=True, inline='always')
def _shift_of(block_size):
    """``log2(BS)`` for a power-of-two block size (6 for 64), else -1: a block column
    is then ``pos >> shift``, which floors as ``pos // BS`` does, with no division."""
    shift = 0
    while shift < 62 and (np.int64(1) << shift) < block_size:
        shift += 1
    return shift if (np.int64(1) << shift) == block_size else -1


@njit(cache=True, inline='always')
def _write_token(t, row, position, protected, block_table, block_size, shift, dummy,
                 pos_ids, block_idx, local_pos, request_idx, position_in_request):
    """Token ``t`` of request ``row`` writes ``position`` (int64): ``col = pos // BS``;
    block ``D`` when ``col < protected`` (inherited KV is never rewritten), else
    ``block_table[row, col]``; local offset ``pos % BS``; request ``row``; both
    position fields ``pos``; ``shift`` is ``_shift_of(block_size)``. The per-token rule
    of every token-map writer here."""
    column = position >> shift if shift >= 0 else position // block_size
    if column < protected:
        block_idx[t] = dummy
    else:
        block_idx[t] = block_table[row, column]
    local_pos[t] = position - column * block_size
    request_idx[t] = row
    position_in_request[t] = position
    pos_ids[t] = position


@njit(cache=True, inline='always')
def _pad_token_maps(count, padded, dummy, block_idx, local_pos):
    """Pad tokens ``[count, padded)`` write slot 0 of the dummy block; their other
    fields are left as they are."""
    for t in range(count, padded):
        block_idx[t] = dummy
        local_pos[t] = 0


@njit(cache=True)
def write_token_maps(rows, positions, block_table, inherited, has_inherited, padded,
                     block_size, dummy, pos_ids, block_idx, local_pos, request_idx,
                     position_in_request):
    """Per-token KV destinations for ``T = len(positions)`` tokens, padded to ``padded``.

    For ``t < T``: ``col = pos // BS``; block is ``D`` when ``col < inherited[row]``
    (inherited KV is never rewritten), else ``block_table[row, col]``; local offset
    ``pos % BS``; request ``row``; both position fields ``pos``. For
    ``T <= t < padded`` only block (``D``) and local offset (0) are written.
    rows, positions, inherited: int [T]/[T]/[>rows]; block_table: int [B, W];
    outputs (the five token fields in view order, pos_ids first): int [>= padded],
    pos_ids int64 and the rest int32 in upstream's view.
    Example (BS 8, table [[3, 4]], inherited [1]): rows [0, 0], positions [7, 8],
    padded 3 -> block [D, 4, D], local [7, 0, 0].

    >>> out = [np.full(4, -1, np.int64)] + [np.full(4, -1, np.int32) for _ in range(4)]
    >>> write_token_maps(np.array([0, 0]), np.array([7, 8]), np.array([[3, 4]]),
    ...                  np.array([1]), True, 3, 8, 99, *out)
    >>> [field.tolist() for field in out]  # pos_ids, block, local, request, position
    [[7, 8, -1, -1], [99, 4, 99, -1], [7, 0, 0, -1], [0, 0, -1, -1], [7, 8, -1, -1]]
    """
    count = positions.shape[0]
    shift = _shift_of(block_size)
    for t in range(count):
        row = rows[t]
        protected = np.int64(inherited[row]) if has_inherited else np.int64(0)
        _write_token(t, row, np.int64(positions[t]), protected, block_table, block_size,
                     shift, dummy, pos_ids, block_idx, local_pos, request_idx,
                     position_in_request)
    _pad_token_maps(count, padded, dummy, block_idx, local_pos)


@njit(cache=True)
def write_commit_token_maps(counts, starts, has_starts, block_table, inherited,
                            has_inherited, padded, block_size, dummy, pos_ids,
                            block_idx, local_pos, request_idx, position_in_request):
    """Token maps of a commit pass: request ``r`` owns row ``r`` and writes ``counts[r]``
    consecutive positions from ``starts[r]`` (0 without starts). Returns ``T``.

    Same per-token rule and padding as ``write_token_maps``.
    Example: counts [2, 1], starts [7, 3] -> rows [0, 0, 1], positions [7, 8, 3].

    >>> out = [np.full(4, -1, np.int64)] + [np.full(4, -1, np.int32) for _ in range(4)]
    >>> write_commit_token_maps(np.array([2, 1]), np.array([7, 3]), True,
    ...                         np.array([[3, 4], [5, 6]]), np.array([1, 0]), True, 4, 8,
    ...                         99, *out)
    3
    >>> [field.tolist() for field in out]  # pos_ids, block, local, request, position
    [[7, 8, 3, -1], [99, 4, 5, 99], [7, 0, 3, 0], [0, 0, 1, -1], [7, 8, 3, -1]]
    """
    t = 0
    shift = _shift_of(block_size)
    for r in range(counts.shape[0]):
        start = np.int64(starts[r]) if has_starts else np.int64(0)
        protected = np.int64(inherited[r]) if has_inherited else np.int64(0)
        for j in range(counts[r]):
            _write_token(t, r, start + j, protected, block_table, block_size, shift, dummy,
                         pos_ids, block_idx, local_pos, request_idx, position_in_request)
            t += 1
    _pad_token_maps(t, padded, dummy, block_idx, local_pos)
    return t


@njit(cache=True)
def first_bad_commit_block(counts, starts, has_starts, block_table, inherited,
                           has_inherited, block_size, width, high):
    """``first_bad_token_block`` for a commit pass, by request: ``(code, r, column)``,
    ``(BLOCKS_OK, -1, -1)`` when all are good. Request ``r`` writes positions
    ``starts[r] .. starts[r] + counts[r] - 1`` (from 0 without starts); columns below
    ``inherited[r]`` go to the dummy block. INHERITED_OUT_OF_RANGE: ``inherited[r]``
    outside ``[0, width]``; BAD_WRITTEN_BLOCK: the block at ``[r, column]`` is written
    and negative or above ``high``. Spans must already be in the table
    (``check_commit_inputs``).

    >>> table = np.array([[3, -1], [5, 6]])  # block size 8, width 2
    >>> first_bad_commit_block(np.array([9, 2]), np.array([0, 3]), True, table,
    ...                        np.zeros(1, np.int64), False, 8, 2, 127)
    (2, 0, 1)
    >>> first_bad_commit_block(np.array([9, 2]), np.array([0, 3]), True, table,
    ...                        np.array([2, 0]), True, 8, 2, 127)
    (0, -1, -1)
    >>> first_bad_commit_block(np.array([9, 2]), np.array([0, 3]), True, table,
    ...                        np.array([2, -1]), True, 8, 2, 127)
    (1, 1, -1)
    """
    shift = _shift_of(block_size)
    for r in range(counts.shape[0]):
        protected = np.int64(0)
        if has_inherited:
            protected = np.int64(inherited[r])
            if protected < 0 or protected > width:
                return INHERITED_OUT_OF_RANGE, r, -1
        count = np.int64(counts[r])
        if count <= 0:
            continue
        start = np.int64(starts[r]) if has_starts else np.int64(0)
        last = start + count - 1  # the columns of the span's first and last positions
        first = max(start >> shift if shift >= 0 else start // block_size, protected)
        last = last >> shift if shift >= 0 else last // block_size
        for column in range(first, last + 1):
            block = block_table[r, column]
            if block < 0 or block > high:
                return BAD_WRITTEN_BLOCK, r, column
    return BLOCKS_OK, -1, -1


# ------------------------------------------------------------------------ lengths / MHA
@njit(cache=True)
def stage_prefill_lengths(counts, pad_tokens, max_requests, lengths):
    """Commit-pass lengths with the TP pad rows absorbed; returns the staged length.

    ``lengths[:P] = counts``; with ``pad_tokens > 0`` a spare slot (``P < R``) gets its
    own trailing entry ``pad_tokens``, a full batch grows its last entry instead.
    counts: int [P]; lengths: int32 [>= P + 1].
    Example: counts [3, 2], pad 3 -> [3, 2, 3] (spare slot), returns 3;
    with R = 2 -> [3, 5], returns 2.

    >>> lengths = np.zeros(3, np.int32)
    >>> stage_prefill_lengths(np.array([3, 2]), 3, 4, lengths), lengths.tolist()
    (3, [3, 2, 3])
    >>> stage_prefill_lengths(np.array([3, 2]), 3, 2, lengths), lengths[:2].tolist()
    (2, [3, 5])
    """
    num_prefill = counts.shape[0]
    for i in range(num_prefill):
        lengths[i] = counts[i]
    if pad_tokens > 0:
        if num_prefill < max_requests:
            lengths[num_prefill] = pad_tokens
            return num_prefill + 1
        lengths[num_prefill - 1] += pad_tokens
    return num_prefill


@njit(cache=True)
def write_mha_lengths(query_lengths, kv_lengths, count, padded, mha_query_lengths,
                      mha_kv_seq_lengths, mha_cu_query_seq_lengths, mha_cu_kv_seq_lengths):
    """The length half of ``write_mha_metadata``: lengths and running sums
    (``cu[0] = 0``) of ``count`` requests; slots ``[count, padded)`` get zero lengths
    and flat sums. Returns ``(max_query_length, max_kv_length)`` over the real slots.
    query/kv lengths: int [>= count]; mha lengths: int32 [>= padded]; cu: [>= padded + 1].

    >>> q, kv, cu_q, cu_kv = (np.zeros(n, np.int32) for n in (3, 3, 4, 4))
    >>> write_mha_lengths(np.array([1, 1]), np.array([6, 12]), 2, 3, q, kv, cu_q, cu_kv)
    (1, 12)
    >>> kv.tolist(), cu_kv.tolist()
    ([6, 12, 0], [0, 6, 18, 18])
    """
    mha_cu_query_seq_lengths[0] = 0
    mha_cu_kv_seq_lengths[0] = 0
    sum_q = np.int64(0)
    sum_kv = np.int64(0)
    max_q = np.int64(0)
    max_kv = np.int64(0)
    for i in range(count):
        q = np.int64(query_lengths[i])
        kv = np.int64(kv_lengths[i])
        mha_query_lengths[i] = q
        mha_kv_seq_lengths[i] = kv
        sum_q += q
        sum_kv += kv
        mha_cu_query_seq_lengths[i + 1] = sum_q
        mha_cu_kv_seq_lengths[i + 1] = sum_kv
        if q > max_q:
            max_q = q
        if kv > max_kv:
            max_kv = kv
    for i in range(count, padded):
        mha_query_lengths[i] = 0
        mha_kv_seq_lengths[i] = 0
        mha_cu_query_seq_lengths[i + 1] = sum_q
        mha_cu_kv_seq_lengths[i + 1] = sum_kv
    return max_q, max_kv


@njit(cache=True)
def write_mha_block_rows(block_table, num_table_rows, count, padded, dummy, first_row,
                         mha_block_table):
    """The table half of ``write_mha_metadata`` over rows ``[first_row, padded)``, row
    ``i`` into ``mha_block_table[i - first_row]``: rows ``< num_table_rows`` copied,
    ``[num_table_rows, count)`` all ``D`` (the trailing pad request), ``[count, padded)``
    all -1 (rows below a ``first_row > 0`` come from elsewhere: the mirror path's
    persistent device table). W is ``mha_block_table.shape[1]``.
    block_table: int [>= num_table_rows, >= W]; mha_block_table: [>= padded - first_row, W].

    >>> table = np.zeros((2, 2), np.int32)  # rows 1 and 2 of three
    >>> write_mha_block_rows(np.array([[3, 4], [5, 6]]), 2, 2, 3, 99, 1, table)
    >>> table.tolist()
    [[5, 6], [-1, -1]]
    """
    width = mha_block_table.shape[1]
    for i in range(first_row, num_table_rows):
        for col in range(width):
            mha_block_table[i - first_row, col] = block_table[i, col]
    for i in range(max(first_row, num_table_rows), count):
        for col in range(width):
            mha_block_table[i - first_row, col] = dummy
    for i in range(max(first_row, count), padded):
        for col in range(width):
            mha_block_table[i - first_row, col] = -1


@njit(cache=True)
def write_mha_metadata(query_lengths, kv_lengths, count, block_table, num_table_rows,
                       padded, dummy, mha_query_lengths, mha_kv_seq_lengths,
                       mha_cu_query_seq_lengths, mha_cu_kv_seq_lengths, mha_block_table):
    """Per-request MHA read metadata for ``count`` requests, padded to ``padded`` slots.

    Slots ``< count``: lengths and running sums (``cu[0] = 0``); block-table rows
    ``< num_table_rows`` copied, the rest of ``[num_table_rows, count)`` all ``D`` (the
    trailing pad request). Slots ``[count, padded)``: zero lengths, flat sums, rows of -1.
    Returns ``(max_query_length, max_kv_length)`` over the real slots.
    query/kv lengths: int [>= count]; block_table: int [>= num_table_rows, W];
    mha lengths: int32 [>= padded]; cu: int32 [>= padded + 1]; mha_block_table: [>= padded, W].
    Example: q [1, 1], kv [6, 12], padded 3 -> cu_q [0, 1, 2, 2], cu_kv [0, 6, 18, 18].

    >>> q, kv, cu_q, cu_kv = (np.zeros(n, np.int32) for n in (3, 3, 4, 4))
    >>> table = np.zeros((3, 2), np.int32)  # one real row, one pad request, one pad slot
    >>> write_mha_metadata(np.array([1, 1]), np.array([6, 12]), 2, np.array([[3, 4]]), 1,
    ...                    3, 99, q, kv, cu_q, cu_kv, table)
    (1, 12)
    >>> cu_q.tolist(), cu_kv.tolist(), table.tolist()
    ([0, 1, 2, 2], [0, 6, 18, 18], [[3, 4], [99, 99], [-1, -1]])
    """
    maxima = write_mha_lengths(query_lengths, kv_lengths, count, padded, mha_query_lengths,
                               mha_kv_seq_lengths, mha_cu_query_seq_lengths,
                               mha_cu_kv_seq_lengths)
    write_mha_block_rows(block_table, num_table_rows, count, padded, dummy, 0,
                         mha_block_table)
    return maxima


# ----------------------------------------------------------------------- fused forwards
@njit(cache=True, inline='always')
def _draft_rows_status(offsets, block_table, block_counts, count, block_size, shift, high):
    """One scan of a draft depth's rows (``shift``: ``_shift_of(block_size)``):
    ``-2 - i`` for the first row ``i`` whose written block is negative or above ``high``,
    or whose column is at or past ``block_counts[i]`` (rows with a bad offset skipped,
    as ``first_bad_draft_block``), else -1 for an offset negative or past the table, else
    0."""
    width = block_table.shape[1]
    status = 0
    for i in range(count):
        position = np.int64(offsets[i])
        column = position >> shift if shift >= 0 else position // block_size
        if position < 0 or column >= width:
            status = -1
            continue
        if column >= block_counts[i]:
            return -2 - i
        block = block_table[i, column]
        if block < 0 or block > high:
            return -2 - i
    return status


@njit(cache=True)
def decode_step_maps(offsets, block_table, block_counts, count, padded, block_size, dummy,
                     high, query_lengths, kv_lengths, pos_ids, block_idx, local_pos,
                     request_idx, position_in_request, mha_query_lengths, mha_kv_seq_lengths,
                     mha_cu_query_seq_lengths, mha_cu_kv_seq_lengths):
    """One draft depth without its block table: token maps for rows ``0..n-1`` at
    ``offsets[:n]`` through ``block_table[:n]`` padded to ``padded``, the decode
    lengths, and the MHA lengths and sums padded to ``padded``. O(padded) work, whatever
    the table's width: ``block_table`` is read once per token. Returns the largest KV
    length; without writing anything, ``-2 - i`` when row ``i``'s written block is
    negative (unallocated) or above ``high`` (``first_bad_draft_block``, the first such
    row) or its column is ``>= block_counts[i]`` (the opt-in block counts; ``W`` for
    every row without them), else -1 when an offset is negative or past the table
    (``offsets_in_table``).
    Both refusals are found in one scan of the offsets, before the first write.

    offsets: int32 [R]; block_table: [R, W]; block_counts: int [>= count]; query/kv
    lengths: int32 [R]; the five token outputs as in ``write_token_maps``, the four
    length outputs as in ``write_mha_lengths``.

    >>> lengths = np.zeros((2, 3), np.int32)  # the persistent query/kv lengths [R]
    >>> tokens = [np.zeros(4, np.int64)] + [np.zeros(4, np.int32) for _ in range(4)]
    >>> mha = [np.zeros(n, np.int32) for n in (3, 3, 4, 4)]
    >>> offsets, table = np.array([5, 11, 0], np.int32), np.array([[3, 4], [5, 6], [0, 0]])
    >>> full = np.full(3, 2, np.int32)  # every row uses both columns
    >>> decode_step_maps(offsets, table, full, 2, 3, 8, 99, 127, *lengths, *tokens, *mha)
    12
    >>> tokens[1].tolist(), tokens[2].tolist(), mha[3].tolist()  # block, local, cu_kv
    ([3, 6, 99, 0], [5, 3, 0, 0], [0, 6, 18, 18])
    >>> decode_step_maps(offsets, table, full, 2, 3, 8, 99, 5, *lengths, *tokens, *mha)
    -3
    >>> decode_step_maps(offsets, table, np.array([1, 1]), 2, 3, 8, 99, 127, *lengths,
    ...                  *tokens, *mha)  # row 1 writes column 1, past its count 1
    -3
    """
    shift = _shift_of(block_size)
    status = _draft_rows_status(offsets, block_table, block_counts, count, block_size,
                                shift, high)
    if status < 0:
        return status
    for t in range(count):
        _write_token(t, t, np.int64(offsets[t]), 0, block_table, block_size, shift, dummy,
                     pos_ids, block_idx, local_pos, request_idx, position_in_request)
    _pad_token_maps(count, padded, dummy, block_idx, local_pos)
    stage_decode_lengths(offsets, count, query_lengths, kv_lengths)
    _, max_kv = write_mha_lengths(query_lengths, kv_lengths, count, padded,
                                  mha_query_lengths, mha_kv_seq_lengths,
                                  mha_cu_query_seq_lengths, mha_cu_kv_seq_lengths)
    return max_kv


@njit(cache=True)
def decode_step(offsets, block_table, block_counts, count, padded, block_size, dummy, high,
                query_lengths, kv_lengths, pos_ids, block_idx, local_pos, request_idx,
                position_in_request, mha_query_lengths, mha_kv_seq_lengths, mha_cu_query_seq_lengths,
                mha_cu_kv_seq_lengths, mha_block_table):
    """One draft depth in one call: ``decode_step_maps`` plus the MHA block table
    (``block_table[:n]``, then -1 rows to ``padded``). Returns the largest KV length, or
    a refusal of ``decode_step_maps`` (-1, ``-2 - i``) without writing anything.

    offsets: int32 [R]; block_table: [R, W]; block_counts: int [>= count] (as in
    ``decode_step_maps``); query/kv lengths: int32 [R]; the ten view outputs as in
    ``write_token_maps`` / ``write_mha_metadata``.

    >>> lengths = np.zeros((2, 3), np.int32)  # the persistent query/kv lengths [R]
    >>> tokens = [np.zeros(4, np.int64)] + [np.zeros(4, np.int32) for _ in range(4)]
    >>> mha = [np.zeros(n, np.int32) for n in (3, 3, 4, 4)] + [np.zeros((3, 2), np.int32)]
    >>> offsets, table = np.array([5, 11, 0], np.int32), np.array([[3, 4], [5, 6], [0, 0]])
    >>> full = np.full(3, 2, np.int32)
    >>> decode_step(offsets, table, full, 2, 3, 8, 99, 127, *lengths, *tokens, *mha)
    12
    >>> tokens[1].tolist(), tokens[2].tolist(), mha[3].tolist()  # block, local, cu_kv
    ([3, 6, 99, 0], [5, 3, 0, 0], [0, 6, 18, 18])
    """
    max_kv = decode_step_maps(offsets, block_table, block_counts, count, padded, block_size,
                              dummy, high, query_lengths, kv_lengths, pos_ids, block_idx,
                              local_pos, request_idx, position_in_request, mha_query_lengths,
                              mha_kv_seq_lengths, mha_cu_query_seq_lengths,
                              mha_cu_kv_seq_lengths)
    if max_kv >= 0:
        write_mha_block_rows(block_table, count, count, padded, dummy, 0, mha_block_table)
    return max_kv


@njit(cache=True)
def dummy_past_span(mha_block_table, row, span_end, block_size, dummy):
    """Point the columns of ``mha_block_table[row]`` that lie wholly at or past position
    ``span_end`` at ``dummy``: the pad-absorbing request of a full commit batch attends
    over ``count + pad`` keys, more than it writes, and must read no block it was not
    given (a -1 entry, or a block of its own past what it wrote).
    Example: BS 4, row [1, 5, 7]: span_end 3 or 4 -> [1, D, D]; span_end 5 -> [1, 5, D].

    >>> table = np.array([[0, 0, 0], [1, 5, 7]], dtype=np.int32)
    >>> dummy_past_span(table, 1, 5, 4, 99)
    >>> table
    array([[ 0,  0,  0],
           [ 1,  5, 99]], dtype=int32)
    """
    first = (np.int64(span_end) + block_size - 1) // block_size
    for col in range(first, mha_block_table.shape[1]):
        mha_block_table[row, col] = dummy


@njit(cache=True)
def commit_pass(counts, starts, has_starts, block_table, inherited, has_inherited,
                padded_tokens, pad_tokens, max_requests, min_padded_requests, block_size,
                dummy, first_table_row, width, high, lengths, pos_ids, block_idx, local_pos,
                request_idx, position_in_request, mha_query_lengths, mha_kv_seq_lengths,
                mha_cu_query_seq_lengths, mha_cu_kv_seq_lengths, mha_block_table):
    """A whole varlen commit pass in one call; returns ``(T, m, padded_requests, max_len)``.

    Token maps as ``write_commit_token_maps``; lengths as ``stage_prefill_lengths`` into
    ``lengths`` (``m`` = P or P + 1); MHA metadata with ``lengths`` as both query and KV
    over ``max(min_padded_requests, m)`` slots, block rows ``< P`` from ``block_table``.
    When request ``P - 1`` absorbs the pad (``m == P``, ``pad_tokens > 0``) its block row
    is then cut back with ``dummy_past_span``. Block rows below ``first_table_row`` are
    not written and ``mha_block_table`` holds rows from ``first_table_row`` on
    (``write_mha_block_rows``); ``0`` means every row, and a ``first_table_row`` past
    the last request writes no row (the opt-in block counts' writer,
    ``counts.write_counted_rows``, then writes them, the pad cut included).

    First, before anything is written, the blocks the tokens write are scanned
    (``first_bad_commit_block`` with ``width`` and ``high``): on a bad one it returns
    ``(-code, r, column, 0)`` and writes nothing.
    """
    code, bad_request, bad_column = first_bad_commit_block(
        counts, starts, has_starts, block_table, inherited, has_inherited, block_size,
        width, high)
    if code != BLOCKS_OK:
        return -code, bad_request, bad_column, np.int64(0)
    num_prefill = counts.shape[0]
    total = write_commit_token_maps(counts, starts, has_starts, block_table, inherited,
                                    has_inherited, padded_tokens, block_size, dummy,
                                    pos_ids, block_idx, local_pos, request_idx,
                                    position_in_request)
    staged = stage_prefill_lengths(counts, pad_tokens, max_requests, lengths)
    padded_requests = min_padded_requests if min_padded_requests > staged else staged
    max_len, _ = write_mha_lengths(lengths, lengths, staged, padded_requests,
                                   mha_query_lengths, mha_kv_seq_lengths,
                                   mha_cu_query_seq_lengths, mha_cu_kv_seq_lengths)
    write_mha_block_rows(block_table, num_prefill, staged, padded_requests, dummy,
                         first_table_row, mha_block_table)
    if pad_tokens > 0 and staged == num_prefill and num_prefill - 1 >= first_table_row:
        last = num_prefill - 1
        start = np.int64(starts[last]) if has_starts else np.int64(0)
        dummy_past_span(mha_block_table, last - first_table_row, start + counts[last],
                        block_size, dummy)
    return total, staged, padded_requests, max_len
