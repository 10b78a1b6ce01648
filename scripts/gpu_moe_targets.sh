#!/usr/bin/env bash
# LoRA over an int8 base of the released mixture-of-experts shapes, trained the user's way on one GPU:
# `python -m jaxzero.train` with checkpoints on, run to a save, resumed from it and trained through to
# the final checkpoint. The weights are drawn from the seed (the named sizes: no Hugging Face files on
# the box), the tokens synthetic. Each model's two runs go through scripts/bench_checkpoint_runs.py,
# which prints the plan's figures (host RAM, GPU, disk, step, tokens/s) beside the measured ones (peak
# host RSS, peak GPU, peak disk under the run directory, median step, tokens/s) and the losses, and
# leaves every log under $OUT/<model>.
#
#   OUT=/path/to/logs scripts/gpu_moe_targets.sh [MODEL ...]    # default: qwen3-30b-a3b mixtral-8x7b
#
# STEPS steps (default 20), a checkpoint every EVERY (default 10): the first run saves at EVERY and at
# STEPS; the second drops the checkpoints after EVERY, resumes there and saves at STEPS again, so its
# losses after EVERY compare with the first run's. BATCH x SEQ tokens per step (default 8 x 2048) in
# ACCUM micro-batches (default 1; the plans for one H200 and one H100 box: docs/how-big.md, "Fine-tune
# a MoE on one GPU"). BASE: the base's storage dtype (default int8; `BASE=bfloat16 ... gemma-3-27b` for
# a dense model's LoRA over a bf16 base). EXTRA: more key=value overrides, comma-separated,
# after the script's own (the last of a repeated key wins); on a box that runs jaxzero from its source
# tree without tensorboardX, EXTRA=logging.tensorboard=false (the run refuses at once otherwise). RUNS: where the run directories go
# (default /tmp/jaxzero-bench; each removed when its model is done). PYTHON: the interpreter (python3).
set -euo pipefail
: "${OUT:?set OUT to the folder for the logs}"
here=$(cd "$(dirname "$0")" && pwd)
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(qwen3-30b-a3b mixtral-8x7b)
steps=${STEPS:-20} every=${EVERY:-10} batch=${BATCH:-8} seq=${SEQ:-2048}
if [ "$every" -ge "$steps" ]; then
  echo "EVERY=$every must be below STEPS=$steps: the resume starts from the save at EVERY" >&2
  exit 2
fi
for m in "${models[@]}"; do
  o="model.name=$m,finetune.method=lora,finetune.base_dtype=${BASE:-int8},finetune.lora_targets=q,k,v,o"
  o="$o,data.source=synthetic,data.seq_len=$seq,data.batch_size=$batch,data.grad_accum=${ACCUM:-1}"
  o="$o,optimizer.lr=1e-4,steps=$steps,checkpoint.enabled=true,checkpoint.every=$every"
  [ -z "${EXTRA:-}" ] || o="$o,$EXTRA"
  "${PYTHON:-python3}" "$here/bench_checkpoint_runs.py" --out="$OUT/$m" --config= \
    --runs_dir="${RUNS:-/tmp/jaxzero-bench}" \
    "lora-$m:$o" "resume-lora-$m@$every:$o"
done
