#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with one CUDA GPU and its own torch, no network.
# Prints "GPU VERIFIED", or "GPU CHECK FAILED: <steps>" and exits 1. Steps are independent and
# time-boxed, so one failure still reports the others:
#   a  capstone, 4 gloo ranks sharing the GPU (train.device=cuda): RESUME VERIFIED, and resume
#      10 -> 20 bitwise (scripts/resume.sh: same losses as hex, byte-identical step-20 shards)
#   b  capstone on 1 NCCL rank (dist.backend=nccl): exit 0, RESUME VERIFIED
#   c  GPU vs CPU losses over 20 steps (4 ranks each) within 1e-5 relative
#   d  throughput on one GPU, ours vs torch DDP + fused AdamW (benchmarks/gpu_throughput.py)
#   e  bf16 on the GPU: RESUME VERIFIED and bitwise resume 10 -> 20
#   f  ZeRO-3 with 2-way tensor parallelism on the GPU (4 ranks): RESUME VERIFIED
#   g  tests/test_gpu.py (pytest)
#   h  the gpt2_124m preset (GPT-2 small) on one GPU: tokens/s and MFU, ours vs torch DDP (gpu_throughput.py)
#   i  the step peak on the GPU (4 ranks, ZeRO-3, 2 steps, metrics.step_peak): every rank's measured
#      bytes against the planner's dry step (scripts/plan.py's), within 3%
# Python: $PYTHON or python3 (the machine's torch; nothing installs torch). hydra-core, omegaconf,
# antlr4 (and PyYAML, numpy, safetensors, pytest if missing) come from the wheels in .gpu_wheels/
# and go into a temporary directory on PYTHONPATH. Everything is logged to $OUT (if set, else a
# temporary directory): gpu_check.log, one directory per step, gpu_throughput.json and
# gpu_throughput_gpt2_124m.json.
# GPU_CHECK_STEPS="a c" runs only those steps (e.g. to rerun failed ones).
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (a dry run of the script; b, the GPU tests
# and h, a 124M-parameter model, cannot pass there).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--step" ]; then     # one step, run by the loop at the bottom under `timeout`
  step=$2 LOG=$3
  case $step in
    a) PYTHON=$PY RESUME_DIR=$LOG/a_resume bash scripts/resume.sh train.device=$DEV || exit 1
       grep -q "RESUME VERIFIED" "$LOG/a_resume/full.log" ;;
    b) $PY train.py dist.backend=nccl dist.world_size=1 hydra.run.dir="$LOG/b_nccl" > "$LOG/b_nccl.log" 2>&1
       rc=$?; tail -n 8 "$LOG/b_nccl.log"; [ $rc = 0 ] && grep -q "RESUME VERIFIED" "$LOG/b_nccl.log" ;;
    c) $PY train.py train.device=$DEV checkpoint.every_steps=0 hydra.run.dir="$LOG/c_gpu" > "$LOG/c_gpu.log" 2>&1 \
         || { tail -n 20 "$LOG/c_gpu.log"; exit 1; }
       $PY train.py train.device=cpu checkpoint.every_steps=0 hydra.run.dir="$LOG/c_cpu" > "$LOG/c_cpu.log" 2>&1 \
         || { tail -n 20 "$LOG/c_cpu.log"; exit 1; }
       $PY - "$LOG/c_gpu" "$LOG/c_cpu" <<'EOF'
import json, sys
def losses(run):
    with open(f"{run}/metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r and "step" in r}
gpu, cpu = losses(sys.argv[1]), losses(sys.argv[2])
assert sorted(gpu) == sorted(cpu) == list(range(1, 21)), (sorted(gpu), sorted(cpu))
worst = max(abs(gpu[s] - cpu[s]) / abs(cpu[s]) for s in cpu)
for s in sorted(cpu):
    print(f"step {s:2d}  gpu {gpu[s]:.9f}  cpu {cpu[s]:.9f}  rel {abs(gpu[s] - cpu[s]) / abs(cpu[s]):.2e}")
print(f"largest relative difference over 20 steps: {worst:.3e} (limit 1e-5)")
sys.exit(0 if worst <= 1e-5 else 1)
EOF
       ;;
    d) $PY benchmarks/gpu_throughput.py --device "$DEV" --json "$LOG/gpu_throughput.json" ;;
    e) PYTHON=$PY RESUME_DIR=$LOG/e_bf16 bash scripts/resume.sh train.device=$DEV train.dtype=bf16 || exit 1
       grep -q "RESUME VERIFIED" "$LOG/e_bf16/full.log" ;;
    f) $PY train.py train.device=$DEV zero=stage3 dist.tp=2 hydra.run.dir="$LOG/f_zero3_tp2" > "$LOG/f_zero3_tp2.log" 2>&1
       rc=$?; tail -n 4 "$LOG/f_zero3_tp2.log"; [ $rc = 0 ] && grep -q "RESUME VERIFIED" "$LOG/f_zero3_tp2.log" ;;
    g) $PY -c "import pytest" 2>/dev/null || { echo "pytest is not installed"; exit 1; }
       $PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py 2>&1 | tee "$LOG/g_pytest.log"
       grep -q " passed" "$LOG/g_pytest.log" && ! grep -qE "skipped|failed|error" "$LOG/g_pytest.log" ;;
    h) $PY benchmarks/gpu_throughput.py --model gpt2_124m --batch 8 --steps 10 --device "$DEV" \
         --json "$LOG/gpu_throughput_gpt2_124m.json" ;;
    i) $PY train.py train.device=$DEV zero=stage3 train.steps=2 metrics.step_peak=true checkpoint.every_steps=0 \
         checkpoint.verify_resume=false hydra.run.dir="$LOG/i_step_peak" > "$LOG/i_step_peak.log" 2>&1 \
         || { tail -n 20 "$LOG/i_step_peak.log"; exit 1; }
       $PY - "$LOG/i_step_peak" <<'EOF'
import json, sys, yaml
from distlib.app.config.run import RunConfig
from distlib.app.plan.step_peak import rank_step_peaks
run = sys.argv[1]
with open(f"{run}/.hydra/config.yaml") as f:
    cfg = RunConfig.from_dict(yaml.safe_load(f))
with open(f"{run}/report.json") as f:
    measured = [row["measured"]["step_peak"] for row in json.load(f)["memory"]]
planned = rank_step_peaks(cfg)
worst = max(abs(m - p) / p for m, p in zip(measured, planned))
for rank, (m, p) in enumerate(zip(measured, planned)):
    print(f"rank {rank}  step peak measured {m}  planned {p}  off {m - p:+d} B")
print(f"largest relative difference: {worst:.2e} (limit 3e-2)")
sys.exit(0 if worst <= 0.03 else 1)
EOF
       ;;
  esac
  exit $?
fi

export PY=${PYTHON:-python3}
export DEV=${GPU_CHECK_DEVICE:-cuda}   # cpu: a dry run of this script on a machine without a GPU
LOG=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$LOG"

main() {
began=$(date +%s)
echo "gpu_check: logs in $LOG"
command -v nvidia-smi > /dev/null && nvidia-smi -L
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| NCCL', '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-',
      '| GPUs', torch.cuda.device_count())" || { echo "GPU CHECK FAILED: $PY cannot import torch"; return 1; }

# Dependencies from .gpu_wheels/ (pure-Python hydra-core, omegaconf, antlr4; the others only if
# missing), never from an index, never over torch: --no-deps, into a private directory.
DEPS=$(mktemp -d -t gpu_deps.XXXXXX)
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime", "yaml": "PyYAML",
        "numpy": "numpy", "safetensors": "safetensors", "packaging": "packaging", "pytest": "pytest",
        "pluggy": "pluggy", "iniconfig": "iniconfig", "pygments": "pygments"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "installing from .gpu_wheels/ into $DEPS: $missing"
  if ! "$PY" -m pip install --quiet --no-index --no-deps --find-links "$PWD/.gpu_wheels" --target "$DEPS" $missing; then
    echo "pip failed or is missing: unpacking the wheels instead"
    "$PY" - "$DEPS" $missing <<'EOF'
import glob, re, sys, zipfile
target, names = sys.argv[1], sys.argv[2:]
for name in names:
    key = re.sub(r"[-_.]+", "_", name).lower()
    wheels = [w for w in glob.glob(".gpu_wheels/*.whl") if re.sub(r"[-_.]+", "_", w.split("/")[-1]).lower().startswith(key + "_")]
    if not wheels:
        sys.exit(f"no wheel for {name} in .gpu_wheels/")
    zipfile.ZipFile(wheels[0]).extractall(target)
EOF
  fi
fi
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"

# step:seconds -- a 4-rank capstone here takes ~10-20 s (CUDA start-up per rank included)
results=()
for spec in a:90 b:60 c:90 d:90 e:90 f:60 g:90 h:180 i:90; do
  step=${spec%%:*} limit=${spec##*:}
  [[ " ${GPU_CHECK_STEPS:-a b c d e f g h i} " == *" $step "* ]] || continue
  echo
  echo "=== step $step (limit ${limit}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash "$0" --step "$step" "$LOG"
  rc=$?
  took=$(( $(date +%s) - t0 ))
  if [ $rc = 0 ]; then
    results+=("PASS $step (${took}s)")
  else
    [ $rc = 124 ] && why="timed out after ${limit}s" || why="exit $rc"
    results+=("FAIL $step ($why)")
  fi
  echo "=== step $step: ${results[-1]}"
done

echo
echo "=== summary ($(( $(date +%s) - began ))s)"
printf '%s\n' "${results[@]}"
failed=$(printf '%s\n' "${results[@]}" | awk '$1 == "FAIL" {print $2}' | tr '\n' ' ')
if [ -z "$failed" ]; then
  echo "GPU VERIFIED"
else
  echo "GPU CHECK FAILED: steps ${failed% }"
  return 1
fi
}

main 2>&1 | tee "$LOG/gpu_check.log"
exit "${PIPESTATUS[0]}"
