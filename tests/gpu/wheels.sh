#!/usr/bin/env bash
# Build the wheel folder that tests/gpu/check.sh installs from, on a machine with a package index.
#
#   tests/gpu/wheels.sh [OUT] [--python X.Y] [--complete]
#
# Default (for a GPU machine with a CUDA torch and no package index; Python 3.12 by default):
# only what such an image lacks: megatron-core, Hydra, OmegaConf, Hydra's parser runtime
# (antlr4-python3-runtime 4.9.3 has no wheel on the index: it is built here from its source
# archive), the build backend (setuptools, wheel), packaging, and the test tools (pytest,
# pytest-timeout, hypothesis and their dependencies). About 6 MiB,
# well under what a machine without an index can be handed. Transformer Engine is not included:
# its wheels are hundreds of MiB, so the check runs megatron's local layer spec.
#
# --complete: rlbatch's wheel and every dependency it needs to run, for this machine's Python,
# torch included (the CPU build, torch==2.13.0), so that a fresh virtual environment installs
# with --no-index. The tests build it and install from it offline with check.sh --install-only.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="$REPO/.gpu-wheels"
PYVER="3.12"
COMPLETE=0
while (($#)); do
  case "$1" in
    --python) PYVER="$2"; shift 2 ;;
    --complete) COMPLETE=1; shift ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) OUT="$1"; shift ;;
  esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY=python3
HOST_PYVER="$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
ABI="cp${PYVER/./}"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
TARGET=(--python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none
        "${PLATFORMS[@]}")

# the pins rlbatch's pyproject states (one version of each: two would stop the install there)
PINS=(megatron-core==0.16.1 hydra-core==1.3.2 omegaconf==2.3.0 "packaging>=24.2"
      "setuptools>=68" wheel)
# what check.sh runs the tests with (a GPU image may lack pytest; the unit tests need hypothesis
# and the ini's timeout pytest-timeout), with their dependencies: all pure Python, under 2 MiB
TEST_TOOLS=(pytest pluggy iniconfig pytest-timeout hypothesis attrs sortedcontainers)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Hydra's parser runtime: a source archive only; pure Python, so the wheel built here is any-Python
$PY -m pip wheel -q --no-deps --no-binary antlr4-python3-runtime -w "$OUT" \
  antlr4-python3-runtime==4.9.3

if ((COMPLETE)); then
  [[ "$PYVER" == "$HOST_PYVER" ]] || {
    echo "--complete builds for this machine's Python ($HOST_PYVER), not $PYVER" >&2; exit 2; }
  # rlbatch itself (pure Python) and the whole closure it runs with, the README's CPU torch
  rm -f "$OUT"/rlbatch-*.whl
  $PY -m pip wheel -q --no-deps -w "$OUT" "$REPO"
  $PY -m pip download -q -d "$OUT" --find-links "$OUT" torch==2.13.0 "$OUT"/rlbatch-*.whl \
    "${PINS[@]}" "${TEST_TOOLS[@]}"
else
  $PY -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$OUT" "${PINS[@]}" \
    "${TEST_TOOLS[@]}"
fi

total=$(du -sm "$OUT" | cut -f1)
echo "wheels for Python $PYVER in $OUT: $(ls "$OUT" | wc -l) files, ${total} MiB"
ls -1 "$OUT"
