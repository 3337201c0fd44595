"""Instructions per standard step under valgrind's callgrind: ratios that do not move
with machine load.

Wall-clock ratios on a shared 2-core machine swing by 2x when another process runs;
the number of instructions a step executes does not. ``count_step_instructions`` runs
one child process under ``valgrind --tool=callgrind --instr-atstart=no``: importing
torch and mtpmeta and warming every path run uninstrumented (about 30 s instead of
5 minutes fully instrumented), then each measured region is bracketed by callgrind
client requests (start instrumentation, zero the counters, run, dump under a label,
stop). The client requests come from pytest-codspeed's compiled instrument hooks
(the ``bench`` extra), called through ``ctypes`` so the child imports no pytest.

Counted per standard step: the reference, the direct path (torch and numpy inputs),
the mirror path and the kernel floor, eager and graphed. Instruction counts weigh a
cache miss like an add, so they are a repeatable proxy for host cost, not a time.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional

from mtpmeta.bench.report import install_hint

__all__ = ["unavailable", "callgrind_regions", "count_step_instructions",
           "format_instructions"]

_PRELUDE = """
import ctypes as _ctypes
import gc as _gc
_hooks = _ctypes.CDLL({library!r})


def region(label, run):
    '''Run ``run()`` instrumented; its instructions are dumped under ``label``.
    Python's cyclic collector runs before it and is off inside it, so a collection is
    never charged to whichever region happened to trigger it.'''
    name = label.encode()
    _gc.collect()
    _gc.disable()
    try:
        _hooks.callgrind_start_instrumentation()
        _hooks.callgrind_zero_stats()
        run()
        _hooks.callgrind_dump_stats_at(name)
        _hooks.callgrind_stop_instrumentation()
    finally:
        _gc.enable()
"""
_TRIGGER = re.compile(r"^desc: Trigger: Client Request: (.*)$", re.M)
_TOTALS = re.compile(r"^totals: (\d+)", re.M)


def hooks_library() -> Optional[str]:
    """Path of pytest-codspeed's compiled instrument hooks, or None."""
    spec = importlib.util.find_spec("pytest_codspeed")
    if spec is None or spec.origin is None:
        return None
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "instruments", "hooks",
                                   "dist_instrument_hooks*.so"))
    return found[0] if found else None


def unavailable() -> Optional[str]:
    """Why instructions cannot be counted here, or None when they can."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (it is a system package: apt-get install valgrind)"
    if hooks_library() is None:
        return ("pytest-codspeed's instrument hooks are not installed "
                f"({install_hint('bench')})")
    return None


def callgrind_regions(body: str, *, timeout: float = 600) -> Dict[str, int]:
    """Run the Python source ``body`` under callgrind, instrumentation off at start;
    ``body`` calls ``region(label, fn)`` for each measured part. Returns
    ``{label: instructions}`` in the order the regions ran."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot count instructions: {reason}")
    source = _PRELUDE.format(library=hooks_library()) + body
    with tempfile.TemporaryDirectory(prefix="mtpmeta-callgrind-") as folder:
        out = os.path.join(folder, "callgrind.out")
        command = [shutil.which("valgrind"), "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={out}", "--dump-line=no", sys.executable,
                   "-c", source]
        # The child counts the mtpmeta this process runs, wherever it was imported from
        # (a source tree on sys.path may shadow an installed copy).
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        paths = [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p]
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join(paths)}
        result = subprocess.run(command, capture_output=True, text=True, env=env,
                                timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"callgrind run failed (exit {result.returncode}):\n"
                               f"{result.stderr[-3000:]}")
        regions: Dict[int, tuple] = {}
        for path in glob.glob(out + ".*"):
            text = open(path, encoding="utf-8", errors="replace").read()
            trigger, totals = _TRIGGER.search(text), _TOTALS.search(text)
            if trigger and totals:
                regions[int(path.rsplit(".", 1)[1])] = (trigger.group(1), int(totals.group(1)))
    return {label: count for _, (label, count) in sorted(regions.items())}


def step_regions(region: Callable[[str, Callable[[], None]], None], config_fields: Dict,
                 steps: int, seed: int) -> None:
    """Child side: warm every path, then measure ``steps`` standard steps of each as
    one region per variant and per kernel floor. ``region`` is callgrind's marker in
    the child (any ``(label, fn)`` runner works)."""
    import torch

    from mtpmeta.bench.variants import TorchFloorInputs, Variant, build, floor_inputs, \
        floor_step
    from mtpmeta.bench.workload import StepConfig, make_steps, run_step

    torch.set_num_threads(1)
    config = StepConfig(**config_fields)
    torch_steps = make_steps(config, steps, seed=seed)
    inputs_of = {"torch": torch_steps, "numpy": [s.as_numpy() for s in torch_steps]}
    measured: List[tuple] = []
    for draft in ("eager", "graphed"):
        for variant in (Variant("reference", "torch", draft), Variant("direct", "torch", draft),
                        Variant("direct", "numpy", draft), Variant("mirror", "torch", draft)):
            variant_config = variant.config(config)
            meta, view = build(variant.impl, variant_config, torch.device("cpu"))
            batch = inputs_of[variant.inputs]

            def run(meta=meta, view=view, batch=batch, variant_config=variant_config):
                for inputs in batch:
                    run_step(meta, view, inputs, variant_config)

            measured.append((variant.label, run))
    bare, bare_view = build("direct", config, torch.device("cpu"))
    prepared = floor_inputs(torch_steps)
    converting = [TorchFloorInputs(step, bare_inputs)
                  for step, bare_inputs in zip(torch_steps, prepared)]
    for label, batch in (("kernel floor", prepared), ("kernel floor, torch inputs", converting)):
        measured.append((label, lambda batch=batch: [
            floor_step(bare, bare_view, inputs, config) for inputs in batch]))
    for _ in range(2):  # warm: JIT, per-shape caches, interpreter specialisation
        for _, run in measured:
            run()
    for label, run in measured:
        region(label, run)


def count_step_instructions(config: Any, *, steps: int = 4, seed: int = 0,
                            timeout: float = 600) -> Dict[str, Any]:
    """Instructions per standard step of each variant and kernel floor, counted in one
    callgrind run, with their ratios (see the module docstring)."""
    body = ("import json\nfrom mtpmeta.bench.instructions import step_regions\n"
            f"step_regions(region, json.loads({json.dumps(json.dumps(asdict(config)))}), "
            f"{steps}, {seed})\n")
    counts = callgrind_regions(body, timeout=timeout)
    per_step = {label: count / steps for label, count in counts.items()}
    result: Dict[str, Any] = {"steps": steps, "per_step": per_step}
    for draft in ("eager", "graphed"):
        reference = per_step[f"reference torch {draft}"]
        result[f"reference_over_direct_{draft}"] = reference / per_step[f"direct torch {draft}"]
        result[f"direct_over_floor_{draft}"] = (per_step[f"direct torch {draft}"]
                                                / per_step["kernel floor"])
        result[f"direct_over_torch_floor_{draft}"] = (
            per_step[f"direct torch {draft}"] / per_step["kernel floor, torch inputs"])
    return result


def format_instructions(result: Dict[str, Any]) -> str:
    per_step = result["per_step"]
    lines = [f"instructions per standard step (callgrind, {result['steps']} steps; "
             "repeatable, load-independent)"]
    for label, count in per_step.items():
        draft = "graphed" if label.endswith("graphed") else "eager"
        reference = per_step[f"reference torch {draft}"]
        ratio = reference / count  # below 1: more instructions than the reference
        fewer = f"{ratio:>8.1f}x fewer than" if ratio >= 1 else f"{1 / ratio:>8.1f}x more than"
        lines.append(f"  {label:<28}{count:>12,.0f}{fewer} the reference")
    for draft in ("eager", "graphed"):
        lines.append(f"  direct torch {draft}: {result[f'direct_over_floor_{draft}']:.2f}x "
                     "the kernel floor's instructions, "
                     f"{result[f'direct_over_torch_floor_{draft}']:.2f}x the floor with "
                     "torch inputs")
    return "\n".join(lines)
