"""Per-step host CPU µs of the mirror path over a trace of random shapes, fresh vs warm:
what a never-seen shape costs over a repeated one. Usage: ``python scripts/fresh_vs_warm.py [repeats] [warm-up steps]``,
or ``python scripts/fresh_vs_warm.py --instructions`` for instructions per step under
callgrind (one run each; repeatable, unlike the times on a shared machine; ~3 min),
or ``python scripts/fresh_vs_warm.py --trace`` for the same on the seeded traces
(``mtpmeta bench --trace``'s, ~2 min).

Every step draws its active count n (154-208 at the standard geometry, 615-810 at the
production one), hence its padded count and commit size, and a prefill chunk of 1-256
tokens. Fresh: new objects run the warm-up steps of another trace (default 2), then
the timed trace, every shape of it new to them. Warm: the same objects run the same
trace again. The mirror path CPU-forced and on torch's meta device (the host's share
on a GPU); process CPU time, so a shared machine's waits are left out. Compare figures
only within one run.

``--trace``: the seeded continuous-batching traces of ``mtpmeta.bench.trace`` (320
steps at the standard geometry, 160 at the production one), replayed in engine order
as ``mtpmeta bench --trace`` replays them, on meta with the C++ meta kernels, for the
mirror and the captured path. Fresh: new objects after 2 warm-up steps of another
seed's trace; warm: the same trace again. The untimed table update between steps
(``Replay.prepare``, the same in both) is counted alone and taken out of both. The
reference (upstream's op sequence, warm, its read-backs answered from the host) is
counted the same way, for the host-share ratio in instructions beside the bench's µs.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from mtpmeta import ContextGPUView, MTPMetadata
from mtpmeta.bench.workload import PRODUCTION, StepConfig, make_steps, run_step
from mtpmeta.buffers.layout import round_up

GEOMETRIES = {"standard": (StepConfig(), (154, 208), 40),
              "production": (PRODUCTION, (615, 810), 16)}


def trace(config, low, high, steps, seed):
    """``steps`` (StepConfig, StepInputs) pairs of random n in [low, high]; one drawn
    table for all (a production table takes long to draw)."""
    rng = np.random.default_rng(seed)
    base = make_steps(config, 1, seed=seed)[0]
    R, out = config.max_requests, []
    for _ in range(steps):
        n = int(rng.integers(low, high + 1))
        step_config = replace(config, active=n, prefill_tokens=int(rng.integers(1, 257)))
        counts = np.zeros(R, np.int32)
        counts[:n + 1] = rng.integers(1, 5, n + 1)
        counts[n] = step_config.prefill_tokens
        starts = np.zeros(R, np.int32)
        starts[:n] = rng.integers(0, 3000, n)
        commit = np.zeros(R, np.int32)
        commit[:n] = np.maximum(starts[:n] - counts[:n], 0)
        commit[n] = config.inherited_blocks * config.block_size - config.block_size // 2
        inherited = np.zeros(R, np.int32)
        inherited[n] = config.inherited_blocks
        out.append((step_config, replace(
            base, start_positions=torch.from_numpy(starts)[:n],
            append_counts=torch.from_numpy(counts)[:n + 1],
            commit_starts=torch.from_numpy(commit)[:n + 1],
            inherited=torch.from_numpy(inherited)[:n + 1],
            padded_tokens=round_up(int(counts[:n + 1].sum()), config.tp),
            padded_requests=n + 1)))
    return out


def build(config, device):
    tokens = config.max_tokens + 2048  # room for the largest drawn step
    meta = MTPMetadata(**config.metadata_kwargs())
    meta.allocate(device, mirror=True, max_tokens=tokens)
    return meta, ContextGPUView(config.max_requests, tokens, config.block_columns, device)


def timed(meta, view, steps):
    start = time.process_time_ns()
    for step_config, inputs in steps:
        run_step(meta, view, inputs, step_config)
    return (time.process_time_ns() - start) / len(steps) / 1e3


def main(repeats: int = 5, warm_steps: int = 2) -> None:
    torch.set_num_threads(1)
    for name, (config, (low, high), steps) in GEOMETRIES.items():
        timed_trace = trace(config, low, high, steps, seed=1)
        warm_up = trace(config, low, high, warm_steps, seed=99)
        for device in ("cpu", "meta"):
            fresh, warm = [], []
            for _ in range(repeats):
                meta, view = build(config, device)
                timed(meta, view, warm_up)
                fresh.append(timed(meta, view, timed_trace))
                warm.append(timed(meta, view, timed_trace))
            f, w = statistics.median(fresh), statistics.median(warm)
            print(f"{name:<10} mirror {device:<4} fresh {f:8.0f} µs  warm {w:8.0f} µs  "
                  f"fresh/warm {f / w:.2f}x", flush=True)


def instructions(warm_steps: int = 2) -> None:
    """Fresh and warm instructions per step, each trace one callgrind region (the
    interpreter and the kernels warmed first on a throwaway object)."""
    from mtpmeta.bench.instructions import callgrind_regions

    body = (f"import sys\nsys.path.insert(0, {repr(str(_HERE))})\n"
            f"from fresh_vs_warm import regions\nregions(region, {warm_steps})\n")
    counts = callgrind_regions(body, timeout=1800)
    for label, fresh in counts.items():
        if label.endswith(" fresh"):
            name, device, _ = label.split()
            warm = counts[f"{name} {device} warm"]
            steps = GEOMETRIES[name][2]
            print(f"{name:<10} mirror {device:<4} fresh {fresh / steps:10,.0f}  warm "
                  f"{warm / steps:10,.0f} instructions/step  fresh/warm {fresh / warm:.3f}x")


def regions(region, warm_steps: int) -> None:
    """Child side of ``instructions``: ``region(label, fn)`` is callgrind's marker."""
    torch.set_num_threads(1)
    for name, (config, (low, high), steps) in GEOMETRIES.items():
        timed_trace = trace(config, low, high, steps, seed=1)
        warm_up = trace(config, low, high, warm_steps, seed=99)
        for device in ("cpu", "meta"):
            meta, view = build(config, device)  # throwaway: JIT, interpreter caches
            timed(meta, view, warm_up)
            timed(meta, view, timed_trace)
            meta, view = build(config, device)
            timed(meta, view, warm_up)
            region(f"{name} {device} fresh", lambda: timed(meta, view, timed_trace))
            region(f"{name} {device} warm", lambda: timed(meta, view, timed_trace))


def trace_instructions() -> None:
    """Fresh and warm instructions per step on the bench's traces (module docstring)."""
    from mtpmeta.bench.instructions import callgrind_regions

    body = (f"import sys\nsys.path.insert(0, {repr(str(_HERE))})\n"
            f"from fresh_vs_warm import trace_regions\ntrace_regions(region)\n")
    counts = callgrind_regions(body, timeout=2400)
    for label, fresh in counts.items():
        if label.endswith(" fresh"):
            base = label[:-len(" fresh")]
            name, path, steps = base.split()
            prepare, warm = counts[f"{base} prepare"], counts[f"{base} warm"]
            fresh, warm = fresh - prepare, warm - prepare
            reference = counts[f"{name} reference {steps} warm"] - \
                counts[f"{name} reference {steps} prepare"]
            print(f"{name:<10} {path:<8} meta fresh {fresh / int(steps):10,.0f}  warm "
                  f"{warm / int(steps):10,.0f} instructions/step  fresh/warm "
                  f"{fresh / warm:.3f}x  reference/warm {reference / warm:.2f}x  "
                  f"({steps}-step trace, engine order)")


def trace_regions(region) -> None:
    """Child side of ``trace_instructions``."""
    from mtpmeta.bench.meta_device import cpp_meta_kernels
    from mtpmeta.bench.trace import PRODUCTION_TRACE, STANDARD_TRACE, make_trace
    from mtpmeta.bench.counters import CountingRuntime
    from mtpmeta.bench.trace_replay import Replay, known_syncs
    from mtpmeta.buffers.device_runtime import use_runtime

    def prepare_only(r, steps):  # Replay.replay without the calls it times
        r.reset()
        for index, step in enumerate(steps):
            r.prepare(index, step)

    torch.set_num_threads(1)
    meta = torch.device("meta")
    for name, config in (("standard", STANDARD_TRACE), ("production", PRODUCTION_TRACE)):
        timed_trace = make_trace(config, config.steps, seed=0)
        warm_up = make_trace(config, 2, seed=99)
        with cpp_meta_kernels(), use_runtime(CountingRuntime()):
            # Upstream's op sequence, warm, its read-backs answered from the host.
            reference = Replay("reference", config, meta,
                               known=known_syncs(config, timed_trace))
            reference.replay(timed_trace)
            label = f"{name} reference {len(timed_trace)}"
            region(f"{label} warm", lambda: reference.replay(timed_trace))
            region(f"{label} prepare", lambda: prepare_only(reference, timed_trace))
            for path in ("mirror", "captured"):
                throwaway = Replay(path, config, meta)  # JIT, interpreter caches
                throwaway.replay(warm_up)
                throwaway.replay(timed_trace)
                r = Replay(path, config, meta)
                r.replay(warm_up)
                label = f"{name} {path} {len(timed_trace)}"
                region(f"{label} fresh", lambda: r.replay(timed_trace))
                region(f"{label} warm", lambda: r.replay(timed_trace))
                region(f"{label} prepare", lambda: prepare_only(r, timed_trace))


_HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    if sys.argv[1:2] == ["--trace"]:
        trace_instructions()
    elif sys.argv[1:2] == ["--instructions"]:
        instructions(*(int(arg) for arg in sys.argv[2:3]))
    else:
        main(*(int(arg) for arg in sys.argv[1:3]))
