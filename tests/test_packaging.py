"""The wheel carries the license and metadata a user's tools read (pip show, SBOM and
licence scanners): the Apache-2.0 text, the SPDX expression, the project URLs."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel of this checkout's sources, built from a copy (setuptools writes build/
    and egg-info beside the sources) without dependencies or build isolation (the
    installed setuptools; about 3 s)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for name in ("mtpmeta", "native"):
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(source)],
                   check=True, capture_output=True)
    (path,) = out.glob("mtpmeta-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def _member(archive: zipfile.ZipFile, suffix: str) -> str:
    (name,) = [n for n in archive.namelist() if n.endswith(suffix)]
    return archive.read(name).decode()


def test_license_file_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_wheel_ships_the_license_and_spdx_metadata(wheel):
    assert _member(wheel, ".dist-info/licenses/LICENSE") == (ROOT / "LICENSE").read_text()
    metadata = email.message_from_string(_member(wheel, ".dist-info/METADATA"))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Issues"} <= set(urls)


def test_wheel_holds_the_library_and_both_tool_packages(wheel):
    names = set(wheel.namelist())
    for module in ("mtpmeta/metadata.py", "mtpmeta/native/__init__.py",
                   "mtpmeta/bench/cli.py", "mtpmeta/simulate/cli.py", "mtpmeta/py.typed"):
        assert module in names
