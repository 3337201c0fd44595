#!/usr/bin/env bash
# One trustworthy GPU check for a CUDA machine, offline, in under 5 minutes:
#   bash scripts/gpu_check.sh [OUTPUT_DIR]      (default: $OUT, else ./gpu-check-out)
# Nothing is installed: the package runs from this source tree (PYTHONPATH=repo root;
# mtpmeta/__init__.py loads native/ as mtpmeta.native), on the machine's CUDA torch,
# numba, numpy, pytest and hypothesis as they are, so it works without setuptools and
# on an externally-managed (PEP 668) Python. It prints the versions, runs tests/gpu
# (parity, the event-query detector of hidden syncs and fence stalls and its pageable
# negative control, no sync under set_sync_debug_mode("error"), a real CUDAGraph replay
# with fewer real requests, the pinned-slot race stress and its no-fence control, two
# overlapping streams and their planted shared-stage control, the device start clamp,
# the carry), the simulate engine on CUDA and the host-cost benchmark. A test that
# skips, and a simulate run that fails or does not run, count as failures. Every step
# runs under a timeout; together at most 280 s. Writes OUTPUT_DIR/gpu_check.json and
# exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the source tree, not an install
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$(mktemp -d)}"
status=0

timeout 30 python3 - <<'EOF' | tee "$out/versions.txt"
import os
import numba, numpy, torch
import mtpmeta
assert torch.cuda.is_available(), "no CUDA device"
tree = os.path.dirname(os.path.dirname(os.path.abspath(mtpmeta.__file__)))
assert tree == os.getcwd(), f"mtpmeta imported from {mtpmeta.__file__}, not this source tree"
print(f"torch {torch.__version__} cuda {torch.version.cuda} numba {numba.__version__} "
      f"numpy {numpy.__version__} device {torch.cuda.get_device_name()} "
      f"mtpmeta {mtpmeta.__file__} native {mtpmeta.native.__file__}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "environment check failed"; exit 2; }

timeout 140 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu \
    --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# The simulate engine must run: a missing subcommand, a failure or a timeout fails.
timeout 40 python3 -m mtpmeta simulate --quick --device cuda --json "$out/simulate.json" \
    >"$out/simulate.log" 2>&1 || { echo "simulate failed or did not run"; status=1; }
tail -12 "$out/simulate.log"
[ -s "$out/simulate.json" ] || { echo "simulate wrote no result"; status=1; }

timeout 55 python3 -m mtpmeta bench --quick --device cuda --no-cold-start \
    --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 15 python3 - "$out" "$status" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out, status = sys.argv[1], int(sys.argv[2])
summary = {"exit_status": status, "versions": open(os.path.join(out, "versions.txt")).read().strip()}
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
summary["tests_passed"] = sum(v == "passed" for v in tests.values())
summary["tests_not_passed"] = sorted(k for k, v in tests.items() if v != "passed")
# Negative controls: each passes only if its planted bug was caught.
controls = ("test_stress_detects_missing_fences", "test_the_detector_trips_on_one_pageable_copy",
            "test_two_streams_catch_a_planted_shared_device_stage")
found = {name: [v for k, v in tests.items() if k.endswith(name)] for name in controls}
summary["negative_controls"] = {name: bool(v) and v[0] == "passed" for name, v in found.items()}
summary["negative_control_failed_as_required"] = all(summary["negative_controls"].values())
# On a CUDA machine nothing may skip: a skipped or missing test is a failure, and so
# is a simulate run that left no result.
if summary["tests_not_passed"] or not tests or \
        not os.path.exists(os.path.join(out, "simulate.json")):
    status = 1
summary["exit_status"] = status
for name in ("bench.json", "simulate.json"):
    p = os.path.join(out, name)
    if os.path.exists(p):
        summary[name[:-5]] = json.load(open(p))
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
print(json.dumps({k: v for k, v in summary.items() if k not in ("bench", "simulate", "tests")},
                 indent=1))
sys.exit(status)
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit "$status"
