"""The sections ``mtpmeta bench`` prints after its table for issue 17: device data ops
per call beside the upstream-equivalent reference, the fresh-shapes row, and on request
the table-width sweep (``--width-sweep``) and the production geometry
(``--geometry production``). One entry point, so the command line needs one hook."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

__all__ = ["run"]


def run(args: Any, config: Any, note: Callable[[str], None] = lambda text: None,
        width_spread: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Run and print the sections ``args`` asks for; their results by JSON key.
    ``note`` announces each section before its work (the command's stderr progress);
    ``width_spread``, when given, gets the width sweep's per-pass spread (the plot)."""
    from mtpmeta.bench.callops import format_ops_per_call, ops_per_call
    from mtpmeta.bench.fresh_shapes import format_fresh_shapes, max_fresh_steps, measure_fresh_shapes

    out: Dict[str, Any] = {}
    if args.device != "cpu":
        return out
    note("counting device data ops per call")
    out["ops_per_call"] = ops_per_call(config)
    print(format_ops_per_call(out["ops_per_call"]))
    count = min(8 if args.quick else 20, max_fresh_steps(config) - 1)
    if count >= 2:
        note(f"timing {count} steps that never repeat a shape")
        out["fresh_shapes"] = measure_fresh_shapes(
            config, count=count, repeats=2 if args.quick else 5, seed=args.seed)
        print(format_fresh_shapes(out["fresh_shapes"]))
    if args.width_sweep:
        from . import sweep_width

        note(f"width sweep: one draft depth at W {', '.join(map(str, sweep_width.WIDTHS))}"
             f" (N {sweep_width.ACTIVE})")
        out["width_sweep"] = sweep_width.width_sweep(instructions=args.instructions,
                                                     repeats=5 if args.quick else 15,
                                                     spread=width_spread)
        print(sweep_width.format_width_sweep(out["width_sweep"]))
    if args.geometry == "production":
        from mtpmeta.bench.production import format_production, measure_production

        note("production geometry (R 1024, N 768, W 2048)")
        out["production"] = measure_production(steps=2 if args.quick else 4,
                                               repeats=2 if args.quick else 7,
                                               seed=args.seed)
        print(format_production(out["production"]))
    return out
