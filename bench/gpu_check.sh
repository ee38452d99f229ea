#!/usr/bin/env bash
# The one prepared script for a lent GPU machine: CUDA correctness (bf16) and the packing bench on a
# ~0.6B random-weight Qwen3, with tokens/s and MFU. Writes everything under ${OUT:-bench/out}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PY:-.venv/bin/python}
nvidia-smi | tee "$OUT/nvidia-smi.txt" || true
$PY -m pytest tests/gpu -q -rA 2>&1 | tee "$OUT/gpu-tests.txt"
MODEL=${MODEL:-/tmp/qwen3-0.6b-random}
[ -f "$MODEL/config.json" ] || $PY -c "
from pathlib import Path
from worker.models.devmodel import build_dev_model
build_dev_model(Path('$MODEL'), layers=28, hidden=1024, vocab=32000, seed=0, heads=16, kv_heads=8,
                intermediate=3072, max_positions=4096)"
$PY bench/packing.py --device cuda --dtype bfloat16 --regimes small,large --large-model "$MODEL" \
  --large-seq-len 1024 --rounds-small 30 --rounds-large 10 2>&1 | tee "$OUT/packing-cuda.txt"
