"""The repository describes the product as it is, not how it was made.

Failure story: a comment that says why code exists in terms of a tracker ticket, a work
round or a commit ("fixed in <hash>", "see the last round") stops explaining anything
once the reader has no access to that history, and a comment that names a module that
was moved sends the reader to a file that is not there. The documents drift the same
way: a results page that grows run by run until the current figures are lost in the
log, a maintainer's map whose import diagram no longer matches the contract CI checks.

So: no tracked text file names development history; every ``mtpmeta.x`` / ``mtpmeta/x``
path a file names exists; BENCHMARKS.md stays at most 200 lines and docs/architecture.md
at most 350; the layer diagram of docs/architecture.md is pyproject.toml's
``[tool.importlinter]`` layers, in order.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the CI interpreter is 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

#: Words that only make sense inside the project's development history.
HISTORY = re.compile(
    r"\bstop\s+\d+"
    r"|\bthis\s+stop\b"
    r"|\bissue\s+#?\d+"
    r"|\bthis\s+revision\b"
    r"|\bsession\b"
    r"|\bitems?\s+\d+"
    r"|\brounds?\s+\d+",
    re.IGNORECASE)

#: A commit hash: 7 to 40 hex digits with at least one letter and one digit (plain
#: numbers and hex words such as ``deadbeef`` are data, not history).
COMMIT = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")

#: Modules that no longer exist under these names, named as a module (``name.py``,
#: ``name.attribute`` or ````name````); a local variable may still use the word.
MOVED = re.compile(
    r"\b(?:mirror_counts|shadow_stage|kernel_entry|check_bounds|writer_checks"
    r"|mirror_staging|mirror_device|invariants_view|device_loop)"
    r"(?:\.py\b|\.[A-Za-z_]|``)")

#: ``mtpmeta.a.b`` or ``mtpmeta/a/b`` as a path into the package (not inside a URL or a
#: file name such as ``dist/mtpmeta-1.0``).
PACKAGE_PATH = re.compile(r"(?<![\w/.-])mtpmeta((?:[./][A-Za-z_]\w*)+)")

BENCHMARKS_MAX_LINES = 200
ARCHITECTURE_MAX_LINES = 350


def tracked_text_files() -> list:
    """Every file git tracks, as ``(relative path, text)``; binary files left out."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    files = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if path.resolve() == THIS or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            files.append((name, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return files


def hits(pattern: re.Pattern, files: list) -> list:
    found = []
    for name, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            for match in pattern.finditer(line):
                found.append(f"{name}:{number}: {match.group(0)!r} in {line.strip()[:100]}")
    return found


def package_path_exists(dotted: str) -> bool:
    """``/kernels/loader`` or ``.reference.ReferenceMTPMetadata``: a folder or module of
    the package, optionally followed by a name that module or package defines."""
    parts = re.split(r"[./]", dotted.strip("./"))
    here = ROOT / "mtpmeta"
    for index, part in enumerate(parts):
        if part.startswith("__") and part.endswith("__") and part != "__main__":
            return True  # a module attribute such as ``__file__``
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file() or (here / part).is_file() or part == "py":
            return True  # a module (what follows is its attribute) or a plain file
        init = here / "__init__.py"
        defined = init.is_file() and re.search(rf"\b{re.escape(part)}\b", init.read_text())
        return bool(defined) or (index == 0 and part == "native")
    return True


def test_no_tracked_file_names_development_history():
    """No tracker numbers, work rounds or other words of the development history in any
    tracked file (``HISTORY``): a comment gives the reason in the product's own terms."""
    found = hits(HISTORY, tracked_text_files())
    assert not found, "development history named:\n" + "\n".join(found)


def test_no_tracked_file_names_a_commit():
    found = hits(COMMIT, tracked_text_files())
    assert not found, "commit hashes named:\n" + "\n".join(found)


def test_no_tracked_file_names_a_moved_module():
    found = hits(MOVED, tracked_text_files())
    assert not found, "modules named by a path that no longer exists:\n" + "\n".join(found)


def test_every_package_path_a_file_names_exists():
    missing = []
    for name, text in tracked_text_files():
        for number, line in enumerate(text.splitlines(), 1):
            for match in PACKAGE_PATH.finditer(line):
                if not package_path_exists(match.group(1)):
                    missing.append(f"{name}:{number}: {match.group(0)}")
    assert not missing, "paths into the package that do not exist:\n" + "\n".join(missing)


def test_the_documents_stay_short():
    """BENCHMARKS.md states the current measurement, not a log of runs; the maintainer's
    map fits a sitting."""
    benchmarks = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    architecture = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    assert len(benchmarks) <= BENCHMARKS_MAX_LINES, len(benchmarks)
    assert len(architecture) <= ARCHITECTURE_MAX_LINES, len(architecture)


def contract_layers() -> list:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"]
                   if c["type"] == "layers"]
    return [sorted(part.strip() for part in layer.split("|")) for layer in contract["layers"]]


def diagram_layers() -> list:
    """The fenced block after the ``<!-- layers`` marker of docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers\b.*?-->\s*```[^\n]*\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no layer diagram after a <!-- layers --> marker"
    return [sorted(part.strip() for part in line.split("|"))
            for line in block.group(1).splitlines() if line.strip()]


def test_the_layer_diagram_is_the_import_contract():
    """Every layer the diagram names is one of the contract's, in the contract's order,
    and none is left out."""
    diagram, contract = diagram_layers(), contract_layers()
    named = {name for layer in diagram for name in layer}
    known = {name for layer in contract for name in layer}
    assert named <= known, f"the diagram names layers the contract lacks: {named - known}"
    assert diagram == contract
