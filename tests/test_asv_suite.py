"""The asv suite: where the instruction counter's tools or CUDA are missing, and the
unit of its timings.

Failure stories: on a machine without valgrind (or without pytest-codspeed's hooks) the
instruction benchmarks' ``setup_cache`` raised, asv counted that as a failure and
``asv run`` exited 2, so the timing benchmarks' results were reported by a failing run.
The instruction benchmarks must be skipped at discovery and every other one kept.
Without CUDA, ``TimeStepCuda`` printed a table of 18 ``n/a`` (one process start each);
it must be skipped at discovery too. And the step benchmarks timed 4 steps per call,
so asv read 4x what ``mtpmeta bench`` reports per step: one call is one step now.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Set

import pytest
import torch

pytest.importorskip("asv_runner")

ASV_DIR = Path(__file__).resolve().parent.parent / "asv_bench"
_DISCOVER = ("from asv_runner.discovery import disc_benchmarks\n"
             "for b in disc_benchmarks('benchmarks'): print(b.name)\n")


def _discovered(path: Optional[str]) -> Set[str]:
    """Names asv discovers in ``asv_bench/benchmarks``, in a new process whose PATH is
    ``path`` (None: this one's)."""
    # The package itself may come from the source tree (PYTHONPATH), not an install.
    pythonpath = os.pathsep.join(filter(None, [str(ASV_DIR), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath)
    if path is not None:
        env["PATH"] = path
    result = subprocess.run([sys.executable, "-c", _DISCOVER], cwd=ASV_DIR, env=env,
                            capture_output=True, text=True, check=True)
    return set(result.stdout.split())


@pytest.fixture(scope="module")
def hidden(tmp_path_factory) -> Set[str]:
    """What asv discovers with an empty PATH, which hides valgrind."""
    return _discovered(str(tmp_path_factory.mktemp("empty-path")))


def test_instruction_benchmarks_are_skipped_without_valgrind(hidden):
    """The four instruction trackers are not discovered (so asv never runs their
    setup_cache); the timing benchmarks still are."""
    assert not {name for name in hidden if name.startswith("instructions.")}, hidden
    assert {name for name in hidden if ".time_" in name}, hidden
    assert any(name.startswith("step.") for name in hidden), hidden


def test_instruction_benchmarks_are_kept_where_they_can_run(hidden):
    """With valgrind and the hooks present the trackers are discovered, and they are
    all that hiding valgrind removes."""
    from mtpmeta.bench.instructions import unavailable

    if unavailable() is not None:
        pytest.skip(f"instructions cannot be counted here: {unavailable()}")
    found = _discovered(None)
    assert {"instructions.TrackInstructions.track_reference_over_direct_eager",
            "instructions.TrackInstructions.track_direct_instructions_per_step"} <= found
    assert found - {name for name in found if name.startswith("instructions.")} == hidden


@pytest.fixture
def load_benchmark():
    """Import ``asv_bench/benchmarks/<name>.py`` as asv does (``benchmarks.<name>``);
    the torch thread count that ``benchmarks/common.py`` sets to 1 is restored after
    the test."""
    threads = torch.get_num_threads()

    def load(name):
        sys.path.insert(0, str(ASV_DIR))
        try:
            return importlib.import_module(f"benchmarks.{name}")
        finally:
            sys.path.remove(str(ASV_DIR))

    yield load
    torch.set_num_threads(threads)


def test_cuda_benchmark_is_skipped_at_discovery_without_cuda(hidden, load_benchmark):
    """No CUDA: nothing of ``TimeStepCuda`` is discovered (no table of ``n/a``), its
    CPU twin is; and a setup reached anyway refuses with asv's skip, naming CUDA."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: TimeStepCuda runs here")
    assert "step.TimeStep.time_standard_step" in hidden
    assert not {name for name in hidden if "Cuda" in name}, hidden
    step = load_benchmark("step")
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        step.TimeStepCuda().setup("direct", 8, 1)


# (module, class, timed method, the workload function it calls, params)
PER_STEP = [
    ("step", "TimeStep", "time_standard_step", "run_step", ("direct", 8, 1)),
    ("decode", "TimeDraftLoop", "time_draft_loop", "run_draft", ("mirror", 8, 3)),
    ("commit", "TimeCommitPass", "time_commit_pass", "run_commit", ("direct", 8, 3)),
    ("rows", "TimeRows", "time_row_compaction", "run_rows", ("reference", 8, 3)),
    ("carry", "TimeCarry", "time_carry_and_take", "run_carry", ("direct", 64, 3)),
]


@pytest.mark.parametrize("module, cls, method, workload, params", PER_STEP,
                         ids=[row[1] for row in PER_STEP])
def test_one_timed_call_is_one_step(load_benchmark, monkeypatch, module, cls, method,
                                    workload, params):
    """Each call of a timing benchmark runs its workload once, for one step, so asv's
    time per call is a time per step; calls walk through all ``STEPS`` seeded steps in
    turn, so it averages over the same steps as before."""
    bench_module = load_benchmark(module)
    steps = load_benchmark("common").STEPS
    bench = getattr(bench_module, cls)()
    bench.setup(*params)
    seen = []
    real = getattr(bench_module, workload)

    def counting(*args):
        seen.append(next(arg for arg in args if type(arg).__name__ == "StepInputs"))
        return real(*args)

    monkeypatch.setattr(bench_module, workload, counting)
    timed = getattr(bench, method)
    timed(*params)
    assert len(seen) == 1, f"{cls}.{method}: {len(seen)} steps in one call"
    for _ in range(steps):
        timed(*params)
    assert len(bench.steps) == steps
    assert [id(x) for x in seen] == [id(s) for s in bench.steps] + [id(bench.steps[0])]


def test_asv_environments_get_the_cpu_torch_before_the_package():
    """An environment asv builds for a commit installs PyTorch's CPU wheel, pinned, from
    PyTorch's CPU index, and only then the package (which keeps that torch); before, the
    package's unpinned torch pulled PyPI's CUDA build (5.7 GB). The config loads as asv
    reads it (comments allowed)."""
    config = pytest.importorskip("asv.config")
    conf = config.Config.load(str(ASV_DIR / "asv.conf.json"))
    torch_line, package_line = conf.install_command
    assert re.search(r"pip install torch==\d+\.\d+\.\d+ ", torch_line), torch_line
    assert torch_line.endswith("--index-url https://download.pytorch.org/whl/cpu")
    assert package_line.endswith("pip install {wheel_file}")
