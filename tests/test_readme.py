"""The README is the user's page, and its examples run.

Every ```python block of the README is marked with the line
``<!-- readme-test: run -->`` and is executed here, in order, in one fresh namespace per
block; each must end by printing a confirmation line starting with ``ok:`` that says
what it checked. A block that raises (a name it never defines, a CUDA device on a CPU
machine, an ``assert`` of a value the library no longer produces) or stops printing its
confirmation fails here, so the examples a first user copies cannot drift from the code.

The structure checks pin what a newcomer needs first (what it is, install, the two
commands, an example, and an honest line on what has been measured) and that the
developer material moved to ``docs/architecture.md`` is still reachable: every relative
link and every ``#anchor`` of the README and of that page resolves.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MARKER = "<!-- readme-test: run -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\s*\n```python\n(.*?)\n```", re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def runnable_blocks() -> list:
    """The marked python blocks of the README, as ``(line number, source)``."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1))
            for match in _BLOCK.finditer(text)]


def headings(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("## ")]


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces
    to hyphens."""
    title = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def test_the_readme_marks_its_runnable_examples():
    """Every python block is marked (none can drift unchecked), the speculative-step
    example is among them; a marker not followed by a python block would run nothing."""
    text = README.read_text()
    assert text.count(MARKER) == len(runnable_blocks()) >= 2
    assert text.count("```python") == len(runnable_blocks())
    assert any("setup_commit_pass" in source and "begin_decode" in source
               for _, source in runnable_blocks())


@pytest.mark.parametrize("line, source", runnable_blocks(),
                         ids=lambda value: f"line{value}" if isinstance(value, int) else "")
def test_readme_example_runs(line, source):
    """The block runs and its last output line is its confirmation (``ok: ...``)."""
    code = compile(source, f"README.md (block at line {line})", "exec")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {"__name__": "readme_example"})
    printed = out.getvalue().strip().splitlines()
    assert printed and printed[-1].startswith("ok: "), printed


def test_the_readme_puts_the_user_first():
    """Install, the two commands and the example come first; the page stays short; the
    developer material (the file tour, the guarantees' test ids) lives in
    docs/architecture.md."""
    text = README.read_text()
    assert len(text.splitlines()) < 250
    order = [h.split(" (")[0] for h in headings(text)][:3]
    assert order == ["## Install", "## The two commands", "## One speculative step"]
    assert "## Performance" in headings(text)
    performance = text.split("## Performance", 1)[1].split("\n## ", 1)[0]
    assert "](BENCHMARKS.md)" in performance
    assert "## Where things are" not in text and "## Where things are" in ARCHITECTURE.read_text()
    assert "tests/test_invariants.py::" not in text


def test_the_first_screen_says_what_has_been_measured():
    """Before Install: nothing has run on a GPU, the GPU claims rest on the simulator,
    host cost comes from the CPU and the meta device."""
    first = README.read_text().split("## Install", 1)[0]
    assert "Nothing has run on a GPU yet" in first
    assert "tests/cuda_sim.py" in first and "`meta` device" in first


def test_the_two_commands_are_the_bench_and_the_ci_test_command():
    """The README's two commands; .ci/run runs the README's test command as written."""
    text = README.read_text()
    commands = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", commands, re.S).group(1).splitlines()
    assert block == ["python -m mtpmeta bench --quick", "python -m pytest -q"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python -m pytest -q" in ci


def test_install_names_the_cpu_index_and_the_wheel_file():
    """The CPU line works off this machine (PyTorch's CPU index) and the wheel line
    names the file that `pip wheel` builds for this version."""
    install = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in install
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                        re.M).group(1)
    assert f"'dist/mtpmeta-{version}-py3-none-any.whl[bench]'" in install


@pytest.mark.parametrize("page", [README, ARCHITECTURE], ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    text = page.read_text()
    links = [link for link in _LINK.findall(text) if "://" not in link]
    assert links
    for link in links:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} points at nothing"
        if anchor:
            slugs = {slug(h) for h in target.read_text().splitlines()
                     if h.startswith("#")}
            assert anchor in slugs, f"{page.name}: #{anchor} is no heading of {target.name}"
