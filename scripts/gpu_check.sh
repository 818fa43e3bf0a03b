#!/usr/bin/env bash
# Every GPU test and benchmark in one command, for a machine with a CUDA GPU.
# Works without installing the package (the GPU machine has no package index):
#   export PYTHONPATH=/opt/tvmsite:$PWD   (the TVM bundle, see ../shared/gpu/), then
#   bash scripts/gpu_check.sh [OUT_DIR]
# Prints a short table last; full logs and JSON go to OUT_DIR (default: $OUT or ./out).
#   bash scripts/gpu_check.sh --stress [OUT_DIR]   the stress run instead (tvm_rammer/stress.py):
#   5,000 fuzzed graphs on the device vs onnxruntime, compute-sanitizer memcheck/racecheck/synccheck
#   on the reduced zoo, 10,000 back-to-back runs, 8 threads on one module; JSON in OUT_DIR
#   (hours: the 5,000 graphs are each compiled with nvcc; STRESS_ARGS="--graphs 500" for less).
set -uo pipefail
cd "$(dirname "$0")/.."
stress=0
if [ "${1:-}" = "--stress" ]; then stress=1; shift; fi
out="${1:-${OUT:-out}}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1
export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
git rev-parse HEAD 2>/dev/null | tee "$out/commit.txt"
if [ "$stress" = 1 ]; then
  # shellcheck disable=SC2086
  python3 -m tvm_rammer.stress --out "$out" ${STRESS_ARGS:-} 2>&1 | tee "$out/stress.log"
  exit "${PIPESTATUS[0]}"
fi

python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
python3 -m tvm_rammer.cli demo 2>&1 | tee "$out/demo.log"

# Profile databases for every model of the zoo at full size, one model at a time (so timings do not
# disturb each other): every rKernel version checked and timed, every rProgram timed against TVM's
# default kernels. Commit $out/profiles/<device>.json as tvm_rammer/profiles/<device>.json: CPU
# compilations for this arch then choose kernels on these times.
slug=$(python3 -c "import re; from tvm_rammer.gpu import local_gpu; \
print(re.sub(r'[^a-z0-9]+', '-', local_gpu().id.name.lower()).strip('-'))")
profiles="$out/profiles/$slug.json"
mkdir -p "$out/profiles" "$out/inspect"
[ -f "tvm_rammer/profiles/$slug.json" ] && cp "tvm_rammer/profiles/$slug.json" "$profiles"
for model in ${PROFILE_MODELS:-$(python3 -c "from tvm_rammer.models import MODELS; print(*sorted(MODELS))")}; do
  python3 -m tvm_rammer.cli model "$model" -o "$out/inspect/$model.onnx"
  timeout "${PROFILE_TIMEOUT:-900}" python3 -m tvm_rammer.cli inspect "$out/inspect/$model.onnx" \
    --profile-db "$profiles" --json > "$out/inspect/$model.json" 2> "$out/inspect/$model.err" \
    || echo "profile $model: exit $?" | tee -a "$out/profile.log"
  rm -f "$out/inspect/$model.onnx"
done

python3 -m tvm_rammer.cli model branches --param n=16 -o "$out/branches16.onnx"
python3 -m tvm_rammer.cli run "$out/branches16.onnx" --profile-db "$profiles" --json \
  > "$out/branches16.json" 2> "$out/run.err"
python3 -m tvm_rammer.cli bench --reduced --out "$out" --no-progress --profile-db "$profiles" 2>&1 \
  | tee "$out/bench.log"
# The RNN cells' GEMV epilogue (GEMVEpilogueFusion) was chosen on predicted times: run LSTM-TC and
# Seq2Seq at full size with and without it, one at a time (error vs onnxruntime, latency vs TVM's
# default), so the GPU says whether it pays; also the L2 bandwidth the cost model assumes
# (CostModelConfig.l2_bw_gbps) next to the measured one. EPILOGUE_MODELS="" skips the runs.
mkdir -p "$out/epilogue"
for model in ${EPILOGUE_MODELS-lstm_tc seq2seq}; do
  python3 -m tvm_rammer.cli model "$model" -o "$out/epilogue/$model.onnx"
  for flag in "" --no-gemv-epilogue; do
    tag=${flag:+-no-epilogue}
    timeout "${PROFILE_TIMEOUT:-900}" python3 -m tvm_rammer.cli run "$out/epilogue/$model.onnx" \
      --profile-db "$profiles" --json $flag > "$out/epilogue/$model$tag.json" \
      2> "$out/epilogue/$model$tag.err" || echo "run $model $flag: exit $?" | tee -a "$out/epilogue.log"
  done
  rm -f "$out/epilogue/$model.onnx"
done
python3 - "$out/l2.json" <<'PY' 2>&1 | tee -a "$out/epilogue.log"
import json, sys
import tvm
from tvm_rammer.benchmarks.floor import l2_read_rate
from tvm_rammer.cost_model import CostModelConfig
rate = l2_read_rate(tvm.cuda(0))
json.dump({"l2_bytes_per_s": rate, "assumed": CostModelConfig().l2_bw_gbps * 1e9}, open(sys.argv[1], "w"))
print(f"L2 reads: measured {rate / 1e12:.2f} TB/s, the cost model assumes "
      f"{CostModelConfig().l2_bw_gbps / 1e3:.2f} TB/s")
PY
# Persistent kernels lowered by TVM's whole TIR pipeline and by ours (tir_pipeline.REDONE_BY_NVCC
# skipped): the same SASS is checked on CPU; here both builds run, compared and timed.
python3 scripts/relower_check.py --reduced --out "$out/relower.json" 2>&1 | tee "$out/relower.log"

echo
echo "== summary ($(cat "$out/device.txt" 2>/dev/null), commit $(cut -c1-8 "$out/commit.txt" 2>/dev/null))"
echo "gpu tests: $(tail -n 1 "$out/gpu_tests.log")  (exit $tests_rc)"
python3 - "$out/inspect" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        s = json.loads(path.read_text())
    except Exception:
        print(f"{path.stem}: no result"); continue
    progs = s.get("programs", [])
    meas = [p.get("measured_us") for p in progs]
    dflt = [p.get("default_us") for p in progs]
    print(f"{path.stem}: {s['rprograms']} rPrograms, launches {s['launches']} (default "
          f"{s.get('default_launches')}), measured {meas} us vs TVM default kernels {dflt} us, "
          f"{len(s.get('fallbacks', []))} fell back")
PY
python3 - "$out/epilogue" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        r = json.loads(path.read_text())
        print(f"{path.stem}: tvm-rammer {r['rammer']['latency_us']:.1f} us "
              f"(err {r['rammer']['max_rel_err']:.1e}), TVM default {r['default']['latency_us']:.1f} us")
    except Exception as err:
        print(f"{path.stem}: no result ({err})")
PY
python3 - "$out/branches16.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as err:
    print(f"16-branch model: no result ({err})")
else:
    print(f"16-branch GEMV model: tvm-rammer {r['rammer']['latency_us']:.2f} us "
          f"(err {r['rammer']['max_rel_err']:.1e}), TVM default {r['default']['latency_us']:.2f} us, "
          f"speedup {r['speedup']:.2f}x")
PY
exit "$tests_rc"
