"""The package runs from a source tree with nothing installed (``scripts/gpu_check.sh``
does, on machines where pip cannot install), and that script stays within its budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_gpu_check_installs_nothing_and_fits_in_five_minutes():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert not any(re.search(r"\bpip\b", line) for line in commands), "gpu_check.sh uses pip"
    timeouts = [int(t) for line in commands for t in re.findall(r"\btimeout (\d+)", line)]
    assert len(timeouts) >= 4, timeouts  # versions, tests, simulate, bench
    assert sum(timeouts) <= 280, f"worst case {sum(timeouts)} s of timeouts"
    # Every python3 invocation runs under a timeout.
    untimed = [line for line in commands if re.search(r"^\s*python3\b", line)]
    assert not untimed, untimed


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
    assert files == {f"tests/gpu/{p.name}" for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
