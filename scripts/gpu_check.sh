#!/usr/bin/env bash
# One trustworthy GPU check for a CUDA machine, offline, in under 5 minutes:
#   bash scripts/gpu_check.sh [OUTPUT_DIR]      (default: $OUT, else ./gpu-check-out)
# It installs the package without touching the network (the machine's CUDA torch, numba,
# numpy, pytest and hypothesis are used as they are), prints the versions, runs tests/gpu
# (parity, no sync under set_sync_debug_mode("error") in the draft loop and the commit
# pass, a real CUDAGraph replay of a draft forward with the same and fewer real requests,
# the pinned-slot race stress and its no-fence negative control, two streams, the device
# start clamp, the carry), the simulate engine on CUDA, and the host-cost benchmark of the
# mirror path against the reference. Writes OUTPUT_DIR/gpu_check.json and exits non-zero
# on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$(mktemp -d)}"
status=0

python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . >"$out/install.log" 2>&1 \
    || { echo "install failed:"; tail -20 "$out/install.log"; exit 2; }
python3 - <<'EOF' | tee "$out/versions.txt" || exit 2
import numba, numpy, torch
assert torch.cuda.is_available(), "no CUDA device"
print(f"torch {torch.__version__} cuda {torch.version.cuda} numba {numba.__version__} "
      f"numpy {numpy.__version__} device {torch.cuda.get_device_name()}")
EOF

timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu \
    --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if python3 -m mtpmeta simulate --help >/dev/null 2>&1; then
    timeout 60 python3 -m mtpmeta simulate --quick --device cuda --json "$out/simulate.json" \
        >"$out/simulate.log" 2>&1 || status=1
    tail -12 "$out/simulate.log"
fi

timeout 90 python3 -m mtpmeta bench --quick --device cuda --no-cold-start \
    --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

python3 - "$out" "$status" <<'EOF'
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
control = [k for k in tests if k.endswith("test_stress_detects_missing_fences")]
summary["negative_control_failed_as_required"] = bool(control) and tests[control[0]] == "passed"
for name in ("bench.json", "simulate.json"):
    p = os.path.join(out, name)
    if os.path.exists(p):
        summary[name[:-5]] = json.load(open(p))
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
print(json.dumps({k: v for k, v in summary.items() if k not in ("bench", "simulate", "tests")},
                 indent=1))
EOF
exit "$status"
