#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU: compiles the CUDA sources, runs the
# codec/kernel tests (GPU tests included: they skip nowhere else) and the codec benchmark.
#
#   scripts/gpu_check.sh            # from the repository root
#
# Writes into $OUT when it is set (else /tmp/ecrec-gpu-check): nvidia-smi.txt, nvcc.txt,
# pytest.txt, codec_bench.txt and codec_bench.json.  Exits non-zero when a step fails.
#
# Needs python3 with numpy, numba, pytest, grpcio, protobuf, cupy (cupy-cuda12x or
# cupy-cuda13x) and pyeclib.  A machine without pyeclib can take it as wheels: put them in
# ./.whl (e.g. `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 -d .whl pyeclib==1.8.0`); they are installed into
# /tmp/site with --no-index.  Set PYTHON to choose the interpreter, BENCH_MIB for the
# benchmark size (default 64).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/ecrec-gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
status=0

if ! "$PY" -c "import pyeclib" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

echo "== nvidia-smi"
(nvidia-smi || true) 2>&1 | tee "$OUT/nvidia-smi.txt"

echo "== nvcc -ptx"
if command -v nvcc >/dev/null; then
  for src in cuda_kernels/*.cu; do
    nvcc -ptx -arch=compute_90 "$src" -o "/tmp/$(basename "$src" .cu).ptx" 2>&1 | tee -a "$OUT/nvcc.txt" || status=1
  done
else
  echo "nvcc not on PATH" | tee "$OUT/nvcc.txt"
fi

echo "== GPU probe"
"$PY" -c "from ecrec.kernels import gpu; print(gpu.probe())" 2>&1 | tee "$OUT/probe.txt" || status=1

echo "== pytest (codec + kernels, GPU tests included)"
"$PY" -m pytest tests/test_kernels.py tests/test_codec.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" \
  || status=1

echo "== codec benchmark"
"$PY" -m ecrec.bench.cli codec --size-mib "${BENCH_MIB:-64}" --json "$OUT/codec_bench.json" 2>&1 \
  | tee "$OUT/codec_bench.txt" || status=1

echo "== done (status $status); results in $OUT"
exit $status
