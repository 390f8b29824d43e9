#!/usr/bin/env bash
# The whole GPU check, one command, on a CUDA machine with no package index:
#
#   tests/gpu/check.sh OUT [--wheels DIR] [--install-only] [-k EXPR]
#
# 1. installs rlbatch (editable, from this checkout) and the dependencies the machine lacks from
#    the wheel folder that tests/gpu/wheels.sh built beside it (default .gpu-wheels/), with
#    --no-index, into the running python3's environment (its CUDA torch is kept);
# 2. runs the fast unit tests with the GPU hidden, on this machine's torch (the oldest torch
#    rlbatch claims is the GPU image's; this is where it is tested), beside step 3;
# 3. runs tests/gpu (parity of the Qwen2.5-0.5B shape in fp32 / bf16 against the CPU fp32
#    reference, packed THD micro-batches, whole GRPO steps in bf16 with tokens/s and peak memory,
#    LoRA in bf16, megatron_dynamic rollouts, the NCCL weight stream where there are 2 GPUs);
# 4. writes into OUT: env.txt, install.log, gpu_tests.log, junit_gpu.xml, figures.jsonl,
#    unit_tests.log, summary.txt (also printed). Exit status: non-zero when any step failed, and
#    when torch sees no CUDA device (the GPU tests would all be skipped).
# --install-only stops after step 1 (the tests use it on a CPU machine with a complete folder);
# -k EXPR selects tests/gpu tests as pytest's -k does (a rerun of what failed).
# Budget: about 8 minutes on one H100. Each stage has its own time limit.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:?usage: tests/gpu/check.sh OUT [--wheels DIR] [--install-only] [-k EXPR]}"
shift
WHEELS="$REPO/.gpu-wheels"
INSTALL_ONLY=0
SELECT=()
while (($#)); do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    -k) SELECT=(-k "$2"); shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
status=0
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
outcome() { grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s" "$1" | tail -1; }
: >"$OUT/summary.txt"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
} >"$OUT/env.txt" 2>&1
summary "machine: $(tr '\n' ' ' <"$OUT/env.txt")"

# ---- 1. install, offline -------------------------------------------------------------------
cd "$REPO"
if [[ ! -d "$WHEELS" ]]; then
  summary "install: FAILED: no wheel folder $WHEELS (build it with tests/gpu/wheels.sh)"
  exit 1
fi
{
  $PY -m pip install --no-index --find-links "$WHEELS" "megatron-core==0.16.1" \
    "hydra-core==1.3.2" "omegaconf==2.3.0" "packaging>=24.2" pytest pytest-timeout hypothesis &&
  $PY -m pip install --no-index --find-links "$WHEELS" -e . &&
  $PY -c 'import megatron.core, hydra, rlbatch.engine.model as m; print("megatron-core",
megatron.core.__version__, "transformer_engine", m.have_transformer_engine())'
} >"$OUT/install.log" 2>&1
if (($? != 0)); then
  summary "install: FAILED (install.log):"; tail -20 "$OUT/install.log"; exit 1
fi
summary "install: ok ($(tail -1 "$OUT/install.log"))"
((INSTALL_ONLY)) && exit 0

# no CUDA device (a driver older than the torch build, devices hidden): every test of tests/gpu
# would be skipped and pytest would exit 0, a check that passes having checked nothing
if [[ "${RLBATCH_GPU_DRYRUN:-}" != 1 ]] &&
  ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  summary "tests/gpu: FAILED: torch sees no CUDA device (env.txt), so every GPU test would be" \
    "skipped; RLBATCH_GPU_DRYRUN=1 runs the dry-run shapes on the CPU instead"
  exit 1
fi

# ---- 2. the fast unit tests on this torch, GPU hidden (in the background, on spare cores) ----
# (deselected: the repository's own file check needs its git history; the README's commands
# include wandb's and math-verify's extras, which a GPU image does not have)
workers=$(( $(nproc) > 4 ? $(nproc) / 2 : 1 ))
xdist=()
$PY -c 'import xdist' >/dev/null 2>&1 && xdist=(-n "$workers")
CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 timeout 300 $PY -m pytest tests/unit -q -p no:cacheprovider "${xdist[@]}" \
  -m "not dist and not e2e and not slow and not optional_extra" \
  --deselect tests/unit/test_house.py \
  --deselect tests/unit/test_readme.py::test_common_commands_compose_and_validate \
  >"$OUT/unit_tests.log" 2>&1 &
unit_pid=$!

# ---- 3. tests/gpu ----------------------------------------------------------------------------
export RLBATCH_GPU_FIGURES="$OUT/figures.jsonl"
: >"$RLBATCH_GPU_FIGURES"
timeout 420 $PY -m pytest tests/gpu -m gpu -v -ra -p no:cacheprovider "${SELECT[@]}" \
  --junitxml "$OUT/junit_gpu.xml" >"$OUT/gpu_tests.log" 2>&1
rc=$?
((rc == 0)) || status=1
summary "tests/gpu: exit $rc ($(outcome "$OUT/gpu_tests.log"))"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"
if ! $PY -c 'import vllm' >/dev/null 2>&1; then
  summary "colocated vLLM: not checked: vllm is not installed here, and its wheel (hundreds of" \
    "MiB with its CUDA kernels) does not fit what a machine without a package index is handed"
fi
wait "$unit_pid"
rc=$?
((rc == 0)) || status=1
summary "unit tests on $($PY -c 'import torch; print("torch", torch.__version__)'), GPU hidden:" \
  "exit $rc ($(outcome "$OUT/unit_tests.log"))"
grep -E "^(FAILED|ERROR)" "$OUT/unit_tests.log" | head -20 | tee -a "$OUT/summary.txt"

# ---- 4. figures ------------------------------------------------------------------------------
summary "figures (figures.jsonl):"
cat "$RLBATCH_GPU_FIGURES" | tee -a "$OUT/summary.txt"
exit $status
