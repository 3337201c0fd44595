"""``mtpmeta bench``: per-step host cost of the library against the pure-torch reference.

Runs the standard step (``mtpmeta.workload``) through the paths a device has (CPU: the
direct and the mirror path; CUDA: the mirror path) and the reference, with the seed's
input types (torch tensors) and, for comparison, numpy arrays, each with an eager and
a graphed draft loop. It first checks that every path leaves the reference's view
contents and buffers (exit status 1 if not), then times whole steps and each method
group, interleaved so a load change hits every row alike, counts torch ops, syncs and
draft-loop allocations, and prints a table. Ratios are measured in the same run, side
by side; absolute times only compare on the same machine.

On the CPU it also times the kernel floor (``mtpmeta.floor``), the per-call cost of
torch against numpy inputs (``mtpmeta.percall``) and, with ``--instructions``, counts
instructions per step under callgrind (``mtpmeta.instructions``), a measure that does
not move with machine load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import floor
from .gpu_view import VIEW_FIELDS, ContextGPUView
from .metadata import MTPMetadata
from .opcount import OpCounter
from .reference import ReferenceGPUView, ReferenceMTPMetadata
from .workload import StepConfig, StepInputs, make_steps, run_step, run_step_groups

__all__ = ["main", "measure", "build", "implementations", "variants", "Variant"]

IMPLEMENTATIONS = ("reference", "direct", "mirror")
INPUT_KINDS = ("torch", "numpy")
DRAFT_MODES = ("eager", "graphed")
#: Targets of this revision (issue 11), checked and printed by every CPU run.
TARGETS = {"direct_vs_floor": 1.35, "direct_speedup": 15.0, "torch_vs_numpy": 1.10,
           "mirror_ops": 32}
_COLD_START = """
import time, sys
t0 = time.perf_counter()
from mtpmeta import MTPMetadata, ContextGPUView
from mtpmeta.workload import StepConfig, make_steps, run_step
config = StepConfig(**{config})
inputs = make_steps(config, 1)[0]
meta = MTPMetadata(**config.metadata_kwargs())
meta.allocate("cpu")
view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns)
run_step(meta, view, inputs, config)
print(time.perf_counter() - t0)
"""


def implementations(device: torch.device) -> Tuple[str, ...]:
    """The paths the bench compares on ``device``. The direct path needs CPU buffers
    (``allocate(..., mirror=False)`` refuses any other device), so on a GPU it is the
    reference against the mirror path."""
    return IMPLEMENTATIONS if device.type == "cpu" else ("reference", "mirror")


@dataclass(frozen=True)
class Variant:
    """One row of the table: a path, the type of its inputs, its draft-loop mode."""

    impl: str
    inputs: str = "torch"
    draft: str = "eager"

    @property
    def label(self) -> str:
        return f"{self.impl} {self.inputs} {self.draft}"

    def config(self, config: StepConfig) -> StepConfig:
        return replace(config, graphed=self.draft == "graphed")


def variants(device: torch.device) -> List[Variant]:
    """Every row, headline (torch inputs) first; the reference runs on torch inputs
    only, the seed's types, and is the baseline of both input rows."""
    return [Variant(impl, inputs, draft) for inputs in INPUT_KINDS for draft in DRAFT_MODES
            for impl in implementations(device)
            if not (impl == "reference" and inputs == "numpy")]


def build(name: str, config: StepConfig, device: torch.device):
    """``(metadata, view)`` of one implementation, allocated on ``device``."""
    if name == "reference":
        meta: Any = ReferenceMTPMetadata(**config.metadata_kwargs())
        meta.allocate(device)
        return meta, ReferenceGPUView(config.max_requests, config.max_tokens,
                                      config.block_columns, device)
    meta = MTPMetadata(**config.metadata_kwargs())
    meta.allocate(device, mirror=(name == "mirror"), max_tokens=config.max_tokens)
    return meta, ContextGPUView(config.max_requests, config.max_tokens,
                                config.block_columns, device)


def _state(meta: Any, view: Any) -> Dict[str, torch.Tensor]:
    state = {f.name: getattr(view, f.name).cpu() for f in VIEW_FIELDS}
    for name in ("request_matched_prefix_blocks", "offsets", "block_table",
                 "query_lengths", "kv_lengths", "chunk_boundary_hidden"):
        state[name] = getattr(meta, name).cpu()
    return state


def _inputs_of(steps: List[StepInputs]) -> Dict[str, List[StepInputs]]:
    return {"torch": steps, "numpy": [step.as_numpy() for step in steps]}


def check_identical(config: StepConfig, steps: List[StepInputs],
                    device: torch.device) -> Optional[str]:
    """Run every variant through ``steps``; describe the first difference from the
    reference of the same draft mode."""
    inputs_of = _inputs_of(steps)
    for draft in DRAFT_MODES:
        rows = [v for v in variants(device) if v.draft == draft]
        runs = {v: build(v.impl, v.config(config), device) for v in rows}
        for index in range(len(steps)):
            states = {}
            for variant, (meta, view) in runs.items():
                run_step(meta, view, inputs_of[variant.inputs][index], variant.config(config))
                states[variant] = _state(meta, view)
            expected = states[Variant("reference", "torch", draft)]
            for variant, state in states.items():
                for key, value in expected.items():
                    if not torch.equal(state[key], value.to(state[key].dtype)):
                        return (f"step {index}: {variant.label} differs from the reference "
                                f"in {key}")
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class _Run:
    """A built variant (or the kernel floor) being timed."""

    label: str
    step: Callable[[Any], None]  # runs one step's inputs
    steps: List[Any]
    groups: Optional[Callable[[Any, Dict[str, int]], None]] = None
    per_step: List[float] = field(default_factory=list)
    per_group: Dict[str, List[float]] = field(default_factory=dict)

    def time_steps(self, device: torch.device) -> None:
        _sync(device)
        start = time.perf_counter_ns()
        for inputs in self.steps:
            self.step(inputs)
        _sync(device)
        self.per_step.append((time.perf_counter_ns() - start) / len(self.steps) / 1e3)

    def time_groups(self, device: torch.device) -> None:
        if self.groups is None:
            return
        totals = dict.fromkeys(run_step_groups, 0)
        _sync(device)
        for inputs in self.steps:
            self.groups(inputs, totals)
        _sync(device)
        for group, total in totals.items():
            self.per_group.setdefault(group, []).append(total / len(self.steps) / 1e3)


def _variant_run(variant: Variant, config: StepConfig, steps: List[StepInputs],
                 device: torch.device):
    config = variant.config(config)
    meta, view = build(variant.impl, config, device)
    for inputs in steps:  # warm-up: JIT, per-shape caches
        run_step(meta, view, inputs, config)

    def groups(inputs: StepInputs, totals: Dict[str, int]) -> None:
        for group, run in run_step_groups.items():
            t0 = time.perf_counter_ns()
            run(meta, view, inputs, config)
            totals[group] += time.perf_counter_ns() - t0

    run = _Run(variant.label, lambda inputs: run_step(meta, view, inputs, config), steps,
               groups)
    return run, meta, view, config


def _counts(meta: Any, view: Any, config: StepConfig,
            steps: List[StepInputs]) -> Dict[str, Any]:
    """Torch ops, syncs and draft-loop allocations of one warm step."""
    with OpCounter() as step_counter:
        run_step(meta, view, steps[0], config)
    inputs = steps[1 % len(steps)]
    meta.begin_decode(config.active, config.padded_active, inputs.start_positions,
                      inputs.block_table, config.graphed)
    with OpCounter() as draft_counter:
        for _ in range(config.depths):
            meta.setup_decode_step(view)
            meta.advance_decode_step()
        meta.end_forward()
    return {"ops_per_step": step_counter.total, "data_ops_per_step": step_counter.data_ops,
            "ops_by_name": dict(step_counter.ops),
            "syncs_per_step": step_counter.scalar_reads,
            "draft_loop_allocations": draft_counter.new_storages}


def measure(config: StepConfig, steps: List[StepInputs], repeats: int,
            device: torch.device, progress: Any = None,
            with_floor: bool = True) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, float]]:
    """Median µs per step and per method group of every variant, plus op/sync/allocation
    counts, and the kernel floors' median µs per step (CPU: ``"kernel floor"`` on
    pre-converted inputs, ``"kernel floor, torch inputs"`` converting each torch input
    as it is read). Every repeat runs one pass of each variant and floor in turn, so
    they share the machine's state of the moment."""
    inputs_of = _inputs_of(steps)
    rows = variants(device)
    runs, built = [], {}
    for variant in rows:
        run, meta, view, variant_config = _variant_run(variant, config, inputs_of[variant.inputs],
                                                       device)
        runs.append(run)
        built[variant] = (meta, view, variant_config)
    floor_runs: List[_Run] = []
    if with_floor and device.type == "cpu":
        bare, bare_view = build("direct", config, device)
        prepared = floor.prepare(steps)
        converting = [floor.TorchFloorInputs(step, bare_inputs)
                      for step, bare_inputs in zip(steps, prepared)]
        for label, batch in (("kernel floor", prepared),
                             ("kernel floor, torch inputs", converting)):
            floor_runs.append(_Run(
                label, lambda inputs: floor.floor_step(bare, bare_view, inputs, config),
                batch))
            floor_runs[-1].time_steps(device)  # warm-up
            floor_runs[-1].per_step.clear()
        runs.extend(floor_runs)
    for _ in range(repeats):
        for run in runs:
            run.time_steps(device)
        for run in runs:
            run.time_groups(device)
        if progress is not None:
            progress.update(1)
    results: Dict[str, Dict[str, Any]] = {}
    for variant, run in zip(rows, runs):
        meta, view, variant_config = built[variant]
        groups = {group: statistics.median(values) for group, values in run.per_group.items()}
        groups["draft depth"] /= config.depths
        results[variant.label] = {
            "impl": variant.impl, "inputs": variant.inputs, "draft": variant.draft,
            "us_per_step": statistics.median(run.per_step), "us_per_group": groups,
            **_counts(meta, view, variant_config, inputs_of[variant.inputs])}
    floors = {run.label: statistics.median(run.per_step) for run in floor_runs}
    return results, floors


def floor_matches(config: StepConfig, steps: List[StepInputs]) -> bool:
    """Whether the kernel floor (``mtpmeta.floor``) leaves the same view and buffers as
    the full direct path over ``steps``: only then is it a bound."""
    full, full_view = build("direct", config, torch.device("cpu"))
    bare, bare_view = build("direct", config, torch.device("cpu"))
    torch_bare, torch_view = build("direct", config, torch.device("cpu"))
    for inputs, bare_inputs in zip(steps, floor.prepare(steps)):
        run_step(full, full_view, inputs, config)
        floor.floor_step(bare, bare_view, bare_inputs, config)
        floor.floor_step(torch_bare, torch_view, floor.TorchFloorInputs(inputs, bare_inputs),
                         config)
    expected = _state(full, full_view)
    return all(torch.equal(actual[key], value) for actual in (
        _state(bare, bare_view), _state(torch_bare, torch_view))
        for key, value in expected.items())


def cold_start(config: StepConfig, warm_runs: int = 3) -> Dict[str, Any]:
    """Seconds to the end of the first step in a new process: once with numba's cache
    as it is (compiling what is missing), then ``warm_runs`` times with it warm. Single
    runs swing by 0.2 s here (torch's own import varies most), so the warm figure is
    the median of the runs, all of which are kept."""
    script = _COLD_START.format(config=repr(asdict(config)))
    times = []
    for _ in range(1 + warm_runs):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"cold-start process failed:\n{result.stderr[-2000:]}")
        times.append(float(result.stdout.strip().splitlines()[-1]))
    return {"first_run_s": times[0], "warm_cache_s": statistics.median(times[1:]),
            "warm_cache_runs_s": times[1:]}


def sweep(config: StepConfig, actives: List[int], repeats: int, device: torch.device,
          steps: int) -> Dict[str, Dict[int, float]]:
    """µs per step of each path (torch inputs, eager) over batch sizes."""
    results: Dict[str, Dict[int, float]] = {name: {} for name in implementations(device)}
    for active in actives:
        sized = replace(config, active=active,
                        max_requests=max(config.max_requests, active + 1))
        rows, _ = measure(sized, make_steps(sized, steps), repeats, device,
                          with_floor=False)
        for name in results:
            results[name][active] = rows[Variant(name).label]["us_per_step"]
    return results


def plot(results: Dict[str, Dict[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for name, series in results.items():
        axis.plot(list(series), list(series.values()), marker="o", label=name)
    axis.set_xlabel("active requests")
    axis.set_ylabel("host µs per standard step")
    axis.set_yscale("log")
    axis.set_title("mtpmeta: host cost per step")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _reference_us(results: Dict[str, Dict[str, Any]], draft: str) -> float:
    return results[Variant("reference", "torch", draft).label]["us_per_step"]


def _table(config: StepConfig, results: Dict[str, Dict[str, Any]], device: str,
           floors: Dict[str, float]) -> str:
    lines = [
        f"mtpmeta bench: standard step on {device} (R={config.max_requests}, "
        f"W={config.block_columns}x{config.block_size}, active={config.active}, "
        f"depths={config.depths}, prefill={config.prefill_tokens}, tp={config.tp})",
        f"{'impl':<10}{'inputs':<7}{'draft':<8}{'µs/step':>9}{'rows':>7}{'carry':>7}"
        f"{'depth':>7}{'commit':>8}{'speed-up':>9}{'ops':>6}{'data ops':>9}{'syncs':>6}"
        f"{'draft allocs':>13}",
    ]
    for label, row in results.items():
        groups = row["us_per_group"]
        speedup = _reference_us(results, row["draft"]) / row["us_per_step"]
        lines.append(
            f"{row['impl']:<10}{row['inputs']:<7}{row['draft']:<8}{row['us_per_step']:>9.1f}"
            f"{groups['rows']:>7.1f}{groups['carry']:>7.1f}{groups['draft depth']:>7.1f}"
            f"{groups['commit pass']:>8.1f}{speedup:>8.1f}x{row['ops_per_step']:>6}"
            f"{row['data_ops_per_step']:>9}{row['syncs_per_step']:>6}"
            f"{row['draft_loop_allocations']:>13}")
    for label, inputs, what in (
            ("kernel floor", "numpy", "the direct path's numba kernels alone, inputs "
             "pre-converted"),
            ("kernel floor, torch inputs", "torch", "the same plus one Tensor.numpy() per "
             "torch input")):
        if label in floors:
            lines.append(f"{'floor':<10}{inputs:<7}{'':<8}{floors[label]:>9.1f}{'':>29}"
                         f"{_reference_us(results, 'eager') / floors[label]:>8.1f}x   "
                         f"({what})")
    return "\n".join(lines)


def target_lines(results: Dict[str, Dict[str, Any]], floors: Dict[str, float],
                 input_cost: Optional[Dict[str, Dict[str, float]]]) -> List[str]:
    """This revision's targets against this run's numbers, one line each."""
    lines = []
    floor_us = floors.get("kernel floor")
    torch_floor_us = floors.get("kernel floor, torch inputs")
    for draft in DRAFT_MODES:
        direct = results.get(Variant("direct", "torch", draft).label)
        if direct is not None and floor_us is not None:
            vs_floor = direct["us_per_step"] / floor_us
            speedup = _reference_us(results, draft) / direct["us_per_step"]
            ok = vs_floor <= TARGETS["direct_vs_floor"] and \
                speedup >= TARGETS["direct_speedup"]
            extra = "" if torch_floor_us is None else (
                f"; {direct['us_per_step'] / torch_floor_us:.2f}x the floor with "
                "torch inputs")
            lines.append(f"direct, torch inputs, {draft}: {vs_floor:.2f}x the kernel floor "
                         f"(target <= {TARGETS['direct_vs_floor']}){extra}; {speedup:.1f}x "
                         f"the reference (target >= {TARGETS['direct_speedup']:.0f}): "
                         f"{'met' if ok else 'MISSED'}")
        mirror = results.get(Variant("mirror", "torch", draft).label)
        if mirror is not None:
            ok = mirror["data_ops_per_step"] <= TARGETS["mirror_ops"] and \
                mirror["syncs_per_step"] == 0
            lines.append(f"mirror, torch inputs, {draft}: {mirror['ops_per_step']} torch "
                         f"ops/step, {mirror['data_ops_per_step']} of them touching data "
                         f"(target <= {TARGETS['mirror_ops']}), "
                         f"{mirror['syncs_per_step']} syncs (target 0): "
                         f"{'met' if ok else 'MISSED'}")
    if input_cost:
        worst = max(input_cost.items(), key=lambda item: item[1]["ratio"])
        ok = worst[1]["ratio"] <= TARGETS["torch_vs_numpy"]
        lines.append(f"torch vs numpy inputs, per call: worst {worst[1]['ratio']:.2f}x "
                     f"({worst[0]}; target <= {TARGETS['torch_vs_numpy']}): "
                     f"{'met' if ok else 'MISSED'}")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpmeta bench", description=__doc__.split("\n")[0])
    defaults = StepConfig()
    parser.add_argument("--quick", action="store_true", help="finish in under 30 s")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--device", default="cpu", help="device of the buffers (cpu/cuda)")
    for flag, attr in (("--max-requests", "max_requests"), ("--active", "active"),
                       ("--depths", "depths"), ("--block-size", "block_size"),
                       ("--block-columns", "block_columns"),
                       ("--prefill-tokens", "prefill_tokens"), ("--tp", "tp")):
        parser.add_argument(flag, type=int, default=getattr(defaults, attr), dest=attr)
    parser.add_argument("--steps", type=int, default=None,
                        help="distinct seeded steps (default 8; 4 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="host cost over batch sizes")
    parser.add_argument("--plot", metavar="PNG", help="draw the sweep (needs matplotlib)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: OpenMP wake-ups on a "
                             "busy host make CPU timings of both sides noisy)")
    parser.add_argument("--no-cold-start", action="store_true",
                        help="skip the new-process first-step measurement")
    parser.add_argument("--no-per-call", action="store_true",
                        help="skip the per-call torch-vs-numpy input cost section")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per step under valgrind's "
                             "callgrind (load-independent ratios; about 1-2 minutes)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    config = StepConfig(max_requests=max(args.max_requests, args.active + 1),
                        active=args.active,
                        depths=args.depths, block_size=args.block_size,
                        block_columns=args.block_columns, prefill_tokens=args.prefill_tokens,
                        tp=args.tp)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    steps = make_steps(config, args.steps or (4 if args.quick else 8), seed=args.seed)
    repeats = args.repeats or (5 if args.quick else 30)
    mismatch = check_identical(config, steps, device)
    if mismatch:
        print(f"mtpmeta bench: RESULTS DIFFER: {mismatch}", file=sys.stderr)
        return 1
    print(f"views identical across {', '.join(implementations(device))} (torch and numpy "
          f"inputs, eager and graphed; {len(steps)} steps)")
    on_cpu = device.type == "cpu"
    if on_cpu and not floor_matches(config, steps):
        print("mtpmeta bench: the kernel floor step differs from the direct path",
              file=sys.stderr)
        return 1
    progress = _progress(repeats)
    results, floors = measure(config, steps, repeats, device, progress)
    if progress is not None:
        progress.close()
    print(_table(config, results, str(device), floors))
    output: Dict[str, Any] = {"config": asdict(config), "device": str(device),
                              "results": results}
    if floors:
        output["kernel_floor"] = {"us_per_step": floors["kernel floor"],
                                  "us_per_step_torch_inputs":
                                      floors["kernel floor, torch inputs"],
                                  "same_result": True}
    input_cost = None
    if on_cpu and not args.no_per_call:
        from .percall import format_input_cost, input_cost as measure_input_cost

        input_cost = measure_input_cost(config, repeats=5 if args.quick else 9,
                                        number=300 if args.quick else 2000)
        output["input_cost"] = input_cost
        print(format_input_cost(input_cost))
    targets = target_lines(results, floors, input_cost)
    output["targets"] = targets
    for line in targets:
        print(f"target: {line}")
    if on_cpu and not args.no_cold_start:
        output["cold_start"] = cold_start(config, warm_runs=1 if args.quick else 3)
        print("cold start (new process, imports + first step): "
              f"{output['cold_start']['first_run_s']:.2f} s as the numba cache was, "
              f"{output['cold_start']['warm_cache_s']:.2f} s with it warm (median of "
              f"{len(output['cold_start']['warm_cache_runs_s'])})")
    if args.instructions:
        from .instructions import count_step_instructions, format_instructions

        output["instructions"] = count_step_instructions(config, steps=len(steps),
                                                         seed=args.seed)
        print(format_instructions(output["instructions"]))
    if args.sweep or args.plot:
        actives = [8, 32, 64, 128, 192, 256] if not args.quick else [8, 64, 192]
        output["sweep"] = sweep(config, actives, max(2, repeats // 5), device,
                                2 if args.quick else 4)
        for name, series in output["sweep"].items():
            print(f"sweep {name:<10}" + "  ".join(f"{a}:{us:.0f}µs" for a, us in series.items()))
        if args.plot:
            plot(output["sweep"], args.plot)
            print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(output, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="timing", leave=False, disable=not sys.stderr.isatty())
