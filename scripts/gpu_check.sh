#!/usr/bin/env bash
# The GPU checks, as stages that each finish within 8 minutes on an H100/H200 (a short slot on a
# shared GPU), run one per command, in order of value. Works without installing the package (the
# GPU machine has no package index):
#   export PYTHONPATH=/opt/tvmsite:$PWD   (the TVM bundle, see ../shared/gpu/), then
#   bash scripts/gpu_check.sh --plan              the stages in order: minutes (estimated), outputs
#   bash scripts/gpu_check.sh STAGE [OUT_DIR]     one stage (e.g. smoke, zoo-alexnet, l2)
#   bash scripts/gpu_check.sh next [OUT_DIR]      the first stage not yet done in OUT_DIR
#   bash scripts/gpu_check.sh all [OUT_DIR]       every stage in order (hours; each still bounded)
#   bash scripts/gpu_check.sh --stress [OUT_DIR]  the whole stress run in one go (hours, unbounded)
# OUT_DIR (default $OUT, else benchmarks/results/gpu-<date>-<commit>) gets meta.json (device,
# driver, date, commit) and stages.jsonl (one line per finished stage: exit, seconds); each stage
# writes under OUT_DIR/<stage>/ as it goes (profile databases are flushed per measured batch), so a
# stage cut short keeps what it did. The directory is ready to commit under benchmarks/results/.
# Every stage is run under `timeout` (STAGE_LIMIT_S, default 480 s = 8 min): a stage that overruns
# is stopped and recorded (exit 124), the next one is unaffected.
# CUDA binaries are cached by source (tvm_rammer/host/binary_cache.py, under $XDG_CACHE_HOME): a
# stage that builds a module an earlier stage built reads it instead of running nvcc, so compile
# seconds of a repeated build leave nvcc out; `bench` turns the cache off (its compile_s is nvcc's).
# On the device tool (at most 8 files of 16 MiB come back per call, $OUT emptied before each), as on
# 2026-11-25: keep OUT_DIR on the machine and pack it after every stage, e.g.
#   R=/tmp/gpures; for s in smoke zoo-lstm_tc; do bash scripts/gpu_check.sh $s $R;
#     tar czf $OUT/gpures.tgz -C /tmp gpures; done
set -uo pipefail
cd "$(dirname "$0")/.."

ZOO="alexnet deepspeech2 googlenet inception_v3 lstm_tc nasnet_cifar randwire resnext29 seq2seq squeezenet"
EPILOGUE="lstm_tc seq2seq"
RKFUNC="lstm_tc squeezenet"  # RammerConfig.rkernel_functions on/off: unmeasured on a GPU (2026-11-25)
SANITIZED="branches lstm_tc squeezenet"
LIMIT="${STAGE_LIMIT_S:-480}"

# --- the plan: stage, estimated minutes, outputs. Measured on the H200 (2026-11-25): demo 1 min,
# test_gpu.py over 4 min (so its random DAGs are a stage of their own), a zoo model without profiling
# 1.5 min (lstm_tc and nasnet_cifar: 188 s together, export and timing included) ---
plan() {
  echo "smoke 4 smoke/{demo.log,gpu_tests.log}: tvm-rammer demo and tests/test_gpu.py but its random DAGs"
  echo "gpu-tests 8 gpu-tests/<file>.log: the other -m gpu tests, first half of their files (150 s a file)"
  echo "gpu-tests-2 8 gpu-tests-2/<file>.log: the other -m gpu tests, second half of their files"
  echo "gpu-dags 4 gpu-dags/gpu_tests.log: tests/test_gpu.py's 30 random DAGs vs onnxruntime"
  for m in $RKFUNC; do
    echo "rkfunc-$m 4 rkfunc-$m/{on,off}.json: $m's persistent kernel with each rKernel body a __noinline__ function (the default) and inline: does the default cost time?"
  done
  for m in $ZOO; do
    echo "zoo-$m 3 zoo-$m/run.json: $m at full size vs onnxruntime, latency vs TVM's default (no profiling; the profile database read)"
  done
  for m in $ZOO; do
    echo "profile-$m 7 profiles/<device>.json, profile-$m/inspect.json: $m's kernels and rPrograms measured (budget 360 s; run again to continue)"
  done
  for m in $EPILOGUE; do
    echo "epilogue-$m 6 epilogue-$m/{with,without}.json: $m with and without the GEMV epilogue"
  done
  echo "l2 1 l2/l2.json: the L2 read bandwidth the cost model assumes, measured"
  echo "bench 6 bench/: tvm-bench --reduced, every system, reduced models"
  echo "relower 4 relower/relower.json: persistent kernels lowered by TVM's TIR pipeline and ours"
  for m in $SANITIZED; do
    echo "sanitize-$m 6 sanitize-$m/*.log: compute-sanitizer memcheck, racecheck, synccheck on reduced $m"
  done
  echo "stress-runs 3 stress-runs/stress-*.json: 10,000 back-to-back runs, 8 threads on one module"
  echo "stress-fuzz 7 stress-fuzz/stress-*.json: 150 fuzzed graphs on the device vs onnxruntime"
}

known_stage() {
  plan | awk '{print $1}' | grep -qx -- "$1"
}

# --- helpers ---
# GPU_CHECK_DRY=1: print each command instead of running it (tests/test_gpu_check.py)
run() { if [ -n "${GPU_CHECK_DRY:-}" ]; then echo "+ $*"; else "$@"; fi; }
py() { run python3 "$@"; }

write_meta() {
  mkdir -p "$out"
  [ -f "$out/meta.json" ] || [ -n "${GPU_CHECK_DRY:-}" ] && return
  py - "$out/meta.json" <<'PY'
import datetime, json, subprocess, sys
def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""
gpu = sh("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader").split(", ")
json.dump({"device": gpu[0] if gpu and gpu[0] else "unknown",
           "driver": gpu[1] if len(gpu) > 1 else "unknown",
           "date": datetime.date.today().isoformat(), "commit": sh("git", "rev-parse", "HEAD")},
          open(sys.argv[1], "w"), indent=1)
PY
}

device_slug() {
  [ -n "${GPU_CHECK_DRY:-}" ] && { echo dry; return; }
  python3 -c "import re; from tvm_rammer.host.gpu import local_gpu; \
print(re.sub(r'[^a-z0-9]+', '-', local_gpu().id.name.lower()).strip('-'))"
}

profiles_db() {  # the JSON profile database of this device (seeded from the shipped one)
  local slug; slug=$(device_slug)
  mkdir -p "$out/profiles"
  [ -f "$out/profiles/$slug.json" ] || { [ -f "tvm_rammer/profiles/$slug.json" ] \
    && cp "tvm_rammer/profiles/$slug.json" "$out/profiles/$slug.json"; }
  echo "$out/profiles/$slug.json"
}

model_file() {  # $1 model -> the ONNX file (full size), outside OUT_DIR (a stage cut short by its
  # limit would leave it there, and OUT_DIR is what comes back from a GPU machine)
  local models="${TMPDIR:-/tmp}/gpu_check_models"; mkdir -p "$models"
  [ -f "$models/$1.onnx" ] || py -m tvm_rammer.cli model "$1" -o "$models/$1.onnx" >/dev/null
  echo "$models/$1.onnx"
}

gpu_test_files() {  # $1: 1 or 2 -> that half of the test files with -m gpu tests, test_gpu.py aside
  local files; files=$(grep -l "mark.gpu" tests/test_*.py | grep -v "tests/test_gpu.py" | sort)
  local n; n=$(echo "$files" | wc -l)
  if [ "$1" = 1 ]; then echo "$files" | head -n $(( (n + 1) / 2 )); else echo "$files" | tail -n +$(( (n + 1) / 2 + 1 )); fi
}

pytest_files() {  # $1 dir, then files: one pytest run per file, each with its own log and limit,
  # so a file that hangs or a stage cut short still leaves every earlier file's failures in full
  local dir="$1" f rc=0; shift
  for f in "$@"; do
    run timeout --kill-after=10 "${FILE_LIMIT_S:-150}" python3 -m pytest -q -m gpu "$f" \
      -p no:cacheprovider -rf --durations=5 > "$dir/$(basename "$f" .py).log" 2>&1 || rc=$?
  done
  return $rc
}

# --- the stages (each writes into $dir) ---
stage_body() {
  local stage="$1" dir="$2" m
  case "$stage" in
    smoke)
      py -m tvm_rammer.cli demo --profile-budget 60 --no-progress > "$dir/demo.log" 2>&1
      py -m pytest -q -m gpu tests/test_gpu.py -k "not random_dags" -p no:cacheprovider -rf \
        --durations=5 > "$dir/gpu_tests.log" 2>&1 ;;
    gpu-tests)
      # shellcheck disable=SC2046
      pytest_files "$dir" $(gpu_test_files 1) ;;
    gpu-tests-2)
      # shellcheck disable=SC2046
      pytest_files "$dir" $(gpu_test_files 2) ;;
    gpu-dags)
      py -m pytest -q -m gpu tests/test_gpu.py -k random_dags -p no:cacheprovider -rf \
        > "$dir/gpu_tests.log" 2>&1 ;;
    zoo-*)
      m=${stage#zoo-}
      py -m tvm_rammer.cli run "$(model_file "$m")" --profile-db "$(profiles_db)" --no-profile \
        --no-progress --json > "$dir/run.json" 2> "$dir/run.err" ;;
    profile-*)
      m=${stage#profile-}
      py -m tvm_rammer.cli inspect "$(model_file "$m")" --profile-db "$(profiles_db)" \
        --profile-budget 360 --json > "$dir/inspect.json" 2> "$dir/inspect.err" ;;
    rkfunc-*)
      m=${stage#rkfunc-}
      local f; f=$(model_file "$m"); local rc=0
      py -m tvm_rammer.cli run "$f" --profile-db "$(profiles_db)" --no-profile \
        --no-unmeasured-check --no-progress --json > "$dir/on.json" 2> "$dir/on.err" || rc=$?
      py -m tvm_rammer.cli run "$f" --profile-db "$(profiles_db)" --no-profile \
        --no-unmeasured-check --no-progress --json --no-rkernel-functions \
        > "$dir/off.json" 2> "$dir/off.err" || rc=$?
      return $rc ;;
    epilogue-*)
      m=${stage#epilogue-}
      local f; f=$(model_file "$m"); local rc=0
      py -m tvm_rammer.cli run "$f" --profile-db "$(profiles_db)" --profile-budget 60 --json \
        > "$dir/with.json" 2> "$dir/with.err" || rc=$?
      py -m tvm_rammer.cli run "$f" --profile-db "$(profiles_db)" --profile-budget 60 --json \
        --no-gemv-epilogue > "$dir/without.json" 2> "$dir/without.err" || rc=$?
      return $rc ;;
    l2)
      py - "$dir/l2.json" <<'PY'
import json, sys
import tvm
from tvm_rammer.benchmarks.floor import l2_read_rate
from tvm_rammer.scheduling.cost_model import CostModelConfig
rate = l2_read_rate(tvm.cuda(0))
json.dump({"l2_bytes_per_s": rate, "assumed": CostModelConfig().l2_bw_gbps * 1e9},
          open(sys.argv[1], "w"))
print(f"L2 reads: measured {rate / 1e12:.2f} TB/s, the cost model assumes "
      f"{CostModelConfig().l2_bw_gbps / 1e3:.2f} TB/s")
PY
      ;;
    bench)
      py -m tvm_rammer.cli bench --reduced --out "$dir" --no-progress --profile-db "$(profiles_db)" \
        > "$dir/bench.log" 2>&1 ;;
    relower)
      py scripts/relower_check.py --reduced --out "$dir/relower.json" > "$dir/relower.log" 2>&1 ;;
    sanitize-*)
      m=${stage#sanitize-}
      local exe; exe=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      local rc=0 tool
      for tool in memcheck racecheck synccheck; do
        run "$exe" --tool "$tool" --error-exitcode 99 python3 -m tvm_rammer.checks.stress run-model "$m" \
          > "$dir/$tool.log" 2>&1 || rc=$?
      done
      return $rc ;;
    stress-runs)
      py -m tvm_rammer.checks.stress --out "$dir" --parts back_to_back,threads > "$dir/stress.log" 2>&1 ;;
    stress-fuzz)
      py -m tvm_rammer.checks.stress --out "$dir" --parts fuzz --graphs "${FUZZ_GRAPHS:-150}" \
        > "$dir/stress.log" 2>&1 ;;
    *) echo "gpu_check: no stage $stage" >&2; return 2 ;;
  esac
}

run_stage() {
  local stage="$1" dir="$out/$1" start rc
  mkdir -p "$dir"
  echo "== $stage (at most ${LIMIT} s) -> $dir"
  start=$(date +%s)
  export -f stage_body run py model_file profiles_db device_slug gpu_test_files pytest_files
  export out
  timeout --kill-after=30 "$LIMIT" bash -c 'stage_body "$@"' _ "$stage" "$dir"
  rc=$?
  echo "{\"stage\": \"$stage\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - start ))}" \
    >> "$out/stages.jsonl"
  echo "   exit $rc after $(( $(date +%s) - start )) s"
  return $rc
}

# --- command line ---
cmd="${1:-}"
if [ "$cmd" = "--plan" ]; then
  i=0
  plan | while read -r name minutes rest; do
    i=$((i + 1)); printf '%2d. %-22s %2s min  %s\n' "$i" "$name" "$minutes" "$rest"
  done
  echo "total: $(plan | awk '{s += $2} END {print s}') min, each stage at most $(( LIMIT / 60 )) min"
  exit 0
fi
if [ "$cmd" = "--known" ]; then known_stage "${2:-}"; exit $?; fi
if [ "$cmd" = "--stress" ]; then  # the whole stress run at once (hours; no stage bound)
  out="${2:-${OUT:-out}}"; mkdir -p "$out"
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
  # shellcheck disable=SC2086
  python3 -m tvm_rammer.checks.stress --out "$out" ${STRESS_ARGS:-} 2>&1 | tee "$out/stress.log"
  exit "${PIPESTATUS[0]}"
fi
if [ -z "$cmd" ] || [ "$cmd" = "-h" ] || [ "$cmd" = "--help" ]; then
  sed -n '2,15p' "$0"; exit 0
fi
out="${2:-${OUT:-benchmarks/results/gpu-$(date +%F)-$(git rev-parse --short HEAD 2>/dev/null || echo nocommit)}}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1
export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"
write_meta
case "$cmd" in
  all)
    for s in $(plan | awk '{print $1}'); do run_stage "$s"; done ;;
  next)
    for s in $(plan | awk '{print $1}'); do
      grep -q "\"stage\": \"$s\", \"exit\": 0" "$out/stages.jsonl" 2>/dev/null && continue
      run_stage "$s"; exit $?
    done
    echo "every stage is done in $out" ;;
  *)
    if ! known_stage "$cmd"; then
      echo "gpu_check: no stage '$cmd'; the stages: $(plan | awk '{print $1}' | tr '\n' ' ')" >&2
      exit 2
    fi
    run_stage "$cmd" ;;
esac
