"""Run the engine on one path and summarise what it exercised and checked."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import torch

from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.engine import Engine
from mtpmeta.simulate.mismatch import Mismatch

__all__ = ["FEATURES", "run_path", "PATHS"]

PATHS = ("direct", "mirror")

#: Counters that must be non-zero for a run to have covered every feature of a
#: serving loop (``--quick`` does, on both paths; the tests assert it).
FEATURES = (
    "arrived", "admitted", "finished", "chunked prompts", "carries", "seams taken",
    "carries invalidated", "prefix hits", "inherited redirects", "paused", "resumed",
    "row moves", "row swaps", "row resets", "compactions (shift)", "compactions (tail)",
    "commit passes with TP pad", "draft loops (eager)", "draft loops (graphed)",
    "draft loops (captured)", "draft loops with padded rows", "capture warmups",
    "captured warmups", "drafts accepted",
    "drafts rejected", "attention output checks",
)


def run_path(path: str, *, steps: int, seed: int = 0, device: str = "cpu",
             config: Optional[SimConfig] = None,
             progress: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Simulate ``steps`` steps on ``path`` (``"direct"``: ``allocate(device)`` on the
    CPU; ``"mirror"``: ``allocate(device, mirror=True)``).

    Returns ``{"path", "ok", "seconds", "stats", "checks", "missing_features",
    "mismatch"}``; ``mismatch`` is ``Mismatch.as_dict()`` of the first failure, or None.
    """
    if path not in PATHS:
        raise ValueError(f"path: {path!r} is not one of {PATHS}")
    if path == "direct" and torch.device(device).type != "cpu":
        raise ValueError(f"path: the direct path needs a CPU device, got {device}")
    config = config or SimConfig()
    started = time.perf_counter()
    engine = Engine(config, seed=seed, device=device, mirror=(path == "mirror"))
    mismatch: Optional[Mismatch] = None
    try:
        engine.run(steps, progress)
    except Mismatch as error:
        mismatch = error
    stats = dict(sorted(engine.stats.items()))
    stats["row moves"] = engine.rows.calls["move"]
    stats["row swaps"] = engine.rows.calls["swap"]
    stats["row resets"] = engine.rows.calls["reset"]
    stats["drafts rejected"] = (stats.get("drafts verified", 0)
                                - stats.get("drafts accepted", 0))
    checks = dict(sorted(engine.checker.passed.items()))
    stats["attention output checks"] = checks.get("attention output", 0)
    missing: List[str] = [name for name in FEATURES if not stats.get(name)]
    return {"path": path, "ok": mismatch is None,
            "seconds": round(time.perf_counter() - started, 3), "stats": stats,
            "checks": checks, "missing_features": missing,
            "mismatch": None if mismatch is None else mismatch.as_dict(),
            "error": None if mismatch is None else mismatch.describe()}
