"""Every numba kernel in ``native/`` against its plain numpy twin (``tests/naive.py``),
and the kernels' docstring examples run as doctests.

Inputs are seeded (the ``rng`` fixture) and small, drawn to hit the edges: count 0,
padding beyond the count, int32 and int64 tables and indices, overlapping and repeated
moves/swaps, rows and positions out of range. Every output array starts as random
garbage, so a write where the kernel should leave an element alone shows up as a
difference; outputs are compared whole, with exact equality and the same dtype.
Kernels that trust their caller get inputs that honour their preconditions.
"""

from __future__ import annotations

import doctest
import inspect
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import pytest

from mtpmeta import native
from tests import naive

CASES = 40  # random cases per test: enough to hit every branch, cheap under JIT-off
DUMMY = 7777  # never a table entry, so a dummy write cannot pass for a table read
INDEX_DTYPES = (np.int32, np.int64)
NATIVE_MODULES = (native.rows, native.carry, native.checks, native.draft_state,
                  native.staging, native.counts)
# Public kernels without an example of their own, and where they are shown instead.
WITHOUT_EXAMPLE = {
    "mtpmeta.native.carry.invalidate": "walked through in check_take's example",
    "mtpmeta.native.carry.record": "walked through in check_take's example",
    "mtpmeta.native.staging.commit_pass": "composes three kernels that have examples",
}


def garbage(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """An output buffer full of values no kernel writes (negative, far from any table)."""
    return rng.integers(-9000, -8000, shape).astype(dtype)


def assert_same(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> None:
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, strict=True, err_msg=f"output {index}")


def token_outputs(rng: np.random.Generator, size: int) -> List[np.ndarray]:
    """pos_ids (int64) and the four int32 token fields, as upstream's view has them."""
    return [garbage(rng, size, np.int64)] + [garbage(rng, size, np.int32) for _ in range(4)]


def mha_outputs(rng: np.random.Generator, slots: int, width: int) -> List[np.ndarray]:
    return ([garbage(rng, slots, np.int32) for _ in range(2)]
            + [garbage(rng, slots + 1, np.int32) for _ in range(2)]
            + [garbage(rng, (slots, width), np.int32)])


def copies(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
    return [a.copy() for a in arrays]


#: The kernels take a power of two's block columns by a shift, the others' by a division.
BLOCK_SIZES = (1, 2, 3, 4, 6, 8)


def geometry(rng: np.random.Generator) -> Tuple[int, int, int]:
    """``(R, W, BS)``: max requests, block-table width, block size."""
    return int(rng.integers(1, 7)), int(rng.integers(1, 5)), int(rng.choice(BLOCK_SIZES))


def block_table(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    dtype = INDEX_DTYPES[int(rng.integers(2))]
    return rng.integers(0, 500, (rows, width)).astype(dtype)


# ------------------------------------------------------------------------------ rows
@pytest.mark.parametrize("name", ["reset_rows", "move_rows", "swap_rows"])
def test_row_kernels_match_naive_and_refuse_before_writing(name, rng):
    """A row kernel that wrapped a negative row differently, let a later source see an
    earlier destination's write (overlap), or wrote some rows before meeting a bad
    index would leave annotations unlike the naive version's; a refusal must report
    the first bad position (``K + i`` for ``dst[i]``) and change nothing."""
    kernel, twin = getattr(native.rows, name), getattr(naive, name)
    refused = overlapping = 0
    for _ in range(CASES * 2):
        num_rows, count = int(rng.integers(1, 6)), int(rng.integers(0, 6))
        dtype = INDEX_DTYPES[int(rng.integers(2))]
        reach = num_rows + (2 if rng.random() < 0.4 else 0)  # sometimes out of range
        src = rng.integers(-reach, reach, count).astype(dtype)
        dst = rng.integers(-reach, reach, count).astype(dtype)
        values = rng.integers(0, 100, num_rows).astype(np.int32)
        got = values.copy()
        if name == "reset_rows":
            code = kernel(got, src)
            want_code, want = twin(values, src)
        else:
            code = kernel(got, src, dst, np.empty(2 * count, np.int32))
            want_code, want = twin(values, src, dst)
            overlapping += bool(set(src % num_rows) & set(dst % num_rows))
        assert code == want_code
        assert_same([got], [want])
        refused += code >= 0
    assert 0 < refused < CASES * 2
    assert name == "reset_rows" or overlapping > CASES // 2


def test_row_scans_report_the_first_index_outside_the_rows(rng):
    """The scans decide what the row kernels refuse: an off-by-one at ``-R`` or ``R``
    would let a bad index through (or refuse a good one)."""
    for _ in range(CASES):
        num_rows, count = int(rng.integers(1, 6)), int(rng.integers(0, 6))
        dtype = INDEX_DTYPES[int(rng.integers(2))]
        src = rng.integers(-num_rows - 1, num_rows + 1, count).astype(dtype)
        dst = rng.integers(-num_rows - 1, num_rows + 1, count).astype(dtype)
        assert (native.rows.first_row_outside(src, num_rows)
                == naive.first_row_outside(src, num_rows))
        assert (native.rows.first_pair_outside(src, dst, num_rows)
                == naive.first_pair_outside(src, dst, num_rows))


# ----------------------------------------------------------------------------- carry
def test_carry_kernels_match_naive(rng):
    """A carry taken by the wrong request or at the wrong seam hands over another
    request's hidden state; check_take must name the first failing condition."""
    state = np.array([1, 5, 9], dtype=np.int64)
    codes = set()
    for _ in range(CASES):
        req_id, position = (int(v) for v in rng.integers(-3, 4, 2))
        if rng.random() < 0.3:
            native.carry.invalidate(state)
            np.testing.assert_array_equal(state, [0, -1, -1])
        else:
            native.carry.record(state, req_id, position)
            np.testing.assert_array_equal(state, [1, req_id, position])
        takes = [(req_id, position), (req_id + 1, position), (req_id, position - 1),
                 tuple(int(v) for v in rng.integers(-3, 4, 2))]
        for take_req, take_position in takes:
            before = state.copy()
            code = native.carry.check_take(state, take_req, take_position)
            assert code == naive.check_take(state, take_req, take_position)
            np.testing.assert_array_equal(state, before)
            codes.add(code)
    assert codes == {0, 1, 2, 3}


# ---------------------------------------------------------------------------- checks
def test_bound_scans_match_naive(rng):
    """first_outside is the wrappers' bound check and min_max their range check: an
    off-by-one at either bound, or a count misread, lets bad input reach a kernel."""
    for _ in range(CASES):
        dtype = INDEX_DTYPES[int(rng.integers(2))]
        values = rng.integers(-5, 15, int(rng.integers(0, 8))).astype(dtype)
        low, high = int(rng.integers(-3, 3)), int(rng.integers(3, 12))
        assert (native.checks.first_outside(values, low, high)
                == naive.first_outside(values, low, high))
        count = int(rng.integers(0, len(values) + 1))
        assert native.checks.min_max(values, count) == naive.min_max(values, count)


def test_closed_bound_scan_matches_naive(rng):
    """first_outside_closed takes a dtype's own maximum as an inclusive bound: an
    exclusive one would refuse int8's 127, a missed one let 128 wrap to -128."""
    for _ in range(CASES):
        values = rng.integers(-130, 130, int(rng.integers(0, 8))).astype(
            INDEX_DTYPES[int(rng.integers(2))])
        low, high = sorted((int(rng.integers(-130, 130)), int(rng.integers(-130, 130))))
        assert (native.checks.first_outside_closed(values, low, high)
                == naive.first_outside_closed(values, low, high))


def _block_table(rng, rows: int, width: int) -> np.ndarray:
    """Block ids with unallocated (-1) and too-wide (300) entries among real ones."""
    table = rng.integers(0, 100, (rows, width))
    table[rng.random((rows, width)) < 0.2] = -1
    table[rng.random((rows, width)) < 0.1] = 300
    return table.astype(INDEX_DTYPES[int(rng.integers(2))])


def test_written_block_scans_match_naive(rng):
    """The block-id scans behind the writers, the commit pass and each draft depth: a
    redirected column scanned would refuse a legal inherited -1, an unscanned written
    one let block -1 (or a wrapped id, here 300 into int8's 127) reach the KV cache."""
    block_size, width, high = 4, 5, 127
    for _ in range(CASES):
        num_rows = int(rng.integers(1, 5))
        table = _block_table(rng, num_rows, width)
        inherited = rng.integers(-1, width + 2, num_rows)  # -1 and W + 1 are refused
        has_inherited = bool(rng.integers(2))
        T = int(rng.integers(0, 10))
        rows = rng.integers(0, num_rows, T)
        positions = rng.integers(0, width * block_size, T)
        assert native.checks.first_bad_token_block(
            rows, positions, table, inherited, has_inherited, block_size, width,
            high) == naive.first_bad_token_block(
                rows, positions, table, inherited if has_inherited else None, block_size,
                width, high)
        counts = rng.integers(0, 6, num_rows)
        starts = rng.integers(0, width * block_size - 5, num_rows)
        has_starts = bool(rng.integers(2))
        assert native.checks.first_bad_commit_block(
            counts, starts, has_starts, table, inherited, has_inherited, block_size,
            width, high) == naive.first_bad_commit_block(
                counts, starts if has_starts else None, table,
                inherited if has_inherited else None, block_size, width, high)
        offsets = rng.integers(-2, width * block_size + 3, num_rows).astype(np.int32)
        count = int(rng.integers(0, num_rows + 1))
        assert native.checks.first_bad_draft_block(
            offsets, table, count, block_size, high) == \
            naive.first_bad_draft_block(offsets, table, count, block_size, high)


# ---------------------------------------------------------------- staging: draft loop
def test_draft_loop_kernels_match_naive(rng):
    """The draft loop's host state: a start position past the table copied anyway, a
    row beyond ``count`` touched, or a KV length off by one would send a draft token's
    attention to the wrong keys."""
    accepted = refused = 0
    for _ in range(CASES):
        num_rows, width, block_size = geometry(rng)
        count = int(rng.integers(0, num_rows + 1))
        offsets = rng.integers(0, 50, num_rows).astype(np.int32)
        table = block_table(rng, num_rows, width)
        limit = width * block_size
        starts = rng.integers(-1 if rng.random() < 0.3 else 0,
                              limit + (1 if rng.random() < 0.3 else 0), num_rows)
        table_src = block_table(rng, num_rows, width).astype(table.dtype)

        got_offsets, got_table = offsets.copy(), table.copy()
        ok = native.draft_state.copy_decode_inputs(starts, table_src, count, block_size,
                                               got_offsets, got_table)
        want_ok, want_offsets, want_table = naive.copy_decode_inputs(
            starts, table_src, count, block_size, offsets, table)
        assert ok == want_ok == native.draft_state.offsets_in_table(starts, count, block_size,
                                                                width)
        assert_same([got_offsets, got_table], [want_offsets, want_table])
        accepted += ok
        refused += not ok

        native.draft_state.fill_capture_state(got_offsets, got_table, count, DUMMY)
        assert_same([got_offsets, got_table],
                    naive.fill_capture_state(want_offsets, want_table, count, DUMMY))

        advanced = offsets.copy()
        native.draft_state.advance_offsets(advanced, count)
        assert_same([advanced], [naive.advance_offsets(offsets, count)])

        q, kv = garbage(rng, num_rows, np.int32), garbage(rng, num_rows, np.int32)
        want_max, want_q, want_kv = naive.stage_decode_lengths(offsets, count, q, kv)
        assert native.staging.stage_decode_lengths(offsets, count, q, kv) == want_max
        assert_same([q, kv], [want_q, want_kv])
    assert accepted and refused


def decode_case(rng: np.random.Generator):
    """``(offsets, table, count, padded, block_size, q, kv, view)`` of a random draft
    depth: about one case in five has an offset past the table or a negative one."""
    num_rows, width, block_size = geometry(rng)
    count = int(rng.integers(0, num_rows + 1))
    padded = count + int(rng.integers(0, 3))
    high = width * block_size + (1 if rng.random() < 0.2 else 0)
    offsets = rng.integers(-1 if rng.random() < 0.2 else 0, high,
                           num_rows).astype(np.int32)
    table = block_table(rng, num_rows, width)
    q, kv = garbage(rng, num_rows, np.int32), garbage(rng, num_rows, np.int32)
    view = token_outputs(rng, padded + 2) + mha_outputs(rng, padded + 1, width)
    return offsets, table, count, padded, block_size, q, kv, view, block_high(rng, table)


def block_high(rng: np.random.Generator, table: np.ndarray) -> int:
    """The largest block id a kernel may write: mostly above every entry of ``table``,
    in about one case in four a bound some entries exceed; in about one in eight an
    entry is made negative (unallocated)."""
    if rng.random() < 0.125:
        table[rng.integers(table.shape[0]), rng.integers(table.shape[1])] = -1
    return int(rng.integers(0, 500)) if rng.random() < 0.25 else 1000


def test_decode_step_matches_naive_and_refuses_offsets_past_the_table(rng):
    """decode_step fuses the token maps, the decode lengths and the MHA metadata: a
    draft token written to the wrong block or slot, a pad token left writing real KV,
    or a partial write before an offset past the table is caught would corrupt KV."""
    accepted = refused = 0
    for _ in range(CASES):
        offsets, table, count, padded, block_size, q, kv, view, high = decode_case(rng)
        want_max, want_q, want_kv, want_view = naive.decode_step(
            offsets, table, count, padded, block_size, DUMMY, high, q, kv, view)
        full = np.full(max(count, 1), table.shape[1], np.int32)  # no block counts
        got_max = native.staging.decode_step(offsets, table, full, count, padded,
                                             block_size, DUMMY, high, q, kv, *view)
        assert got_max == want_max
        assert_same([q, kv] + view, [want_q, want_kv] + want_view)
        refused += got_max < 0
        accepted += got_max >= 0
    assert accepted and refused


def test_decode_step_maps_equals_decode_step_without_touching_a_table(rng):
    """The mirror path's per-depth kernel: everything decode_step writes except the
    MHA block table, which the mirror path places device-to-device from the persistent
    table. A wrong token map or length corrupts KV; a table write here would put the
    [padded, W] table back into every depth's pinned staging."""
    accepted = refused = 0
    for _ in range(CASES):
        offsets, table, count, padded, block_size, q, kv, view, high = decode_case(rng)
        want_max, want_q, want_kv, want_view = naive.decode_step(
            offsets, table, count, padded, block_size, DUMMY, high, q, kv, view)
        table_before = view[9].copy()
        full = np.full(max(count, 1), table.shape[1], np.int32)  # no block counts
        got_max = native.staging.decode_step_maps(offsets, table, full, count, padded,
                                                  block_size, DUMMY, high, q, kv, *view[:9])
        assert got_max == want_max
        assert_same([q, kv] + view[:9], [want_q, want_kv] + want_view[:9])
        assert_same([view[9]], [table_before])
        refused += got_max < 0
        accepted += got_max >= 0
    assert accepted and refused


# --------------------------------------------------------------- staging: token maps
def test_token_input_scan_matches_naive(rng):
    """check_token_inputs guards write_token_maps, which trusts its inputs: the wrong
    code or culprit turns into a wrong message, a missed one into a KV write past the
    table."""
    codes = set()
    for _ in range(CASES * 2):
        _, width, block_size = geometry(rng)
        num_table_rows = int(rng.integers(1, 5))
        count = int(rng.integers(0, 6))
        dtype = INDEX_DTYPES[int(rng.integers(2))]
        rows = rng.integers(-1, num_table_rows + 1, count).astype(dtype)
        positions = rng.integers(-2, width * block_size + 3, count).astype(dtype)
        num_inherited = int(rng.integers(0, num_table_rows + 1)) if rng.random() < 0.5 \
            else None
        got = native.checks.check_token_inputs(
            rows, positions, num_table_rows, num_inherited or 0, num_inherited is not None,
            width, block_size)
        want = naive.check_token_inputs(rows, positions, num_table_rows, num_inherited,
                                        width, block_size)
        assert got == want
        codes.add(got[0])
    assert codes == {0, 1, 2, 3, 4}


def valid_tokens(rng: np.random.Generator, num_table_rows: int, width: int,
                 block_size: int) -> Tuple[np.ndarray, np.ndarray]:
    count = int(rng.integers(0, 7))
    dtype = INDEX_DTYPES[int(rng.integers(2))]
    rows = rng.integers(0, num_table_rows, count).astype(dtype)
    positions = rng.integers(0, width * block_size, count).astype(dtype)
    return rows, positions


@pytest.mark.parametrize("has_inherited", [False, True])
def test_write_token_maps_matches_naive(has_inherited, rng):
    """Each real token writes its block (the dummy where its column is inherited), slot,
    request and positions; each pad token the dummy block's slot 0 and nothing else;
    every element past ``padded`` stays as it was."""
    for _ in range(CASES):
        _, width, block_size = geometry(rng)
        num_table_rows = int(rng.integers(1, 5))
        rows, positions = valid_tokens(rng, num_table_rows, width, block_size)
        table = block_table(rng, num_table_rows, width)
        inherited = rng.integers(0, width + 1, num_table_rows).astype(
            INDEX_DTYPES[int(rng.integers(2))])
        padded = len(positions) + int(rng.integers(0, 3))
        outputs = token_outputs(rng, padded + 2)
        want = naive.token_maps(rows, positions, table, inherited if has_inherited else None,
                                padded, block_size, DUMMY, outputs)
        native.staging.write_token_maps(
            rows, positions, table, inherited if has_inherited else np.zeros(1, np.int64),
            has_inherited, padded, block_size, DUMMY, *outputs)
        assert_same(outputs, want)


# -------------------------------------------------------------- staging: commit pass
def test_commit_input_scan_matches_naive_without_wrapping(rng):
    """check_commit_inputs guards the commit pass, which trusts its inputs. Its spans
    end at ``start + count - 1``; huge starts and counts must be refused as past the
    table, never wrapped in int64 into a small, 'valid' position."""
    codes = set()
    huge = np.iinfo(np.int64).max  # start + count - 1 wraps for any start or count >= 2
    huge_cases = 0
    for _ in range(CASES * 2):
        _, width, block_size = geometry(rng)
        num_prefill = int(rng.integers(0, 5))
        counts = rng.integers(-1 if rng.random() < 0.2 else 0, 6, num_prefill)
        starts = rng.integers(-1 if rng.random() < 0.2 else 0, width * block_size + 1,
                              num_prefill)
        if num_prefill and rng.random() < 0.3:
            (counts if rng.random() < 0.5 else starts)[int(rng.integers(num_prefill))] = huge
            huge_cases += 1
        dtype = INDEX_DTYPES[int(rng.integers(2))] if counts.max(initial=0) < 2**31 \
            else np.int64
        counts = counts.astype(dtype)
        has_starts = bool(rng.random() < 0.7)
        got = native.checks.check_commit_inputs(
            counts, starts if has_starts else np.zeros(1, np.int64), has_starts, width,
            block_size)
        want = naive.check_commit_inputs(counts, starts if has_starts else None, width,
                                         block_size)
        assert got == want
        codes.add(got[0])
    assert codes == {0, 3, 4, 5} and huge_cases


def valid_commit(rng: np.random.Generator, num_rows: int, width: int, block_size: int):
    """``(counts, starts, inherited)`` of 0..R requests whose spans fit the table."""
    num_prefill = int(rng.integers(0, num_rows + 1))
    limit = width * block_size
    dtype = INDEX_DTYPES[int(rng.integers(2))]
    starts = rng.integers(0, limit, num_prefill)
    counts = rng.integers(0, limit - starts + 1)
    counts[rng.random(num_prefill) < 0.2] = 0
    inherited = rng.integers(0, width + 1, num_prefill)
    return counts.astype(dtype), starts.astype(dtype), inherited.astype(dtype)


@pytest.mark.parametrize("has_starts,has_inherited",
                         [(False, False), (True, False), (True, True)])
def test_write_commit_token_maps_matches_naive(has_starts, has_inherited, rng):
    """Request ``r`` owns row ``r`` and its ``counts[r]`` consecutive positions from
    ``starts[r]``: a token credited to the wrong request, an inherited column not sent
    to the dummy block, or a pad token writing real KV corrupts another request's
    cache."""
    for _ in range(CASES):
        num_rows, width, block_size = geometry(rng)
        counts, starts, inherited = valid_commit(rng, num_rows, width, block_size)
        table = block_table(rng, max(len(counts), 1), width)
        total = int(counts.sum())
        padded = total + int(rng.integers(0, 3))
        outputs = token_outputs(rng, padded + 2)
        rows, positions = naive.commit_rows_positions(counts,
                                                      starts if has_starts else None)
        want = naive.token_maps(rows, positions, table,
                                inherited if has_inherited else None, padded, block_size,
                                DUMMY, outputs)
        got_total = native.staging.write_commit_token_maps(
            counts, starts if has_starts else np.zeros(1, np.int64), has_starts, table,
            inherited if has_inherited else np.zeros(1, np.int64), has_inherited, padded,
            block_size, DUMMY, *outputs)
        assert got_total == total
        assert_same(outputs, want)


def test_stage_prefill_lengths_matches_naive(rng):
    """The TP pad tokens go to a spare request slot, or grow the last request of a
    full batch; a slot too many or a length off by the pad skews every cu_seqlen."""
    for _ in range(CASES):
        max_requests = int(rng.integers(1, 6))
        counts = rng.integers(0, 9, int(rng.integers(0, max_requests + 1))).astype(
            INDEX_DTYPES[int(rng.integers(2))])
        pad_tokens = int(rng.integers(0, 4))
        lengths = garbage(rng, max_requests + 1, np.int32)
        want_staged, want = naive.stage_prefill_lengths(counts, pad_tokens, max_requests,
                                                        lengths)
        assert native.staging.stage_prefill_lengths(counts, pad_tokens, max_requests,
                                                    lengths) == want_staged
        assert_same([lengths], [want])


def test_write_mha_metadata_matches_naive(rng):
    """Real slots carry their lengths, running sums and table rows (the dummy for a pad
    request with no table row); pad slots zero lengths, flat sums and rows of -1; an
    error in any of them makes attention read the wrong keys."""
    for _ in range(CASES):
        num_rows, width, _ = geometry(rng)
        count = int(rng.integers(0, num_rows + 1))
        num_table_rows = int(rng.integers(0, count + 1))
        padded = count + int(rng.integers(0, 3))
        dtype = INDEX_DTYPES[int(rng.integers(2))]
        q = rng.integers(0, 20, num_rows).astype(dtype)
        kv = rng.integers(0, 60, num_rows).astype(dtype)
        table = block_table(rng, max(num_table_rows, 1), width)
        outputs = mha_outputs(rng, padded + 1, width)
        want_maxima, want = naive.mha_metadata(q, kv, count, table, num_table_rows, padded,
                                               DUMMY, outputs)
        got_maxima = native.staging.write_mha_metadata(q, kv, count, table, num_table_rows,
                                                       padded, DUMMY, *outputs)
        assert got_maxima == want_maxima
        assert_same(outputs, want)


@pytest.mark.parametrize("has_starts,has_inherited", [(False, False), (True, True)])
def test_commit_pass_matches_naive(has_starts, has_inherited, rng):
    """The fused commit pass: token maps, lengths with the pad absorbed, MHA metadata
    over ``max(min_padded_requests, m)`` slots, table rows from ``first_table_row`` on.
    Any field off against the composed naive steps is a KV write or read in the wrong
    place."""
    full_batches = shifted = refused = 0
    for _ in range(CASES):
        num_rows, width, block_size = geometry(rng)
        counts, starts, inherited = valid_commit(rng, num_rows, width, block_size)
        num_prefill, total = len(counts), int(counts.sum())
        pad_tokens = int(rng.integers(0, 4))
        padded_tokens = total + pad_tokens
        min_padded = int(rng.integers(0, num_rows + 1))
        slots = max(min_padded, num_prefill + 1)
        table = block_table(rng, num_rows, width)
        high = block_high(rng, table)
        lengths = garbage(rng, num_rows + 1, np.int32)
        view = token_outputs(rng, padded_tokens + 2) + mha_outputs(rng, slots + 1, width)
        absorbs = num_prefill == num_rows and pad_tokens > 0
        # Rows placed from elsewhere (the mirror path's device table): never the row
        # that absorbs the pad.
        first_row = int(rng.integers(0, max(num_prefill - absorbs, 0) + 1))
        want_result, want_lengths, want_view = naive.commit_pass(
            counts, starts if has_starts else None, table,
            inherited if has_inherited else None, padded_tokens, pad_tokens, num_rows,
            min_padded, block_size, DUMMY, lengths, view, first_row, width, high)
        got_result = native.staging.commit_pass(
            counts, starts if has_starts else np.zeros(1, np.int64), has_starts, table,
            inherited if has_inherited else np.zeros(1, np.int64), has_inherited,
            padded_tokens, pad_tokens, num_rows, min_padded, block_size, DUMMY, first_row,
            width, high, lengths, *view)
        refused += got_result[0] < 0
        assert got_result == want_result
        assert_same([lengths] + view, [want_lengths] + want_view)
        full_batches += absorbs
        shifted += first_row > 0 and absorbs
    assert full_batches and shifted and refused


def test_matching_rows_matches_naive(rng):
    """The mirror path places a commit's leading ``k`` table rows from the device copy
    when this says every entry of them equals the host copy, and stops at the first row
    that differs; a miss in any column (including the last, or of a wider dtype's high
    bits) is a wrong block read."""
    full = partial = 0
    for _ in range(4 * CASES):
        num_rows, width, _ = geometry(rng)
        truth = block_table(rng, num_rows, width).astype(np.int32)
        table = np.concatenate([truth, rng.integers(0, 500, (num_rows, 2))], axis=1)
        table = table.astype(INDEX_DTYPES[int(rng.integers(2))])
        for _ in range(int(rng.integers(0, 3))):
            row, col = int(rng.integers(num_rows)), int(rng.integers(width))
            table[row, col] += (1 << 32) if table.dtype == np.int64 and rng.random() < .5 \
                else 1
        count = int(rng.integers(0, num_rows + 1))
        want = naive.matching_rows(table, truth, count)
        assert native.draft_state.matching_rows(table, truth, count) == want
        full += want == count
        partial += 0 < want < count
    assert full and partial


def test_used_columns_matches_naive(rng):
    """A wide default-route call ships each row only up to this count and -1 past it:
    a count one short drops a real block (a wrong block read), and one that misses a
    block after a -1 hole, or in the last column, does too."""
    scan = native.draft_state.used_columns
    holes = last = 0
    for _ in range(4 * CASES):
        num_rows, width, _ = geometry(rng)
        table = np.full((num_rows, width), -1, INDEX_DTYPES[int(rng.integers(2))])
        for i in range(num_rows):
            used = int(rng.integers(0, width + 1))
            table[i, :used] = rng.integers(-1, 500, size=used)  # -1 holes inside
        count = int(rng.integers(0, num_rows + 1))
        want_out, got_out = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
        want = naive.used_columns(table, count, want_out)
        assert scan(table, count, got_out) == want
        assert np.array_equal(got_out[:count], want_out[:count])
        holes += bool(count) and bool((table[:count] == -1).any())
        last += bool(count) and int(want_out[:count].max()) == width
    assert holes and last


# ------------------------------------------------------------------- docstring examples
def kernel_functions(module) -> Iterator[Tuple[str, object]]:
    """``(qualified name, Python function)`` of each kernel defined in ``module``; the
    dispatcher's ``py_func`` with JIT on, the function itself with NUMBA_DISABLE_JIT."""
    for name, obj in vars(module).items():
        func = getattr(obj, "py_func", obj)
        if inspect.isfunction(func) and func.__module__ == module.__name__:
            yield f"{module.__name__}.{name}", func


@pytest.mark.parametrize("module", NATIVE_MODULES, ids=lambda m: m.__name__.split(".")[-1])
def test_kernel_docstring_examples_hold(module):
    """The worked examples in the kernel docstrings are what a reader checks an index
    transformation against; run as doctests (calling the jitted kernels, or the Python
    ones under NUMBA_DISABLE_JIT) they cannot drift from the code. Every public kernel
    has one unless WITHOUT_EXAMPLE says where it is shown."""
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report: List[str] = []
    missing = []
    # Under NUMBA_DISABLE_JIT a kernel returns numpy scalars where the jitted one returns
    # Python ints; numpy 2's legacy printing shows both as ``12``.
    legacy = "1.25" if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else False
    with np.printoptions(legacy=legacy):
        for name, func in kernel_functions(module):
            tests = [t for t in finder.find(func, name, globs={**vars(module), "np": np})
                     if t.examples]
            if not tests and not name.rsplit(".", 1)[-1].startswith("_") \
                    and name not in WITHOUT_EXAMPLE:
                missing.append(name)
            for test in tests:
                runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)
    assert results.attempted > 0
    assert not missing, f"kernels without a docstring example: {missing}"
