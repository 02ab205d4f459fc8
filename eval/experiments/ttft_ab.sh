#!/usr/bin/env bash
# Time to first token, A/B of the kernels' host path (issue 19), as run for eval/results/ttft_issue19_*_h100.json.
#
#   bash eval/experiments/ttft_ab.sh make BEFORE_COMMIT   # here: .ab/{before,after} from HEAD (ignored folder)
#   run tool: command "bash eval/experiments/ttft_ab.sh gpu", carry [".ab"]
#
# .ab/after is HEAD's turbo_attn_hf (with kernels/ and configs/ inside, importable without installing), eval and
# tests; .ab/before the same with kernels/{prefill,quant,launch,store}.py of BEFORE_COMMIT: the A/B isolates those
# files from whatever else the working tree holds. "gpu" runs, each tree in its own process on one machine:
# bench_generate (8 layers, 1x1k / 1x4k, sdpa_dynamic + the three turbo eager presets, 7 reps; after: also
# --profile-step), then store_share (32k) and the GPU tests of the touched files on the after tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
R=$PWD
case "${1:-}" in
make)
  base=${2:?give the commit whose kernels are "before"}
  rm -rf .ab && mkdir -p .ab
  for t in before after; do
    mkdir -p .ab/$t/src
    git archive HEAD turbo_attn_hf kernels configs eval tests pyproject.toml | tar -x -C .ab/$t/src
    mv .ab/$t/src/turbo_attn_hf .ab/$t/ && mv .ab/$t/src/kernels .ab/$t/turbo_attn_hf/kernels
    mv .ab/$t/src/configs .ab/$t/turbo_attn_hf/configs
    mv .ab/$t/src/eval .ab/$t/src/tests .ab/$t/src/pyproject.toml .ab/$t/
    rm -rf .ab/$t/src .ab/$t/eval/results
  done
  for f in prefill quant launch store; do git show "$base:kernels/$f.py" > .ab/before/turbo_attn_hf/kernels/$f.py; done
  git rev-parse --short HEAD > .ab/after/COMMIT
  echo "$(git rev-parse --short HEAD) with kernels/{prefill,quant,launch,store}.py of $base" > .ab/before/COMMIT
  grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
  du -sh .ab ;;
gpu)
  export PYTHONUNBUFFERED=1
  T0=$(date +%s)
  nvidia-smi -L
  for t in before after; do
    cd "$R/.ab/$t" && export PYTHONPATH=$R/.ab/$t
    extra=""; lim=125
    if [ $t = after ]; then extra="--profile-step"; lim=165; fi
    TURBO_GIT_COMMIT="$(cat COMMIT)" timeout $((lim + 10)) python3 -m eval.bench_generate --layers 8 \
      --shapes 1x1k,1x4k --configs sdpa_dynamic,turbo_int8_eager,turbo_int4_eager,turbo_mixed_eager --reps 7 \
      --max-seconds $lim --out "$OUT/$t" --no-plot $extra 2>&1 | tee "$OUT/ttft_$t.log" | grep -v "^ *$" | tail -11
  done
  cd "$R/.ab/after" && export PYTHONPATH=$R/.ab/after
  TURBO_GIT_COMMIT="$(cat COMMIT)" timeout 100 python3 -m eval.experiments.store_share --layers 8 --context 32768 \
    --reps 3 --out "$OUT/store_share_h100.json" 2>&1 | grep -v Warn | tail -4
  timeout $(( 560 - ($(date +%s) - T0) )) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_gpu.py \
    tests/kernels/test_quant.py tests/kernels/test_store_gpu.py tests/kernels/test_launch.py tests/kernels/test_store.py \
    tests/turbo_attn_hf/test_store_fused.py 2>&1 | tee "$OUT/tests_gpu.log" | grep -v "Warn\|warn" | tail -6 ;;
*)
  echo "usage: $0 make BEFORE_COMMIT | gpu" >&2; exit 2 ;;
esac
