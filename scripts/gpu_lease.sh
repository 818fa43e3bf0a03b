#!/usr/bin/env bash
# A 15-minute GPU lease (issue 31): build everything here, then load, run, check and time there.
# How-to: scripts/README.md. Commands, from the project root:
#   bash scripts/gpu_lease.sh prepare [--cpu-check] [--target rammer/nvidia-h100] [...]
#        (CPU machine) builds into .lease/ (git-ignored), reusing unchanged builds; last line
#        `travel: N MiB`. `prepare --help` lists the options.
#   bash scripts/gpu_lease.sh plan      the run's steps with estimated seconds; last line `total: N s`
#   bash scripts/gpu_lease.sh run OUT_DIR   (GPU host; ONE command, carry .lease) every step, each
#        bounded, packed into OUT_DIR as it finishes (results.jsonl, raw.tar, run.log, index.json)
#   bash scripts/gpu_lease.sh report DIR    (CPU machine) the results table (markdown + JSON) under
#        benchmarks/results/gpu-<date>-<commit>/
# Environment: LEASE_DIR (default .lease), LEASE_BUDGET_S (default 540: the run's seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
LEASE="${LEASE_DIR:-.lease}"
cmd="${1:-}"; shift || true

case "$cmd" in
  prepare)
    exec python3 -m tvm_rammer.lease.prepare --out "$LEASE" "$@" ;;
  plan)
    exec python3 -m tvm_rammer.lease.plan --lease "$LEASE" "$@" ;;
  report)
    exec python3 -m tvm_rammer.lease.report "$@" ;;
  run)
    out="${1:-${OUT:-}}"
    [ -n "$out" ] || { echo "usage: gpu_lease.sh run OUT_DIR" >&2; exit 2; }
    [ -f "$LEASE/index.json" ] || { echo "gpu_lease.sh run: $LEASE/index.json missing: run" \
      "'bash scripts/gpu_lease.sh prepare' here first and carry $LEASE" >&2; exit 2; }
    mkdir -p "$out"
    t0=$(date +%s)
    # the libraries travel packed (CUDA binaries compress 10-40x): unpacked into the lease folder
    if [ -f "$LEASE/libs.tar.xz" ] && { [ ! -d "$LEASE/libs" ] || [ "$LEASE/libs.tar.xz" -nt "$LEASE/libs" ]; }; then
      rm -rf "$LEASE/libs" && xz -d < "$LEASE/libs.tar.xz" | tar x -C "$LEASE" && touch "$LEASE/libs" \
        || { echo "gpu_lease.sh run: unpacking $LEASE/libs.tar.xz failed" >&2; exit 4; }
    fi
    # TVM's runtime (no compiler) and the wheels, into /tmp: no root, no package index needed
    site=/tmp/tvm-lease/site
    if [ -f "$LEASE/tvm/tvm-runtime.tar.xz" ]; then
      if [ ! -f "$site/.ready" ] || [ "$LEASE/tvm/tvm-runtime.tar.xz" -nt "$site/.ready" ]; then
        rm -rf "$site" && mkdir -p "$site"
        xz -d < "$LEASE/tvm/tvm-runtime.tar.xz" | tar x -C "$site" || { echo "tvm runtime: unpack failed" >&2; exit 4; }
        # the cp312 tvm-ffi wheel; another python keeps its own tvm_ffi (the same version, checked)
        if python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
          python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
            "$LEASE"/tvm/apache_tvm_ffi-*.whl || { echo "tvm-ffi: install failed" >&2; exit 4; }
        fi
        touch "$site/.ready"
      fi
      export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
      export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the installed TVM (a CPU check here)
    fi
    whl=$(ls "$LEASE"/wheels/onnx2torch-*.whl 2>/dev/null | head -1)
    if [ -n "$whl" ] && python3 -c 'import torch' 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tvm-lease/torch \
        "$whl" >/dev/null 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/tvm-lease/torch"
    fi
    export TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
    exec python3 -m tvm_rammer.runtime.lease_steps run "$out" --lease "$LEASE" \
      --budget-s "${LEASE_BUDGET_S:-540}" --install-s $(( $(date +%s) - t0 )) ;;
  *)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    [ -z "$cmd" ] || [ "$cmd" = "-h" ] || [ "$cmd" = "--help" ] || exit 2 ;;
esac
