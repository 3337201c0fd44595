"""The ``mtpmeta`` commands' option handling.

Failure stories: ``--device gpu`` ended in a traceback, ``--tp 0`` and ``--depths 0`` in
a ZeroDivisionError, ``--max-requests 8`` silently became 193, and ``--json`` into a
missing directory failed only after the whole run. Each must be one line on stderr and
exit status 2, before any work: the commands' work functions are replaced here by ones
that fail the test if called.
"""

from __future__ import annotations

import re

import pytest
import torch

import mtpmeta
from mtpmeta.__main__ import main as mtpmeta_main
from mtpmeta.bench import cli as bench_cli
from mtpmeta.simulate import cli as simulate_cli


def _no_work(*args, **kwargs):
    raise AssertionError("the command started work before rejecting its options")


@pytest.fixture
def no_work(monkeypatch):
    """Every entry into real work of either command fails the test."""
    for name in ("make_steps", "check_identical", "measure", "cold_start", "new_view_cost"):
        monkeypatch.setattr(bench_cli, name, _no_work)
    monkeypatch.setattr(simulate_cli, "run_path", _no_work)


def _status(main, argv) -> int:
    """The exit status of ``main(argv)``, which must return it (argparse's own errors
    included), not raise SystemExit."""
    return main(argv)


def _one_line_error(capsys, prog: str) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: "), lines[0]
    return lines[0]


CUDA_MISSING = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine "
                                  "without CUDA: the error is about CUDA being missing")


@pytest.mark.parametrize("flags, says", [
    (["--device", "gpu"], "'gpu' is not a device"),
    (["--device", "meta"], "only cpu and cuda"),
    pytest.param(["--device", "cuda"], "CUDA is not available", marks=CUDA_MISSING),
    pytest.param(["--device", "cuda:0"], "CUDA is not available", marks=CUDA_MISSING),
    (["--tp", "0"], "--tp: 0 is below 1"),
    (["--depths", "0"], "--depths: 0 is below 1"),
    (["--block-size", "-3"], "--block-size: -3 is below 1"),
    (["--repeats", "x"], "--repeats: 'x' is not an integer"),
    (["--max-requests", "8"], "--max-requests 8 must exceed --active 192"),
    (["--max-requests", "192"], "use at least 193"),
    (["--block-columns", "4"], "--block-columns 4 x --block-size 64 holds 256 tokens"),
    (["--json", "/nonexistent/dir/x.json"], "the directory /nonexistent/dir does not exist"),
    (["--sweep"], "unrecognized arguments: --sweep"),
    (["--trace", "--instructions"], "--device and --instructions apply to the standard"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bench_rejects_a_bad_option_in_one_line_before_any_work(no_work, capsys, flags,
                                                                 says):
    assert _status(mtpmeta_main, ["bench", *flags]) == 2
    line = _one_line_error(capsys, "mtpmeta bench")
    assert says in line, line


def test_malformed_options_point_at_help(no_work, capsys):
    assert _status(bench_cli.main, ["--tp", "0"]) == 2
    assert _one_line_error(capsys, "mtpmeta bench").endswith(
        "--tp: 0 is below 1 (see mtpmeta bench --help)")


def test_bench_refuses_an_output_path_that_is_a_directory(no_work, capsys, tmp_path):
    assert bench_cli.main(["--json", str(tmp_path)]) == 2
    assert "is a directory" in _one_line_error(capsys, "mtpmeta bench")


def test_instructions_checks_its_tools_first_with_fitting_advice(no_work, capsys,
                                                                 monkeypatch, tmp_path):
    """--instructions used to run the whole bench and only then fail, with advice for
    a source checkout even in an installed wheel."""
    from mtpmeta.bench import instructions

    monkeypatch.setattr(instructions.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(instructions, "hooks_library", lambda: None)
    assert bench_cli.main(["--instructions"]) == 2
    line = _one_line_error(capsys, "mtpmeta bench")
    assert "--instructions cannot count here" in line and "pytest-codspeed" in line
    assert bench_cli.install_hint("bench") in line
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    assert bench_cli.main(["--instructions"]) == 2
    assert "valgrind is not installed" in _one_line_error(capsys, "mtpmeta bench")


def test_install_hint_fits_a_checkout_or_an_installed_package(monkeypatch, tmp_path):
    """From this checkout the advice is an editable install of it; from a wheel (no
    pyproject.toml beside the package) it is the published package's extra."""
    from pathlib import Path

    import mtpmeta.bench.report as bench_report

    assert bench_report.install_hint("bench") == \
        f"pip install -e '{Path(mtpmeta.__file__).resolve().parents[1]}[bench]'"
    installed = tmp_path / "site-packages" / "mtpmeta" / "bench"
    installed.mkdir(parents=True)
    monkeypatch.setattr(bench_report, "__file__", str(installed / "report.py"))
    assert bench_report.install_hint("bench") == "pip install 'mtpmeta[bench]'"


@pytest.mark.parametrize("flags, says", [
    (["--device", "gpu"], "invalid choice: 'gpu'"),
    pytest.param(["--device", "cuda"], "CUDA is not available", marks=CUDA_MISSING),
    (["--steps", "0"], "--steps: 0 is below 1"),
    (["--json", "/nonexistent/dir/x.json"], "the directory /nonexistent/dir does not exist"),
])
def test_simulate_rejects_a_bad_option_in_one_line_before_any_work(no_work, capsys,
                                                                    flags, says):
    assert _status(simulate_cli.main, flags) == 2
    assert says in _one_line_error(capsys, "mtpmeta simulate")


def _help(argv, capsys) -> str:
    assert mtpmeta_main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command, parser", [("bench", bench_cli._parser),
                                             ("simulate", simulate_cli._parser)])
def test_help_shows_every_default_and_no_markup(capsys, command, parser):
    text = _help([command, "--help"], capsys)
    assert "``" not in text
    built = parser()
    formatter = built._get_formatter()
    for action in built._actions:
        if action.dest == "help" or action.default is None or action.default is False:
            continue  # no value to show: an off switch, or a default the help explains
        entry = formatter._expand_help(action)  # the option's text as --help prints it
        assert re.search(rf"default:? {re.escape(str(action.default))}\b", entry), \
            (action.dest, entry)
    for action in parser()._actions:
        assert action.help, action.dest  # --seed had none


def test_bench_help_explains_the_columns_and_the_targets(capsys):
    text = _help(["bench", "--help"], capsys)
    for column in ("rows, carry, depth, commit", "data ops", "syncs", "draft allocs",
                   "µs/step", "speed-up"):
        assert column in text, column
    assert "maintainers' performance targets" in text  # --targets says whom they serve
    assert "MISSED" not in text.split("--targets")[0]  # no goal before that option


def test_bench_output_and_help_speak_of_the_product_only(capsys):
    """Help, the printed notes and the code of the bench say what a target or a row is
    for, not when or under which tracker item it arrived."""
    from pathlib import Path

    from tests.test_documents import HISTORY as history

    text = _help(["bench", "--help"], capsys)
    assert not history.search(text), history.search(text)
    for source in Path(bench_cli.__file__).parent.glob("*.py"):
        found = history.search(source.read_text())
        assert not found, (source.name, found)


def test_simulate_help_says_what_both_runs():
    text = simulate_cli._parser().format_help()
    assert "direct only on the CPU" not in text
    assert "the direct then the mirror path on" in " ".join(text.split())


def test_version_and_description(capsys):
    assert mtpmeta_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mtpmeta {mtpmeta.__version__}"
    assert mtpmeta_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding" in out and "bench" in out and "simulate" in out
