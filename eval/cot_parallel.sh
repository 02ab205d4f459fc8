#!/usr/bin/env bash
# The lm-eval chain-of-thought runs of several presets at once on ONE GPU: one process per run, each with
# its own output folder (a 135M model is bound by host launch overhead, so the processes overlap well;
# measured on an H100: one int8 run of GSM8K alone 169 s at batch 128).
#
#   [LIMIT=400 (examples per task, BBH stays 40)] MODEL=/tmp/m GGUF=smol.gguf DATA=.carry/data OUT=$OUT LIMIT_S=540 bash eval/cot_parallel.sh floor sdpa int8 int4 mixed
#
# "floor" = the eager-fp32 run (the answer-agreement floor). Each run writes $OUT/cot_<run>/ (results.json,
# results.md, samples_<run>.jsonl after every task; a run cut by LIMIT_S keeps its finished tasks) and its
# log $OUT/cot_<run>.log. Merge afterwards: python -m eval.lm_eval_run --merge DIR... --out eval/results/cot_smollm2
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=${MODEL:?MODEL dir}; DATA=${DATA:-../shared/data}; OUT=${OUT:-eval/results/cot_runs}; LIMIT_S=${LIMIT_S:-3600}
BATCH=${BATCH:-128}; TASKS=${TASKS:-gsm8k_cot,aqua_cot,bbh_cot}; LIM=(); [ -n "${LIMIT:-}" ] && LIM=(--limit "$LIMIT")
GG=(); [ -n "${GGUF:-}" ] && GG=(--gguf-file "$GGUF")
mkdir -p "$OUT"
pids=()
for run in "$@"; do
  name=$(basename "$run" .yaml)
  if [ "$run" = floor ]; then args=(--presets "" --floor); else args=(--presets "$run"); fi
  timeout --kill-after=10 "$LIMIT_S" $PY -m eval.lm_eval_run --model "$MODEL" "${GG[@]}" --tasks "$TASKS" "${LIM[@]}" --limit-bbh 40 \
    --batch-size "$BATCH" --data-dir "$DATA" "${args[@]}" --out "$OUT/cot_$name" > "$OUT/cot_$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for run in "$@"; do name=$(basename "$run" .yaml); echo "== $name"; grep -a "s for\|=== run" "$OUT/cot_$name.log" | tail -4; done
