#!/usr/bin/env bash
# Reproduces the shipped state predictor for SmolLM2-135M-Instruct
# (sot/assets/smollm2-135m-instruct.state.safetensors) on a 2-core CPU, in seven stages:
#   1. ShareGPT: 1.5M tokens of cached target states, about 730 steps (66 minutes).
#   2. Self-distillation: the target's own greedy answers to 1,520 ShareGPT training prompts
#      (about 30 minutes to generate), then 400 fine-tuning steps on them (25 minutes).
#   3. Both caches together: 300 steps, then 900 more at a fresh schedule (22 + 84 minutes).
#   4. 1,800 more steps at a fresh schedule, the self-distilled cache drawn twice as often
#      (it is listed twice), about 90 minutes.
#   5. 2,480 more self-distilled answers (35 minutes), then 1,500 steps on ShareGPT and all
#      4,000 answers, drawn twice as often (about 2 hours).
#   7. (stage 6 was tried and not shipped; see the training report) code: the target's answers
#      to 1,027 standard-library function-completion requests and 450 ShareGPT coding prompts
#      plus 200 chat answers (about 75 minutes to generate, 25 to cache), with 200k tokens of
#      ShareGPT, then 225 steps of a 600-step schedule (about 27 minutes on the AVX2 machine).
#   8. code: the target's answers to 1,104 function-completion requests built from the installed
#      packages (about 50 minutes to generate, 16 to cache), then 300 steps of a 600-step
#      schedule on them and stage 7's caches (about 37 minutes). The prompts depend on what is
#      installed: this run's environment was the one scripts/setup.sh makes, on Python 3.11.
#   (stage 9, 600 more chat and 480 more code answers, stage 10, a second decoder layer, and
#   stage 11, the draft vocabulary counted anew on that data, were tried and not shipped; see the
#   report)
# Each command resumes where it stopped: gen-data skips answered prompts, prepare must be re-run
# from scratch if it was interrupted, fit continues from the run folder's checkpoint.pt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# ARCH=eagle3 trains the same stages in EAGLE-3's layout ('sot export --format eagle3' then
# writes it for vLLM and SGLang); the shipped file is native
ARCH=${ARCH:-native}
# stage 1
[ -f runs/data/sharegpt/prepare.json ] || \
  $PY -m sot.cli train prepare --out runs/data/sharegpt --tokens 1500000 --eval-conversations 64
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/sharegpt --out runs/state-default \
  --steps 1100 --tokens-per-step 2048 --lr 2e-3 --warmup 20 --unroll 3 --draft-vocab 16384 --init target \
  --eval-every 100 --save-every 25 --max-seconds 3900
# stage 2
$PY -m sot.cli train gen-data --out runs/selfdistill/answers.jsonl --limit 1520 --max-new-tokens 256 --batch-size 16 \
  --drafter pld  # greedy output is the same with any drafter
[ -f runs/data/selfdistill/prepare.json ] || \
  $PY -m sot.cli train prepare --data runs/selfdistill/answers.jsonl --out runs/data/selfdistill \
    --tokens 2000000 --eval-conversations 64
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/selfdistill --out runs/sd-gen --steps 400 --tokens-per-step 2048 \
  --lr 6e-4 --warmup 10 --unroll 3 --init-from runs/state-default/predictor.safetensors --eval-every 100 --save-every 25
# stage 3
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/sharegpt,runs/data/selfdistill --out runs/sd-mix --steps 300 \
  --tokens-per-step 2048 --lr 4e-4 --warmup 10 --unroll 3 --init-from runs/sd-gen/predictor.safetensors \
  --eval-every 100 --save-every 25
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/sharegpt,runs/data/selfdistill --out runs/sd-long --steps 900 \
  --tokens-per-step 2048 --lr 4e-4 --warmup 10 --unroll 3 --init-from runs/sd-mix/predictor.safetensors \
  --eval-every 150 --save-every 25
# stage 4
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/sharegpt,runs/data/selfdistill,runs/data/selfdistill --out runs/sd-xl \
  --steps 1800 --tokens-per-step 2048 --lr 4e-4 --warmup 10 --unroll 3 --init-from runs/sd-long/predictor.safetensors \
  --eval-every 150 --save-every 25
# stage 5: 2,480 more self-distilled answers (the first 1,520 are stage 2's), drawn twice as often
mkdir -p runs/selfdistill2
[ -f runs/selfdistill2/answers.jsonl ] || cp runs/selfdistill/answers.jsonl runs/selfdistill2/answers.jsonl
$PY -m sot.cli train gen-data --out runs/selfdistill2/answers.jsonl --limit 4000 --max-new-tokens 256 --batch-size 16 \
  --drafter state
[ -f runs/data/selfdistill2/prepare.json ] || \
  $PY -m sot.cli train prepare --data runs/selfdistill2/answers.jsonl --out runs/data/selfdistill2 \
    --tokens 3000000 --eval-conversations 64
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/sharegpt,runs/data/selfdistill2,runs/data/selfdistill2 --out runs/sd-5 \
  --steps 1500 --tokens-per-step 2048 --lr 4e-4 --warmup 10 --unroll 3 --init-from runs/sd-xl/predictor.safetensors \
  --eval-every 150 --save-every 25
# stage 7: code answers, mixed with chat; the held-out curve is ShareGPT's (the first cache's)
CODE='\b(python|javascript|typescript|java|c\+\+|c#|rust|golang|sql|regex|function|code|script|class|bash|html|css|react|api|json|algorithm|program)\b'
mkdir -p runs/stdlib runs/general runs/code
[ -f runs/stdlib/prompts.jsonl ] || $PY -m sot.cli train code-prompts --out runs/stdlib/prompts.jsonl --limit 1027
gen() { $PY -m sot.cli train gen-data --max-new-tokens 256 --batch-size 16 --drafter none "$@"; }
gen --out runs/stdlib/answers.jsonl --prompts runs/stdlib/prompts.jsonl --limit 600
gen --out runs/general/answers.jsonl --limit 200
[ -f runs/data/stdlib/prepare.json ] || \
  $PY -m sot.cli train prepare --data runs/stdlib/answers.jsonl --out runs/data/stdlib --tokens 3000000 --eval-conversations 32
[ -f runs/data/general/prepare.json ] || \
  $PY -m sot.cli train prepare --data runs/general/answers.jsonl --out runs/data/general --tokens 3000000 --eval-conversations 16
gen --out runs/stdlib/answers.jsonl --prompts runs/stdlib/prompts.jsonl --limit 1027
gen --out runs/code/answers.jsonl --limit 450 --match "$CODE"
# the standard-library answers the first cache did not read, and the coding answers
{ tail -n +601 runs/stdlib/answers.jsonl; cat runs/code/answers.jsonl; } > runs/code/new.jsonl
[ -f runs/data/code7/prepare.json ] || \
  $PY -m sot.cli train prepare --data runs/code/new.jsonl --out runs/data/code7 --tokens 2000000 --eval-conversations 16
[ -f runs/data/sharegpt-sub/prepare.json ] || \
  $PY -m sot.cli train prepare --out runs/data/sharegpt-sub --tokens 200000 --eval-conversations 16
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/stdlib,runs/data/code7,runs/data/general,runs/data/sharegpt-sub --out runs/sd-7 \
  --steps 600 --stop-after 225 --tokens-per-step 2048 --lr 2e-4 --warmup 10 --unroll 3 \
  --init-from runs/sd-5/predictor.safetensors --eval-every 100 --save-every 25
# stage 8: function-completion requests from the installed packages; the last 48 answers are held out
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p runs/code8
[ -f runs/code8/prompts.jsonl ] || \
  $PY -m sot.cli train code-prompts --source "$SITE" --per-package 60 --limit 1400 --out runs/code8/prompts.jsonl
gen --out runs/code8/answers.jsonl --prompts runs/code8/prompts.jsonl --limit 1104
head -n 1056 runs/code8/answers.jsonl > runs/code8/train.jsonl
tail -n 48 runs/code8/answers.jsonl > runs/code8/eval.jsonl
[ -f runs/data/code8/prepare.json ] || \
  $PY -m sot.cli train prepare --data runs/code8/train.jsonl --eval-data runs/code8/eval.jsonl --eval-conversations 48 \
    --out runs/data/code8 --tokens 2000000
$PY -m sot.cli train fit --arch "$ARCH" --data runs/data/code8,runs/data/code7,runs/data/stdlib,runs/data/general,runs/data/sharegpt-sub \
  --out runs/sd-8 --steps 600 --stop-after 300 --tokens-per-step 2048 --lr 2e-4 --warmup 10 --unroll 3 \
  --init-from runs/sd-7/predictor.safetensors --eval-every 100 --save-every 25
mkdir -p sot/assets
cp runs/sd-8/predictor.safetensors sot/assets/smollm2-135m-instruct.state.safetensors
