#!/usr/bin/env bash
# Exact-resume verification.
#   1. train the default job for 20 steps (it checkpoints at step 10 and 20);
#   2. start a second job from the step-10 checkpoint and train it to step 20;
#   3. compare: losses of steps 11-20 must be bitwise equal and the step-20
#      checkpoints byte-identical. Exit 0 only then.
# Usage: scripts/resume.sh [hydra overrides applied to both jobs...]
# RESUME_DIR=<dir> keeps the two runs there (default: a fresh temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${RESUME_DIR:-$(mktemp -d -t resume.XXXXXX)}
mkdir -p "$OUT"
if [ -e "$OUT/full" ] || [ -e "$OUT/resumed" ]; then
  echo "error: $OUT already holds full/ or resumed/; choose an empty RESUME_DIR" >&2
  exit 2
fi

echo "== job 1: 20 steps from scratch -> $OUT/full"
"$PY" train.py hydra.run.dir="$OUT/full" train.steps=20 checkpoint.every_steps=10 "$@" > "$OUT/full.log" 2>&1 \
  || { tail -n 20 "$OUT/full.log" >&2; echo "error: job 1 failed (log: $OUT/full.log)" >&2; exit 1; }

echo "== job 2: resume from step 10 -> $OUT/resumed"
"$PY" train.py hydra.run.dir="$OUT/resumed" train.steps=20 checkpoint.every_steps=10 \
  checkpoint.resume="$OUT/full/checkpoints/step_00000010" "$@" > "$OUT/resumed.log" 2>&1 \
  || { tail -n 20 "$OUT/resumed.log" >&2; echo "error: job 2 failed (log: $OUT/resumed.log)" >&2; exit 1; }

status=0
"$PY" scripts/compare_runs.py "$OUT/full" "$OUT/resumed" --from-step 11 --checkpoint-step 20 || status=$?
echo "the two runs are kept in $OUT (full/, resumed/ and their logs); remove them with: rm -r $OUT"
exit "$status"
