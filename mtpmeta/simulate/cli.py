"""``mtpmeta simulate``: run the engine on the direct and/or mirror path, print a
one-screen summary, optionally write it as JSON; exit 1 on the first mismatch."""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional

from mtpmeta.bench.cli import ToolParser, device_problem, output_problem, parse, \
    positive_int, usage_error
from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.runner import PATHS, run_path

__all__ = ["main"]

QUICK_STEPS = 200
DEFAULT_STEPS = 1000
# (label, counter, counter of the denominator or None), in the summary's order
ROWS = (
    ("steps", "steps", None),
    ("forwards", "forwards", None),
    ("commit tokens (+ TP pad)", "commit tokens", None),
    ("draft tokens", "draft tokens", None),
    ("drafts accepted / verified", "drafts accepted", "drafts verified"),
    ("requests admitted / finished", "admitted", "finished"),
    ("chunk seams carried / taken", "carries", "seams taken"),
    ("prefix hits (blocks)", "prefix hits", "inherited blocks"),
    ("inherited-block redirects", "inherited redirects", None),
    ("paused / resumed", "paused", "resumed"),
    ("row moves / swaps / resets", "row moves", None),
    ("draft loops eager / graphed", "draft loops (eager)", "draft loops (graphed)"),
    ("draft loops captured (setup)", "draft loops (captured)", None),
    ("padded commits / draft loops", "commit passes with TP pad",
     "draft loops with padded rows"),
)


PROG = "mtpmeta simulate"


def _parser() -> ToolParser:
    parser = ToolParser(
        prog=PROG,
        description="End-to-end speculative decoding over a paged KV cache, driving\n"
                    "MTPMetadata and checking every forward against a dense\n"
                    "recomputation. Exit status 1 on the first mismatch, 2 for an option\n"
                    "that cannot work.")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps per path (default {DEFAULT_STEPS})")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"steps per path (default {DEFAULT_STEPS}; {QUICK_STEPS} "
                             "with --quick)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the toy model's weights and the scheduler's random draws")
    parser.add_argument("--path", choices=PATHS + ("both",), default="both",
                        help="direct: allocate('cpu'); mirror: allocate(device, "
                             "mirror=True); both: the direct then the mirror path on the "
                             "CPU, the mirror path alone on cuda (the direct path is "
                             "CPU-only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="device of the buffers")
    parser.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


class _Progress:
    """``simulate mirror: step 120/200`` on stderr, redrawn in place on a terminal,
    every 10% as dots otherwise."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = sys.stderr.isatty()
        self.marks = 0
        if enabled and not self.tty:
            sys.stderr.write(f"simulate {label}: ")

    def __call__(self, step: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write(f"\rsimulate {self.label}: step {step}/{self.total}")
        else:
            while self.marks < 10 * step // max(self.total, 1):
                sys.stderr.write(".")
                self.marks += 1
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _cell(stats: Dict[str, Any], key: str, other: Optional[str]) -> str:
    if key == "row moves":
        return f"{stats.get('row moves', 0)} / {stats.get('row swaps', 0)} / " \
               f"{stats.get('row resets', 0)}"
    if key == "commit tokens":
        return f"{stats.get(key, 0)} (+{stats.get('pad tokens', 0)})"
    value = stats.get(key, 0)
    return str(value) if other is None else f"{value} / {stats.get(other, 0)}"


def summary(report: Dict[str, Any]) -> str:
    """The one-screen text of a report (what ``--json`` writes)."""
    results: List[Dict[str, Any]] = report["results"]
    cfg = report["config"]
    lines = [f"mtpmeta simulate: seed {report['seed']}, device {report['device']}, "
             f"{report['steps']} steps per path; R={cfg['max_requests']} "
             f"W={cfg['block_columns']} BS={cfg['block_size']}, K={cfg['depths']} draft "
             f"depths, TP multiple {cfg['tp']}"]
    width = 30
    lines.append(" " * width + "".join(f"{r['path']:>22}" for r in results))
    for label, key, other in ROWS:
        lines.append(f"{label:<{width}}" + "".join(
            f"{_cell(r['stats'], key, other):>22}" for r in results))
    lines.append(f"{'checks passed':<{width}}" + "".join(
        f"{sum(r['checks'].values()):>22}" for r in results))
    lines.append(f"{'seconds':<{width}}" + "".join(f"{r['seconds']:>22}" for r in results))
    names = sorted({name for r in results for name in r["checks"]})
    lines.append("checks: " + ", ".join(
        f"{name} {'/'.join(str(r['checks'].get(name, 0)) for r in results)}"
        for name in names))
    for r in results:
        if r["missing_features"]:
            lines.append(f"{r['path']}: features NOT exercised: "
                         + ", ".join(r["missing_features"]))
    failed = [r for r in results if not r["ok"]]
    if failed:
        lines.append(f"FAILED on the {failed[0]['path']} path:")
        lines.append(failed[0]["error"])
    else:
        lines.append("OK: every check passed after every forward"
                     + ("" if any(r["missing_features"] for r in results)
                        else "; every feature exercised"))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``mtpmeta simulate`` with ``argv``; 0, 1 on the first mismatch, 2 for an
    option that cannot work (one line on stderr, before any work); 0 after --help."""
    args, status = parse(_parser(), argv)
    if args is None:
        return status
    steps = args.steps if args.steps is not None else (
        QUICK_STEPS if args.quick else DEFAULT_STEPS)
    problem = device_problem(args.device)
    if args.json is not None:
        problem = problem or output_problem("--json", args.json)
    if args.path == "direct" and args.device != "cpu":
        problem = problem or "--path direct runs on the CPU only (--device cpu)"
    if problem:
        return usage_error(PROG, problem)
    if args.path == "both":
        paths = PATHS if args.device == "cpu" else ("mirror",)
    else:
        paths = (args.path,)
    config = SimConfig()
    results = []
    for path in paths:
        progress = _Progress(path, steps, not args.quiet)
        try:
            result = run_path(path, steps=steps, seed=args.seed, device=args.device,
                              config=config, progress=progress)
        finally:
            progress.close()
        results.append(result)
        if not result["ok"]:
            break
    report = {"ok": all(r["ok"] for r in results), "seed": args.seed,
              "device": args.device, "steps": steps, "config": config.as_dict(),
              "results": results}
    report["summary"] = summary(report)
    print(report["summary"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0 if report["ok"] else 1
