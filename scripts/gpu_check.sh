#!/usr/bin/env bash
# One trustworthy GPU check for a CUDA machine, offline, in under 5 minutes:
#   [PYTHON=python3] bash scripts/gpu_check.sh [OUTPUT_DIR]
# OUTPUT_DIR (default: $OUT, else ./gpu-check-out, both from the directory it is run
# from) receives the logs and gpu_check.json; nothing else is left anywhere: no
# bytecode or cache in the checkout, and the numba cache, pytest's temporary files and
# every child's TMPDIR live in one private temporary directory that is removed on exit
# (a trap, also on INT and TERM). PYTHON names the interpreter (default python3).
# Nothing is installed: the package runs from this source tree (PYTHONPATH=repo root;
# mtpmeta/__init__.py loads native/ as mtpmeta.native), on that interpreter's CUDA
# torch, numba, numpy and pytest as they are (hypothesis is not needed), so it works
# without setuptools and on an externally-managed (PEP 668) Python. It prints the
# versions, runs tests/gpu (parity, the event-query detector of hidden syncs and fence
# stalls and its pageable negative control, no sync under set_sync_debug_mode("error"),
# a real CUDAGraph replay with fewer real requests, the pinned-slot race stress and its
# no-fence control, the standard-step ring stress on 2 to 4 slots with its host-ahead
# check and no-fence control, two overlapping streams and their planted shared-stage
# control, the device start clamp, the carry, launches per call), the simulate engine
# on CUDA once as its CLI (the GPU tests' own CLI run is deselected: the same run) and
# the host-cost benchmark. A test that skips, and a simulate run that fails, misses a
# feature or does not run, count as failures. Writes OUTPUT_DIR/gpu_check.json and
# exits non-zero on any failure; without a CUDA device it runs nothing and says so in
# one line.
#
# Time: every step runs under its own limit, min(its cap, what GPU_CHECK_BUDGET has
# left less the summary's share), so the whole script ends inside GPU_CHECK_BUDGET
# seconds (default 280, the sum of the caps). Under an outer `timeout T`, set
# GPU_CHECK_BUDGET to T less a few seconds: a step is then stopped by its own limit
# (SIGINT first, so pytest still writes its junit XML and summary; SIGKILL GRACE s
# later), never by the outer kill, and the summary names it as killed, or as not run
# when the budget was spent before it.
set -uo pipefail
PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_check: interpreter '$PYTHON' not found (set PYTHON)"
    exit 2
fi
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2  # from the caller's directory
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || exit 2
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the source tree, not an install
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the checkout
mkdir -p "$work/tmp"
export TMPDIR="$work/tmp"  # pytest's tmp_path and every child's temporary files
: >"$out/steps.txt"
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$work/numba-cache}"
budget="${GPU_CHECK_BUDGET:-280}"
GRACE=5  # seconds between a step's SIGINT and its SIGKILL
SUMMARY_CAP=15
status=0

# step NAME CAP COMMAND...: COMMAND under min(CAP, what the budget has left less the
# summary's share), output in OUTPUT_DIR/NAME.log; appends "NAME RC LIMIT" to
# OUTPUT_DIR/steps.txt (RC 124 or 137: killed at its limit; "-": not run, the budget
# was spent). Returns COMMAND's status (1 when not run).
step() {
    local name=$1 cap=$2 reserve=$((SUMMARY_CAP + GRACE))
    shift 2
    [ "$name" = summary ] && reserve=0
    local limit=$((budget - SECONDS - reserve - GRACE))
    [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt 1 ]; then
        echo "gpu_check: $name not run: GPU_CHECK_BUDGET=$budget s is spent"
        echo "$name - 0" >>"$out/steps.txt"
        return 1
    fi
    timeout -s INT -k "$GRACE" "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $limit" >>"$out/steps.txt"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "gpu_check: $name killed at its $limit s limit (log: $out/$name.log)"
    fi
    return "$rc"
}

step versions 30 "$PYTHON" - <<'EOF'
import os
import sys
import numba, numpy, torch
import mtpmeta
if not torch.cuda.is_available():
    print("gpu_check: no CUDA device visible to torch; nothing was run")
    sys.exit(3)
tree = os.path.dirname(os.path.dirname(os.path.abspath(mtpmeta.__file__)))
assert tree == os.getcwd(), f"mtpmeta imported from {mtpmeta.__file__}, not this source tree"
print(f"torch {torch.__version__} cuda {torch.version.cuda} numba {numba.__version__} "
      f"numpy {numpy.__version__} device {torch.cuda.get_device_name()} "
      f"mtpmeta {mtpmeta.__file__} native {mtpmeta.native.__file__}")
EOF
rc=$?
if [ "$rc" -eq 3 ]; then  # no CUDA device: its one line, nothing else
    cat "$out/versions.log"
    exit 2
fi
tail -25 "$out/versions.log"
[ "$rc" -eq 0 ] || { echo "gpu_check: environment check failed (exit $rc)"; exit 2; }

step gpu_tests 140 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/gpu \
    --deselect tests/gpu/test_simulate_cuda.py::test_cuda_cli_quick_run \
    --junitxml="$out/gpu_tests.xml" || status=1
tail -25 "$out/gpu_tests.log"

# The simulate engine must run: a missing subcommand, a failure or a timeout fails.
step simulate 40 "$PYTHON" -m mtpmeta simulate --quick --device cuda \
    --json "$out/simulate.json" || { echo "simulate failed or did not run"; status=1; }
tail -12 "$out/simulate.log" 2>/dev/null
[ -s "$out/simulate.json" ] || { echo "simulate wrote no result"; status=1; }

step bench 55 "$PYTHON" -m mtpmeta bench --quick --device cuda --no-cold-start \
    --json "$out/bench.json" || status=1
tail -25 "$out/bench.log" 2>/dev/null

step summary "$SUMMARY_CAP" "$PYTHON" - "$out" "$status" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out, status = sys.argv[1], int(sys.argv[2])
summary = {"exit_status": status,
           "versions": open(os.path.join(out, "versions.log")).read().strip()}
# Each step's outcome (steps.txt: NAME RC LIMIT; RC 124/137 killed, "-" not run).
steps = {}
for line in open(os.path.join(out, "steps.txt")).read().splitlines():
    if line.strip():
        name, rc, limit = line.split()
        steps[name] = ("not run: the budget was spent" if rc == "-" else
                       f"killed at its {limit} s limit" if rc in ("124", "137") else
                       "ok" if rc == "0" else f"failed (exit {rc})")
summary["steps"] = steps
if any(outcome != "ok" for outcome in steps.values()):
    status = 1
tests = {}
path = os.path.join(out, "gpu_tests.xml")
if os.path.exists(path):
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        tests[f"{case.get('classname')}::{case.get('name')}"] = outcome
summary["tests"] = tests
if steps.get("gpu_tests", "ok").startswith(("killed", "not run")):
    summary["tests_note"] = (f"gpu_tests {steps['gpu_tests']}: the tests listed are those "
                             "that finished before" if tests else
                             f"gpu_tests {steps['gpu_tests']}: no test result was written")
summary["tests_passed"] = sum(v == "passed" for v in tests.values())
summary["tests_not_passed"] = sorted(k for k, v in tests.items() if v != "passed")
# Negative controls: each passes only if its planted bug was caught.
controls = ("test_stress_detects_missing_fences", "test_the_detector_trips_on_one_pageable_copy",
            "test_two_streams_catch_a_planted_shared_device_stage",
            "test_no_fence_waits_let_the_standard_step_stress_see_wrong_forwards")
found = {name: [v for k, v in tests.items() if k.endswith(name)] for name in controls}
summary["negative_controls"] = {name: bool(v) and v[0] == "passed" for name, v in found.items()}
summary["negative_control_failed_as_required"] = all(summary["negative_controls"].values())
# On a CUDA machine nothing may skip: a skipped or missing test is a failure, and so
# is a simulate run that left no result.
if summary["tests_not_passed"] or not tests or \
        not os.path.exists(os.path.join(out, "simulate.json")):
    status = 1
for name in ("bench.json", "simulate.json"):
    p = os.path.join(out, name)
    if os.path.exists(p):
        summary[name[:-5]] = json.load(open(p))
# The simulate run checks what the deselected CLI test checked: ok, no feature missed.
simulate = summary.get("simulate") or {}
summary["simulate_ok"] = bool(simulate.get("ok")) and all(
    not r.get("missing_features") for r in simulate.get("results", [])) and \
    bool(simulate.get("results"))
if not summary["simulate_ok"]:
    status = 1
summary["exit_status"] = status
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
print(json.dumps({k: v for k, v in summary.items() if k not in ("bench", "simulate", "tests")},
                 indent=1))
sys.exit(status)
EOF
rc=$?
cat "$out/summary.log" 2>/dev/null
[ "$rc" -eq 0 ] || status=1
exit "$status"
