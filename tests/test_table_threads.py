"""The opt-in threads of the table passes (``mtpmeta.kernels.table_threads``): the threaded
kernels write what the single-threaded ones write, every call takes the kernel its
setting names on the thread count it names, and a bad setting is refused. The
mirror-path oracle tests (``test_derived_packing``, ``test_block_counts``) also run
with two threads: views and buffers equal the reference's."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

import mtpmeta.kernels.table_threads
from mtpmeta import native
from tests.test_derived_packing import R, _pair, _route, _table
from tests.test_block_counts import step_inputs

KERNELS = {"used_columns": native.draft_state, "stage_counted_inputs": native.draft_state,
           "write_counted_rows": native.counts}
TWO = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="numba has one thread")


def _garbage(rng, shape, dtype):
    return rng.integers(-9000, -8000, shape).astype(dtype)


@pytest.mark.parametrize("seed", range(30))
def test_threaded_packed_rows_equal_the_single_threaded_ones(seed):
    """``stage_counted_inputs_threaded`` and ``write_counted_rows_threaded`` against
    their single-threaded kernels, outputs starting as the same garbage: known rows
    or none, fill D or -1, an absorbing request or none, pad and -1 rows."""
    rng = np.random.default_rng(seed)
    rows, width = int(rng.integers(1, 300)), int(rng.integers(1, 64))
    columns = int(rng.integers(1, width + 1))
    dtype = (np.int32, np.int64)[seed % 2]
    table = rng.integers(-1, 10_000, (rows, width)).astype(dtype)
    counts = rng.integers(0, columns + 1, rows).astype(np.int32)
    count = int(rng.integers(0, rows + 1))
    starts = rng.integers(0, columns * 4, rows).astype(np.int32)
    known = rng.integers(0, columns + 1, rows).astype(np.int32)
    known_rows, fill = int(rng.integers(0, rows + 1)), int(rng.choice([-1, 77]))
    outs = []
    for kernel in (native.draft_state.stage_counted_inputs,
                   native.draft_state.stage_counted_inputs_threaded):
        g = np.random.default_rng(seed + 1)
        offsets, packed = _garbage(g, rows, np.int32), _garbage(g, (rows, columns), dtype)
        used, widths = _garbage(g, rows, np.int32), known.copy()
        ok = kernel(starts, table, counts, count, 4, fill, width, offsets, packed, widths,
                    known_rows, used)
        outs.append((ok, offsets, packed, used, widths))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
    num_prefill = int(rng.integers(0, rows + 1))
    staged = int(rng.integers(num_prefill, rows + 1))
    padded = int(rng.integers(staged, rows + 1))
    absorb = int(rng.integers(-1, columns * 4))
    outs = []
    for kernel in (native.counts.write_counted_rows,
                   native.counts.write_counted_rows_threaded):
        g = np.random.default_rng(seed + 2)
        rows_out, widths = _garbage(g, (rows, columns), dtype), known.copy()
        kernel(table, counts, num_prefill, staged, padded, 77, fill, absorb, 4, widths,
               known_rows, rows_out)
        outs.append((rows_out, widths))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


@TWO
@pytest.mark.parametrize("threads", [1, 2])
def test_each_table_pass_takes_the_kernel_its_setting_names(threads, monkeypatch):
    """A derived begin and commit pass (scan, packed rows) and a counted commit pass:
    ``THREADS`` 1 calls the single-threaded kernels only, 2 the threaded ones only,
    on two of numba's threads."""
    calls = []
    for name, module in KERNELS.items():
        for kernel_name in (name, name + "_threaded"):
            kernel = getattr(module, kernel_name)
            monkeypatch.setattr(module, kernel_name,
                                lambda *a, _k=kernel, _n=kernel_name: calls.append(_n)
                                or _k(*a))
    monkeypatch.setattr(mtpmeta.kernels.table_threads, "THREADS", threads)
    numba.set_num_threads(1)
    _route(monkeypatch, True)
    rng = np.random.default_rng(threads)
    meta, view, _, _ = _pair(40, torch.int32)
    table = _table(rng, 40, rng.integers(1, 12, size=R))
    meta.begin_decode(R, R, np.zeros(R, np.int32), table, False)
    meta.end_forward()
    t = torch.from_numpy
    _, (spans, starts, table, counts, inherited, padded_tokens, padded_requests) = \
        step_inputs(rng, 1, 40)
    for block_counts in (None, t(counts)):
        meta.setup_commit_pass(view, t(spans), t(table), start_positions=t(starts),
                               inherited_blocks=t(inherited),
                               padded_token_count=padded_tokens,
                               padded_request_count=padded_requests,
                               **({} if block_counts is None else
                                  {"block_counts": block_counts}))
        meta.end_forward()
    suffix = "" if threads == 1 else "_threaded"
    assert calls == [n + suffix for n in ("used_columns", "stage_counted_inputs",
                                          "used_columns", "write_counted_rows",
                                          "write_counted_rows")]
    assert numba.get_num_threads() == (1 if threads == 1 else 2)


def test_a_bad_setting_is_refused_naming_the_variable_and_the_bound():
    """``MTPMETA_TABLE_THREADS``: '' is 1; not an integer, or outside [1,
    NUMBA_NUM_THREADS], is a ValueError naming the variable and the bound."""
    bound = numba.config.NUMBA_NUM_THREADS
    assert mtpmeta.kernels.table_threads.threads_from("") == 1
    assert mtpmeta.kernels.table_threads.threads_from(str(bound)) == bound
    for bad in ("0", "-1", str(bound + 1), "two"):
        with pytest.raises(ValueError, match=rf"MTPMETA_TABLE_THREADS.*\[1, {bound}\]"):
            mtpmeta.kernels.table_threads.threads_from(bad)
