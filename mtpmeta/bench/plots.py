"""``mtpmeta bench --plot PNG``: the sweeps as one figure, one panel per sweep that ran.

A panel draws each path's median over the timed passes with error bars from the
lowest to the highest pass (``spread``), so a point's noise is visible, not a single
sample. Inputs: ``{path: {x: median}}`` and ``{path: {x: (lowest, highest)}}``, as
``measure.sweep`` and ``sweep_width.width_sweep`` fill them. Needs matplotlib.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

__all__ = ["Panel", "plot"]

COLORS = {"reference": "tab:green", "direct": "tab:orange", "mirror": "tab:blue"}
Series = Dict[str, Dict[int, float]]
Spread = Dict[str, Dict[int, Tuple[float, float]]]


class Panel:
    """One sweep to draw: its medians, their per-pass spread, and the axis labels."""

    def __init__(self, title: str, xlabel: str, ylabel: str, series: Series,
                 spread: Optional[Spread] = None, *, passes: int = 0,
                 log_x: bool = False) -> None:
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.series, self.spread = series, spread or {}
        self.passes, self.log_x = passes, log_x


def _bars(median: List[float], spread: List[Tuple[float, float]]) -> List[List[float]]:
    """matplotlib's ``yerr``: distances below and above each median (never negative)."""
    return [[max(m - lo, 0.0) for m, (lo, _) in zip(median, spread)],
            [max(hi - m, 0.0) for m, (_, hi) in zip(median, spread)]]


def plot(panels: List[Panel], path: str) -> None:
    """Draw ``panels`` side by side into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2),
                                squeeze=False)
    for axis, panel in zip(axes[0], panels):
        for name, series in panel.series.items():
            xs, ys = list(series), list(series.values())
            spread = panel.spread.get(name)
            yerr = None if not spread else _bars(ys, [spread[x] for x in xs])
            axis.errorbar(xs, ys, yerr=yerr, marker="o", capsize=3, label=name,
                          color=COLORS.get(name))
        if panel.log_x:
            axis.set_xscale("log", base=2)
            axis.set_xticks(list(next(iter(panel.series.values()))))
            axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_yscale("log")
        axis.set_xlabel(panel.xlabel)
        axis.set_ylabel(panel.ylabel)
        bars = (f"median; bars: lowest-highest of {panel.passes} passes" if panel.passes > 1
                else "one count per point (no per-pass spread)")
        axis.set_title(f"{panel.title}\n({bars})", fontsize=10)
        axis.legend(loc="best", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
