"""``mtpmeta bench --plot PATH``: the width sweep drawn as a PNG, with matplotlib (the
``plot`` extra) present and absent. Counts and files only, never times."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from mtpmeta.bench import cli as bench_cli, width_sweep

from tests.test_bench_trace import TINY

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_sweep_spans_four_widths_from_128_to_8192_for_both_routes():
    assert len(width_sweep.WIDTHS) >= 4
    assert (min(width_sweep.WIDTHS), max(width_sweep.WIDTHS)) == (128, 8192)
    assert [key for _, key in width_sweep.LINES][:2] == ["mirror @meta",
                                                         "mirror, block counts @meta"]
    for width in width_sweep.WIDTHS:  # the same traffic on a wider table
        config = width_sweep.sweep_config(width)
        assert config.block_columns == width
        assert config.pool_columns == width_sweep.STANDARD_TRACE.block_columns


def test_plot_writes_a_png_of_the_sweep(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    # the sweep's widths on the tiny trace: W / 16 columns, the same blocks in use
    monkeypatch.setattr(width_sweep, "sweep_config",
                        lambda width: replace(TINY, block_columns=width // 16,
                                              pool_columns=TINY.block_columns))
    path = tmp_path / "sweep.png"
    assert bench_cli.main(["--plot", str(path), "--steps", "3", "--repeats", "1"]) == 0
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    out = capsys.readouterr().out
    for width in width_sweep.WIDTHS:
        assert f"\n  {width:>6}" in out
    lines = out.splitlines()
    assert f"wrote {path}" in lines
    assert lines[-1].startswith("verdict: the mirror path, with and without block "
                                "counts, left the reference's views and buffers at "
                                "every width (W 128 to 8192)")


def test_plot_without_matplotlib_names_the_extra_before_any_work(monkeypatch, tmp_path,
                                                                 capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setattr(width_sweep, "measure_sweep",
                        lambda *a, **k: pytest.fail("timed without matplotlib"))
    path = tmp_path / "sweep.png"
    assert bench_cli.main(["--plot", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 'mtpmeta[plot]'" in err
    assert len(err.strip().splitlines()) == 1
    assert not path.exists()


def test_plot_exits_1_when_a_width_differs(monkeypatch, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from mtpmeta.bench import trace_replay

    monkeypatch.setattr(width_sweep, "sweep_config",
                        lambda width: replace(TINY, block_columns=width // 16,
                                              pool_columns=TINY.block_columns))
    monkeypatch.setattr(trace_replay, "check_trace", lambda config, trace, **kw: "planted")
    path = tmp_path / "sweep.png"
    assert bench_cli.main(["--plot", str(path), "--steps", "2"]) == 1
    assert "RESULTS DIFFER (W 128): planted" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize("extra", [["--trace"], ["--instructions"]])
def test_plot_refuses_options_it_does_not_combine_with(extra, tmp_path, capsys):
    assert bench_cli.main(["--plot", str(tmp_path / "x.png"), *extra]) == 2
    assert capsys.readouterr().err.startswith("mtpmeta bench: --plot times the meta "
                                              "device on its own")
