#!/usr/bin/env bash
# One device call on a GPU machine without network (../shared/notes/GPU.md): install the wheels the
# machine lacks from .whl/ (fetched beforehand, carried with the call), run the tests that have CUDA
# paths, then `gpu_suite.py --quick`. Everything goes to $OUT (or ./gpu-check if unset), written as it
# comes, so a run cut by its time limit keeps what it printed.
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, lightning, open_clip; print('torch', torch.__version__, 'lightning', lightning.__version__, 'open_clip', open_clip.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
# the files with CUDA-only tests (and the CPU tests beside them, which must pass there too)
timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" \
  tests/training/test_gradient_clipping.py tests/training/test_compile.py tests/evaluation/test_evaluate_cache.py tests/data/test_cache_batches.py \
  tests/checkpoints/test_segment_end_copies.py tests/merging/test_merge_device.py tests/evaluation/test_evaluate_workers.py 2>&1 | tail -40 | tee "$OUT/tests.txt"
timeout 330 python3 benchmarks/gpu_suite.py --quick --json "$OUT/gpu_suite.json" 2>&1 | tee "$OUT/gpu_suite.txt"
