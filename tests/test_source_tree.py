"""The package runs from a source tree with nothing installed (``scripts/gpu_check.sh``
does, on machines where pip cannot install), that script stays within its budget, and
no module of the library grows past the house size."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Hide any installed or editable mapping of mtpmeta, then import it from PYTHONPATH.
_PROBE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
sys.path[:] = [p for p in sys.path if "site-packages" not in p or "__editable__" not in p]
import numpy as np
import mtpmeta
from mtpmeta import native
assert native is sys.modules["mtpmeta.native"]
print(mtpmeta.__file__)
print(native.__file__)
print(native.checks.first_outside(np.array([0, 5, -1], dtype=np.int32), 0, 4))
"""


def test_source_tree_import_loads_native_as_mtpmeta_native(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    package, kernels, first = done.stdout.split()
    assert Path(package) == ROOT / "mtpmeta" / "__init__.py"
    assert Path(kernels) == ROOT / "native" / "__init__.py"
    assert first == "1"  # index of 5, the first value outside [0, 4)


SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_gpu_check_installs_nothing_and_fits_in_five_minutes():
    """No pip; every step (python3 included) runs through ``step`` under a limit the
    budget bounds, and the default budget and the steps' caps fit in 280 s."""
    script = SCRIPT.read_text()
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert not any(re.search(r"\bpip\b", line) for line in commands), "gpu_check.sh uses pip"
    budget = int(re.search(r'budget="\$\{GPU_CHECK_BUDGET:-(\d+)\}"', script).group(1))
    summary_cap = int(re.search(r"^SUMMARY_CAP=(\d+)$", script, re.M).group(1))
    steps = re.findall(r"^step (\w+) (\S+) ", script, re.M)
    assert [name for name, _ in steps] == ["versions", "gpu_tests", "simulate", "bench",
                                           "summary"]
    caps = [summary_cap if cap == '"$SUMMARY_CAP"' else int(cap) for _, cap in steps]
    assert sum(caps) <= budget <= 280, (caps, budget)
    assert 'timeout -s INT -k "$GRACE" "$limit" "$@"' in script
    # Every interpreter invocation runs as a step, under its limit, on $PYTHON.
    untimed = [line for line in commands
               if re.search(r'^\s*("\$PYTHON"|python3?\b)', line)]
    assert not untimed, untimed
    assert 'PYTHON="${PYTHON:-python3}"' in script
    bare = [line for line in commands if re.search(r"^step .*\bpython3?\b", line)]
    assert not bare, bare


def test_gpu_check_runs_the_simulate_job_once():
    """The simulate engine's quick CLI run is the script's own step; the GPU tests'
    copy of that very run is deselected (each costs a fresh interpreter's compile), so
    simulate runs twice in all: that step and the GPU tests' in-process 200-step run."""
    script = SCRIPT.read_text()
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert sum("-m mtpmeta simulate" in line for line in commands) == 1
    deselected = re.findall(r"--deselect (\S+)", script)
    assert deselected == ["tests/gpu/test_simulate_cuda.py::test_cuda_cli_quick_run"]
    path, name = deselected[0].split("::")
    assert f"def {name}(" in (ROOT / path).read_text()
    # What that test checked, the summary checks on the step's result.
    assert 'summary["simulate_ok"]' in script and "missing_features" in script


def _tree(root: Path) -> set:
    return {path.relative_to(root).as_posix() for path in root.rglob("*")
            if ".git" not in path.relative_to(root).parts}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_gpu_check_runs_the_named_interpreter_and_leaves_nothing_behind(tmp_path):
    """``PYTHON`` names the interpreter every step runs; the run leaves nothing in the
    checkout and nothing in the temporary directory (its private one is removed on
    exit), only the output directory it was given."""
    marker = tmp_path / "ran"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >>"{marker}"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "NUMBA_CACHE_DIR")}
    env.update(PYTHON=str(wrapper), TMPDIR=str(temp))
    before = _tree(ROOT)
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert marker.read_text().startswith("-"), "the steps did not run $PYTHON"
    assert list(temp.iterdir()) == []
    assert _tree(ROOT) == before
    assert (tmp_path / "out" / "versions.log").exists()
    env["PYTHON"] = str(tmp_path / "no-such-python")
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out2")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout.strip() == f"gpu_check: interpreter '{env['PYTHON']}' not found " \
        "(set PYTHON)"


def test_gpu_check_steps_end_inside_the_budget_and_report_a_kill(tmp_path):
    """The script's ``step`` with a 6 s budget (1 s grace, 2 s for the summary): a step
    that would run for a minute is stopped at its own limit and recorded as killed
    (124), the next finds the budget spent and is recorded as not run, the summary's
    share is still there."""
    function = re.search(r"^step\(\) \{.*?^\}$", SCRIPT.read_text(), re.M | re.S).group(0)
    harness = f"""out={tmp_path}; : >"$out/steps.txt"
budget=6; GRACE=1; SUMMARY_CAP=2
{function}
step slow 100 sleep 60
step next 100 true
step summary 2 true
"""
    done = subprocess.run(["bash", "-c", harness], capture_output=True, text=True,
                          timeout=60)
    rows = [line.split() for line in (tmp_path / "steps.txt").read_text().splitlines()]
    assert [row[:2] for row in rows] == [["slow", "124"], ["next", "-"], ["summary", "0"]]
    assert re.search(r"gpu_check: slow killed at its [12] s limit", done.stdout)
    assert "gpu_check: next not run" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    """Without CUDA the script runs nothing and exits non-zero with one clear
    line, no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == ["gpu_check: no CUDA device visible to torch; nothing was run"]
    assert not (tmp_path / "out" / "gpu_tests.log").exists()


# After pytest's start-up (which imports its plugins, hypothesis's among them), a None
# entry in sys.modules makes every later import of hypothesis fail.
_NO_HYPOTHESIS = """
import sys, pytest
class NoHypothesis:
    def pytest_configure(self, config):
        sys.modules["hypothesis"] = None
sys.exit(pytest.main(sys.argv[1:], plugins=[NoHypothesis()]))
"""


def test_gpu_tests_collect_without_hypothesis():
    """A GPU box may have torch, numba, numpy and pytest only: tests/gpu (and what it
    imports from tests/) must collect with hypothesis unimportable, every file of it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(
        [sys.executable, "-c", _NO_HYPOTHESIS, "-q", "--collect-only", "-p",
         "no:cacheprovider", "-p", "no:hypothesispytest", "tests/gpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    files = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    gpu_files = (ROOT / "tests" / "gpu").glob("test_*.py")
    assert files == {f"tests/gpu/{path.name}" for path in gpu_files}


_MODULE_LINES = 400
# Kernels that call each other stay in one file: numba's on-disk cache does not notice
# changes in another file (the module's docstring says so).
_ONE_FILE_KERNELS = {"native/staging.py": 500}


def test_no_module_grows_past_the_house_size():
    """Every module of the library (``mtpmeta/``, tool packages included, and
    ``native/``) stays within 400 lines, so a reader can hold one; the one exception is
    the kernel file whose kernels call each other. Failure story: a module keeps growing
    until it holds two jobs and no one can tell either from its name."""
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for folder in ("mtpmeta", "native") for path in (ROOT / folder).rglob("*.py")}
    assert "mtpmeta/validation/checks.py" in sizes and "native/rows.py" in sizes
    too_long = {name: lines for name, lines in sizes.items()
                if lines > _ONE_FILE_KERNELS.get(name, _MODULE_LINES)}
    assert not too_long, f"split these modules along their jobs: {too_long}"
