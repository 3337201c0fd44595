"""The README's examples run: every ```python block preceded by the marker line
``<!-- readme-test: run -->`` is executed, in order, in one fresh namespace per block.

A block that raises (a name it never defines, a CUDA device on a CPU machine, an
``assert`` of a value the library no longer produces) fails here, so the examples a
first user copies cannot drift from the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- readme-test: run -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\s*\n```python\n(.*?)\n```", re.DOTALL)


def runnable_blocks() -> list:
    """The marked python blocks of the README, as ``(line number, source)``."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1))
            for match in _BLOCK.finditer(text)]


def test_the_readme_marks_its_runnable_examples():
    """The speculative-step example is marked; a marker not followed by a python block
    would silently run nothing."""
    text = README.read_text()
    assert text.count(MARKER) == len(runnable_blocks()) >= 1
    assert any("setup_commit_pass" in source and "begin_decode" in source
               for _, source in runnable_blocks())


@pytest.mark.parametrize("line, source", runnable_blocks(),
                         ids=lambda value: f"line{value}" if isinstance(value, int) else "")
def test_readme_example_runs(line, source):
    code = compile(source, f"README.md (block at line {line})", "exec")
    exec(code, {"__name__": "readme_example"})
