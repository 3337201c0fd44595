"""The sections ``mtpmeta bench`` prints after its table for issue 17: device data ops
per call beside the upstream-equivalent reference, the fresh-shapes row, and on request
the table-width sweep (``--width-sweep``) and the production geometry
(``--geometry production``). One entry point, so the command line needs one hook."""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["run"]


def run(args: Any, config: Any) -> Dict[str, Any]:
    """Run and print the sections ``args`` asks for; their results by JSON key."""
    from .callops import format_ops_per_call, ops_per_call
    from .fresh_shapes import format_fresh_shapes, max_fresh_steps, measure_fresh_shapes

    out: Dict[str, Any] = {}
    if args.device != "cpu":
        return out
    out["ops_per_call"] = ops_per_call(config)
    print(format_ops_per_call(out["ops_per_call"]))
    count = min(8 if args.quick else 20, max_fresh_steps(config))
    if count >= 2:
        out["fresh_shapes"] = measure_fresh_shapes(
            config, count=count, repeats=2 if args.quick else 5, seed=args.seed)
        print(format_fresh_shapes(out["fresh_shapes"]))
    if args.width_sweep:
        from .sweep_width import format_width_sweep, width_sweep

        out["width_sweep"] = width_sweep(instructions=args.instructions,
                                         repeats=5 if args.quick else 15)
        print(format_width_sweep(out["width_sweep"]))
    if args.geometry == "production":
        from .production import format_production, measure_production

        out["production"] = measure_production(steps=2 if args.quick else 4,
                                               repeats=2 if args.quick else 7,
                                               seed=args.seed)
        print(format_production(out["production"]))
    return out
