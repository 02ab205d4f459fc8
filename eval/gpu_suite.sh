#!/usr/bin/env bash
# The GPU measurement suite: the one script the lead runs on the GPU machine (repo copy in cwd, no network).
#
#   bash eval/gpu_suite.sh                    # every step, within SUITE_BUDGET seconds (default 520)
#   bash eval/gpu_suite.sh prefill decode     # only these steps (to split the suite over two runs)
#   run tool: carry [".carry/wh"] (the wheels of ../shared/tools/device-wheels, incl. sageattention==1.0.6)
#   one run of up to 600 s: the default (SUITE_BUDGET=520). Runs limited to 300 s: set SUITE_BUDGET=270 and split,
#   e.g. `tests memcheck` | `accuracy prefill` | `decode e2e chat` (each run returns its own gpu_suite.tar.gz)
#
# Steps, in order: setup tests memcheck accuracy prefill decode layer e2e chat  (setup always runs); ``kernels`` only
# when named (`KERNELS_TESTS="tests/kernels/test_decode.py" bash eval/gpu_suite.sh kernels`: ~4 s a test with its
# Triton compiles, ~550 tests: split the files over several runs)
#   setup     install the carried wheels (.carry/wh, see ../shared/tools/device-wheels) into /tmp/site and this
#             project (pip install --no-deps --no-build-isolation -e .), print the machine line
#   tests     python -m pytest -m gpu tests (the memcheck test is left to the next step)
#   kernels   python -m pytest -m "device_kernels and not gpu" tests: every kernel test taking the device fixture
#             (conftest marks them), on CUDA here; `-m gpu` does not select them
#   memcheck  compute-sanitizer --tool memcheck on one small prefill call and one decode call
#   accuracy  python -m eval.kernel_accuracy --quick   (MRE tables, FA3 outlier RMSE vs fp64)
#   prefill   python -m eval.bench_prefill --quick     (FA3 protocol subset, SDPA cuDNN/flash, Sage, turbo)
#   decode    python -m eval.bench_decode --quick      (4k/32k x batch 1/8/32, presets vs SDPA vs dequant+SDPA)
#   layer     python -m eval.bench_decode --layer-step  (host cost of one layer's decode step, fused store on / off)
#   e2e       python -m eval.bench_e2e --quick         (Llama-3-8B-shaped, E2E_LAYERS layers, default 32)
#   chat      turbo-attn chat on SmolLM2-135M-Instruct, turbo_int8 vs sdpa tokens/s and KV memory, when the GGUF
#             was staged (SMOL_GGUF, default /tmp/m/smol.gguf: ../shared/tools/stage-model, two runs); else skipped
# Environment: PYTHON (default python3), SUITE_BUDGET (s), E2E_LAYERS, SMOL_GGUF, OUT.
# Every step has its own time limit, cut to what is left of SUITE_BUDGET; a step that fails or times out is
# reported and the suite goes on (the long benchmarks rewrite their JSON after every configuration, so a
# timeout keeps what was measured). Results in $OUT (the run tool's folder; default eval/results/gpu_run):
#   suite.log, summary.txt, the result JSONs, and gpu_suite.tar.gz = results/ (JSON + PNG) + logs/ (per step)
# — at most 8 files, what the run tool returns. To commit: tar -xzf gpu_suite.tar.gz results && cp results/* eval/results/
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/eval/results/gpu_run}
WORK=$(mktemp -d /tmp/gpu_suite.XXXX)
RES=$WORK/results
LOGS=$WORK/logs
mkdir -p "$OUT" "$RES" "$LOGS"
BUDGET=${SUITE_BUDGET:-520}
E2E_LAYERS=${E2E_LAYERS:-32}
PY=${PYTHON:-python3}
START=$(date +%s)
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests memcheck accuracy prefill decode layer e2e chat)
SMOL_GGUF=${SMOL_GGUF:-/tmp/m/smol.gguf}
export PYTHONUNBUFFERED=1

exec > >(tee -a "$OUT/suite.log") 2>&1
declare -a SUMMARY=()

want() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# run_step NAME LIMIT_S CMD...: runs CMD with a timeout of min(LIMIT_S, time left - 5), logs to $LOGS/NAME.log
run_step() {
  local name=$1 limit=$2; shift 2
  local rem; rem=$(( $(left) - 5 ))
  if [ "$rem" -lt 20 ]; then
    SUMMARY+=("$name: SKIPPED (suite budget of ${BUDGET}s used up)"); echo "== $name: skipped, budget used up"; return
  fi
  [ "$limit" -gt "$rem" ] && limit=$rem
  echo "== $name (limit ${limit}s): $*"
  local t0 rc; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then SUMMARY+=("$name: ok (${dt}s)")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then SUMMARY+=("$name: TIMEOUT after ${dt}s (limit ${limit}s)")
  else SUMMARY+=("$name: FAILED rc=$rc (${dt}s)"); fi
  echo "== $name: rc=$rc in ${dt}s"
}

# ------------------------------------------------------------------------------------------------ setup
echo "== setup"
if ls .carry/wh/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/wh/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .carry/wh wheels: SageAttention and lm-eval rows will be missing"
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING\|^ *$" | tail -3
if ! $PY -c "import turbo_attn_hf.kernels, turbo_attn_hf.configs, turbo_attn_hf.eval"; then
  echo "FATAL: turbo_attn_hf is not importable with its kernels/configs/eval subpackages after"
  echo "       'pip install --no-deps --no-build-isolation -e .' (see the pip output above); nothing was measured"
  exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader || true
$PY - <<'PY'
import torch, triton, transformers, turbo_attn_hf
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) | triton {triton.__version__} | transformers "
      f"{transformers.__version__} | turbo_attn_hf {turbo_attn_hf.__version__} | registered {turbo_attn_hf.REGISTERED}"
      f" | {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA'}")
try:
    import sageattention; print("sageattention", getattr(sageattention, "__version__", "importable"))
except Exception as e:
    print("sageattention not importable:", type(e).__name__, e)
PY

# ------------------------------------------------------------------------------------------------ steps
if want tests; then
  run_step tests "${TESTS_LIMIT:-170}" $PY -m pytest -m gpu tests -q -k "not memcheck" -p no:cacheprovider
fi

if want kernels; then
  # shellcheck disable=SC2086  # KERNELS_TESTS: files / folders, split over runs (~4 s a test with its compiles)
  run_step kernels "${KERNELS_LIMIT:-560}" $PY -m pytest -m "device_kernels and not gpu" ${KERNELS_TESTS:-tests} -q \
    -p no:cacheprovider
fi

if want memcheck; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    cat > /tmp/memcheck_prefill.py <<'PY'
import torch
from turbo_attn_hf.kernels import prefill
torch.manual_seed(0)
q = torch.randn(2, 4, 77, 80, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 2, 301, 80, device="cuda", dtype=torch.bfloat16)
v = torch.randn(2, 2, 301, 80, device="cuda", dtype=torch.bfloat16)
kv = torch.ones(2, 301, dtype=torch.bool, device="cuda"); kv[1, :50] = False
o = prefill.turbo_attention(q, k, v, causal=True, window=100, key_valid=kv, softmax="sas")
o = prefill.turbo_attention(q, k, v, causal=False, softcap=20.0)
torch.cuda.synchronize()
print("prefill call ok", tuple(o.shape))
PY
    run_step memcheck_prefill 120 compute-sanitizer --tool memcheck --error-exitcode 9 $PY /tmp/memcheck_prefill.py
    if [ -f tests/kernels/test_decode_gpu.py ]; then
      run_step memcheck_decode 120 compute-sanitizer --tool memcheck --error-exitcode 9 $PY tests/kernels/test_decode_gpu.py
    else
      SUMMARY+=("memcheck_decode: SKIPPED (tests/kernels/test_decode_gpu.py missing)")
    fi
  else
    SUMMARY+=("memcheck: SKIPPED (compute-sanitizer not on PATH)")
  fi
fi

want accuracy && run_step accuracy 90 $PY -m eval.kernel_accuracy --quick --out "$RES"
want prefill && run_step prefill 150 $PY -m eval.bench_prefill --quick --out "$RES"
want decode && run_step decode 120 $PY -m eval.bench_decode --quick --out "$RES"
want layer && run_step layer 60 $PY -m eval.bench_decode --layer-step --out "$RES"
want e2e && run_step e2e 170 $PY -m eval.bench_e2e --quick --layers "$E2E_LAYERS" --out "$RES"
if want chat; then
  if [ -f "$SMOL_GGUF" ]; then
    run_step chat 90 $PY -m turbo_attn_hf.cli chat --model "$SMOL_GGUF" --preset int4 --max-new-tokens 64 \
      --prompt "What is the capital of France? Answer in one sentence."
  else
    SUMMARY+=("chat: SKIPPED (no GGUF at $SMOL_GGUF; stage it with ../shared/tools/stage-model)")
  fi
fi

# ------------------------------------------------------------------------------------------------ bundle
{
  echo "gpu_suite: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START ))s of ${BUDGET}s, steps: ${STEPS[*]}"
  for s in "${SUMMARY[@]}"; do echo "  $s"; done
  for f in "$RES"/*.json; do
    [ -f "$f" ] || continue
    $PY - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("summary")
if s:
    print(f"  {sys.argv[1].rsplit('/', 1)[-1]} summary: " + json.dumps(s, default=str)[:1500])
PY
  done
} | tee "$OUT/summary.txt"
cp "$RES"/*.json "$OUT"/ 2>/dev/null || true
cp "$OUT/suite.log" "$WORK/" 2>/dev/null || true
tar -czf "$OUT/gpu_suite.tar.gz" -C "$WORK" results logs suite.log 2>/dev/null || true
echo "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
