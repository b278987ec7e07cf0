#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the engine's parity tests on CUDA (bf16): eager, compiled
# with decode steps as CUDA graphs, and compiled without them; then a short offline benchmark of
# all three. Takes a few minutes (compiling more).
# Usage: bash scripts/gpu_check.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-${OUT:-bench/results}}
mkdir -p "$OUT"
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch (is this the CPU build of torch?)"
print("CUDA:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
# Every CUDA parity case: eager, compiled (test_greedy_parity_compiled[cuda-bf16]) and the decode
# CUDA graphs on and off (test_compile.py). -rs names any case skipped, with the reason.
"$PY" -m pytest -q -rs -m cuda tests/test_parity.py tests/test_compile.py 2>&1 | tee "$OUT/gpu_parity.txt"
"$PY" -m bench.engine.offline --device cuda --dtype bfloat16 --systems engine \
    --num-requests 64 --json-out "$OUT/offline_cuda.json" 2>&1 | tee "$OUT/gpu_bench.txt"
"$PY" -m bench.engine.offline --device cuda --dtype bfloat16 --systems engine --compile \
    --num-requests 64 --json-out "$OUT/offline_cuda_compiled.json" 2>&1 | tee "$OUT/gpu_bench_compiled.txt"
"$PY" -m bench.engine.offline --device cuda --dtype bfloat16 --systems engine --compile --no-cuda-graphs \
    --num-requests 64 --json-out "$OUT/offline_cuda_compiled_nographs.json" 2>&1 | tee "$OUT/gpu_bench_nographs.txt"
# Tensor parallelism (issue 13): NCCL parity on 2 GPUs and TP=1 vs TP=2 step times.
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
    "$PY" -m pytest -q -m cuda tests/test_tp.py 2>&1 | tee "$OUT/gpu_tp_parity.txt"
    "$PY" -m bench.engine.tp --device cuda --dtype bfloat16 --tp 1,2 --layers 16 \
        --json-out "$OUT/tp_cuda.json" 2>&1 | tee "$OUT/gpu_tp_bench.txt"
else
    echo "found $GPUS GPU: the tensor-parallel parity tests (tests/test_tp.py -m cuda) and bench/engine/tp.py" \
         "need >= 2 GPUs (one per rank); skipped" | tee "$OUT/gpu_tp_parity.txt"
fi
