"""The import layers of pyproject.toml's ``[tool.importlinter]`` contract hold.

Failure story: a lower layer that imports a higher one (a backend reaching into the
public class, a validation module into a backend) ties them into a circle, and a reader
can no longer follow a call downward by its name. import-linter checks the contract;
grimp (its graph) shows that nothing inside the package imports the package's own
``__init__``, which would hide such a circle behind the re-exports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_layers_contract_is_kept():
    pytest.importorskip("importlinter")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c",
                           "import sys; from importlinter.cli import lint_imports_command;"
                           "sys.exit(lint_imports_command())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 kept, 0 broken" in done.stdout


def test_no_module_of_the_package_imports_the_package_init():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("mtpmeta")
    assert sorted(graph.find_modules_that_directly_import("mtpmeta")) == []


def test_top_level_is_the_public_face():
    """At most eight modules beside the subpackages, each one of the public face."""
    top = sorted(path.stem for path in (ROOT / "mtpmeta").glob("*.py"))
    assert top == ["__init__", "__main__", "_version", "errors", "gpu_view", "metadata",
                   "types"]
