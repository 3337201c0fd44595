"""The opt-in threads of the table passes (``mtpmeta.kernels.table_threads``): the threaded
kernels write what the single-threaded ones write, every call takes the kernel its
setting names on the thread count it names and leaves the caller's count as it was,
the passes run on a threading layer a forked child can use (or are refused, naming
the layer), two threads may run passes at once, and a bad setting is refused. The
mirror-path oracle tests (``test_derived_packing``, ``test_block_counts``) also run
with two threads: views and buffers equal the reference's."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

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
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def _layer_from_the_passes():
    """The tests below call the threaded kernels directly too: let the passes start
    numba's threading layer first, as a process that opts in does (a direct launch
    would start numba's default, OpenMP where present)."""
    if mtpmeta.kernels.table_threads._started_layer() is None:
        mtpmeta.kernels.table_threads.threading_layer()


def _run_script(source: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """``source`` in a fresh interpreter (the repository importable, numba's threading
    layer not set unless ``env`` sets it), killed after ``timeout`` seconds."""
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else []))
    environ.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=timeout)


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
    on two of numba's threads; the calling thread's numba count (1) is 1 again after
    them, so a caller's own parallel code keeps the count it set."""
    seen = []
    calls = []
    for name, module in KERNELS.items():
        for kernel_name in (name, name + "_threaded"):
            kernel = getattr(module, kernel_name)
            monkeypatch.setattr(module, kernel_name,
                                lambda *a, _k=kernel, _n=kernel_name: calls.append(_n)
                                or seen.append(numba.get_num_threads()) or _k(*a))
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
    assert seen == [threads] * 5
    assert numba.get_num_threads() == 1


def test_a_bad_setting_is_refused_naming_the_variable_and_the_bound():
    """``MTPMETA_TABLE_THREADS``: '' is 1; not an integer, or outside [1,
    NUMBA_NUM_THREADS], is a ValueError naming the variable and the bound."""
    bound = numba.config.NUMBA_NUM_THREADS
    assert mtpmeta.kernels.table_threads.threads_from("") == 1
    assert mtpmeta.kernels.table_threads.threads_from(str(bound)) == bound
    for bad in ("0", "-1", str(bound + 1), "two"):
        with pytest.raises(ValueError, match=rf"MTPMETA_TABLE_THREADS.*\[1, {bound}\]"):
            mtpmeta.kernels.table_threads.threads_from(bad)


FORK_CHILD = """
    import os, signal, sys
    import numpy as np
    import numba
    from mtpmeta.kernels import table_threads
    table = np.full((512, 512), -1, np.int64)
    table[:, :7] = 3
    def passes():
        out = np.zeros(512, np.int32)
        return table_threads.used_columns(table, 512, out) == 7 and (out == 7).all()
    assert passes()  # the first parallel launch of the process
    numba.set_num_threads(1)
    assert passes() and numba.get_num_threads() == 1
    print("layer", numba.threading_layer(), flush=True)
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a child hung in its threading layer ends
        os._exit(0 if passes() and passes() else 5)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
"""


@TWO
def test_a_forked_child_runs_threaded_passes_after_its_parent_did():
    """An engine that ran a threaded pass and then forks a worker: the worker's own
    threaded passes run and return the parent's results. On GNU OpenMP (numba's pick
    where present) the child is killed at its first parallel launch ("fork() called
    from a process already using GNU OpenMP") or hangs; the passes start a fork-safe
    layer instead, in a fresh process with ``NUMBA_THREADING_LAYER`` unset."""
    done = _run_script(FORK_CHILD, MTPMETA_TABLE_THREADS="2")
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    layer = done.stdout.split()[1]
    assert layer in mtpmeta.kernels.table_threads.FORK_SAFE


def test_a_layer_a_child_cannot_use_refuses_the_pass_naming_it(monkeypatch):
    """A process whose numba layer is OpenMP on Linux (``NUMBA_THREADING_LAYER=omp``,
    or another library's parallel kernel first): a threaded pass raises RuntimeError
    naming the layer, the fork-safe ones and both settings, and runs no kernel; with
    ``THREADS`` 1 the same pass runs on the calling thread."""
    calls = []
    for name in ("used_columns", "used_columns_threaded"):
        kernel = getattr(native.draft_state, name)
        monkeypatch.setattr(native.draft_state, name,
                            lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    threads_module = mtpmeta.kernels.table_threads
    monkeypatch.setattr(threads_module, "_layer", None)
    monkeypatch.setattr(threads_module, "FORK_SAFE", ("tbb", "workqueue"))
    monkeypatch.setattr(numba, "threading_layer", lambda: "omp")
    monkeypatch.setattr(threads_module, "THREADS", 2)
    table = np.full((4, 8), -1, np.int64)
    out = np.zeros(4, np.int32)
    with pytest.raises(RuntimeError, match=r"MTPMETA_TABLE_THREADS=2.*tbb or workqueue.*"
                                           r"'omp'.*NUMBA_THREADING_LAYER=forksafe"):
        threads_module.used_columns(table, 4, out)
    assert calls == []
    monkeypatch.setattr(threads_module, "THREADS", 1)
    assert threads_module.used_columns(table, 4, out) == 0
    assert calls == ["used_columns"]


@TWO
def test_two_threads_run_threaded_passes_at_once():
    """Two Python threads of one engine each run threaded passes: on numba's
    workqueue (not thread-safe) a second launch while one runs aborts the process
    ("Concurrent access has been detected"); the passes take turns on it."""
    source = """
        import threading
        import numpy as np
        from mtpmeta.kernels import table_threads
        table = np.full((4096, 64), -1, np.int64)
        table[:, :9] = 3
        failures = []
        def worker():
            out = np.zeros(4096, np.int32)
            for _ in range(300):
                if table_threads.used_columns(table, 4096, out) != 9:
                    failures.append(1)
        workers = [threading.Thread(target=worker) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not failures
    """
    done = _run_script(source, MTPMETA_TABLE_THREADS="2")
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
