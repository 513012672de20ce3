#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU.  It passes only when the GPU path proved itself:
#
#   1. the CUDA sources compile (nvcc -ptx -arch=compute_90, when nvcc is there);
#   2. the GPU kernel is usable (cupy imports, a device exists, the kernel compiles and passes its self-test);
#      otherwise it stops here, non-zero, with "no GPU: <why>";
#   3. every test marked `gpu` runs and passes, and none is skipped (a skip fails the check): the kernel
#      against the CPU kernel, cupy arrays through the codec, and a cluster started with --device cuda
#      (parity rows in GPU memory) trained through a server failure and compared bit for bit with the
#      failure-free run of the CPU path (tests/test_device.py);
#   4. the codec benchmark, its figures and the device's name.
#
#   scripts/gpu_check.sh            # from anywhere; runs in the repository root
#
# Writes into $OUT when it is set (else /tmp/ecrec-gpu-check): nvidia-smi.txt, nvcc.txt, probe.txt,
# pytest.txt, pytest-gpu.xml, codec_bench.txt and codec_bench.json.  Exit status: 0 all proved, 1 a step
# failed, 2 no usable GPU.
#
# Needs python3 with this package's dependencies and cupy (cupy-cuda12x or cupy-cuda13x).  A machine without
# pyeclib can take it as wheels: put them in ./.whl (e.g. `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl pyeclib==1.8.0`); they are installed into
# /tmp/site with --no-index.  Set PYTHON to choose the interpreter, BENCH_MIB for the benchmark size (default 64).
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
(nvidia-smi || echo "nvidia-smi failed or is missing") 2>&1 | tee "$OUT/nvidia-smi.txt"

echo "== nvcc -ptx -arch=compute_90"
: > "$OUT/nvcc.txt"
if command -v nvcc >/dev/null; then
  for src in cuda_kernels/*.cu; do
    ptx="$OUT/$(basename "$src" .cu).ptx"
    if nvcc -ptx -arch=compute_90 "$src" -o "$ptx" >>"$OUT/nvcc.txt" 2>&1 && grep -q gf256_delta_batch "$ptx"; then
      echo "compiled $src" | tee -a "$OUT/nvcc.txt"
    else
      echo "FAILED: nvcc on $src" | tee -a "$OUT/nvcc.txt"
      status=1
    fi
  done
else
  echo "nvcc not on PATH (the kernel is compiled at run time through NVRTC below)" | tee -a "$OUT/nvcc.txt"
fi

echo "== GPU probe"
probe=$("$PY" -c "from ecrec.kernels import gpu; ok, why = gpu.probe(); print(('yes ' if ok else 'no ') + why)" 2>&1)
echo "$probe" | tee "$OUT/probe.txt"
case "$probe" in
  "yes "*) device="${probe#yes }"; echo "GPU kernel usable on: $device" ;;
  *)
    echo "no GPU: ${probe#no } -- nothing on the GPU path was checked" | tee -a "$OUT/probe.txt" >&2
    exit 2 ;;
esac

echo "== pytest -m gpu (every GPU test must run: a skip fails this check)"
"$PY" -m pytest tests -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml" 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "FAILED: GPU tests (pytest exit $rc)"; status=1; }
"$PY" - "$OUT/pytest-gpu.xml" <<'EOF' || status=1
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
names = [case.get("name") for case in suite.iter("testcase") if case.find("skipped") is not None]
print(f"GPU tests: {tests} collected, {skipped} skipped, {failed} failed or errors")
if tests == 0 or skipped or failed:
    print("FAILED: every GPU test must run and pass here" + (f"; skipped: {', '.join(names)}" if names else ""))
    sys.exit(1)
EOF

echo "== codec benchmark on $device"
"$PY" -m ecrec.bench.cli codec --size-mib "${BENCH_MIB:-64}" --json "$OUT/codec_bench.json" 2>&1 \
  | tee "$OUT/codec_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED: codec benchmark"; status=1; }
grep -q "gpu (" "$OUT/codec_bench.txt" || { echo "FAILED: the benchmark did not measure the gpu kernel"; status=1; }

echo "== done (status $status; device: $device); results in $OUT"
exit $status
