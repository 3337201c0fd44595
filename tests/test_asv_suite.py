"""The asv suite where the instruction counter's tools are missing.

Failure story: on a machine without valgrind (or without pytest-codspeed's hooks) the
instruction benchmarks' ``setup_cache`` raised, asv counted that as a failure and
``asv run`` exited 2, so the timing benchmarks' results were reported by a failing run.
The instruction benchmarks must be skipped at discovery and every other one kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Set

import pytest

pytest.importorskip("asv_runner")

ASV_DIR = Path(__file__).resolve().parent.parent / "asv_bench"
_DISCOVER = ("from asv_runner.discovery import disc_benchmarks\n"
             "for b in disc_benchmarks('benchmarks'): print(b.name)\n")


def _discovered(path: Optional[str]) -> Set[str]:
    """Names asv discovers in ``asv_bench/benchmarks``, in a new process whose PATH is
    ``path`` (None: this one's)."""
    env = dict(os.environ, PYTHONPATH=str(ASV_DIR))
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
