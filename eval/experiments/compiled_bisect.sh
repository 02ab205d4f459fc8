#!/usr/bin/env bash
# Issue 18: the compiled static step at 1 x 1k regressed between f50c98b and 9e5b529 (PERF_NOTES "Session 33": mixed
# 7.21 -> 9.10 ms a step, static-cache TTFT 44.6 -> 82.3 ms, sdpa compiled unchanged). This runs each tree in its own
# process on one GPU machine, so the commit that moved it can be found in one call.
#
#   bash eval/experiments/compiled_bisect.sh make f50c98b e6d0731 853a434 0a5d794 8a08924 ad954ff HEAD
#   run tool: command "bash eval/experiments/compiled_bisect.sh gpu", carry [".bisect"]
#
# "make" writes .bisect/<n>_<commit>/ (an importable turbo_attn_hf with kernels/ and configs/ inside, and that tree's
# eval/), ignored by git. "gpu" runs, per tree in the order given: bench_generate at 8 layers, 1 x 1k, sdpa_compiled,
# turbo_int4_compiled, turbo_mixed_compiled, N 64, 3 reps, --profile-step (launches, GPU kernel ms and host ms of one
# compiled step and of the prefill); every tree's sdpa row is its own baseline. A tree's rows land in
# $OUT/<n>_<commit>/ and a summary line (decode ms, TTFT ms per config) is printed per tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
R=$PWD
case "${1:-}" in
make)
  shift
  [ $# -gt 0 ] || { echo "give the commits to compare, oldest first" >&2; exit 2; }
  rm -rf .bisect && mkdir -p .bisect
  n=0
  for c in "$@"; do
    n=$((n + 1)); short=$(git rev-parse --short "$c") || exit 2
    d=.bisect/${n}_$short
    mkdir -p "$d/src"
    git archive "$short" turbo_attn_hf kernels configs eval | tar -x -C "$d/src"
    mv "$d/src/turbo_attn_hf" "$d/" && mv "$d/src/kernels" "$d/turbo_attn_hf/kernels"
    mv "$d/src/configs" "$d/turbo_attn_hf/configs" && mv "$d/src/eval" "$d/eval"
    rm -rf "$d/src" "$d/eval/results"
    echo "$short" > "$d/COMMIT"
  done
  grep -qx "/.bisect/" .git/info/exclude 2>/dev/null || echo "/.bisect/" >> .git/info/exclude
  du -sh .bisect ;;
gpu)
  export PYTHONUNBUFFERED=1
  nvidia-smi -L
  T0=$(date +%s)
  for d in "$R"/.bisect/*/; do
    t=$(basename "$d")
    left=$(( 570 - ($(date +%s) - T0) ))
    [ $left -gt 60 ] || { echo "$t: not run (call time)"; continue; }
    cd "$d" && export PYTHONPATH=$d
    TURBO_GIT_COMMIT="$(cat COMMIT)" timeout $(( left < 150 ? left : 150 )) python3 -m eval.bench_generate --layers 8 \
      --shapes 1x1k --configs sdpa_compiled,turbo_int4_compiled,turbo_mixed_compiled --new-tokens 64 --reps 3 \
      --max-seconds 135 --profile-step --out "$OUT/$t" --no-plot > "$OUT/$t.log" 2>&1
    python3 - "$OUT/$t" "$t" <<'EOF'
import json, sys, pathlib
fs = list(pathlib.Path(sys.argv[1]).glob("bench_generate_*.json"))
if not fs:
    print(sys.argv[2], "no result (see its .log)")
    raise SystemExit
rows = json.loads(fs[0].read_text())["rows"]
print(sys.argv[2], "  ".join(f"{r['config']}: {r.get('decode_ms_per_step') or r.get('error')} ms/step, "
                              f"ttft {r.get('ttft_ms')}" for r in rows))
EOF
  done ;;
*)
  echo "usage: $0 make COMMIT... | gpu" >&2; exit 2 ;;
esac
