#!/usr/bin/env bash
# Installs the torchrec extra into a virtual environment that already has ecrec (and torch==2.13.0):
# the extra's own dependencies through pip, then torchrec 1.8.0 itself with --no-deps, because its
# declared dependency "fbgemm-gpu" is the CUDA build (the CPU build is the package "fbgemm-gpu-cpu",
# which the extra installs).  Then checks that torchrec imports.  Usage: scripts/install_torchrec.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
"$python" -m pip install --quiet --disable-pip-version-check -e '.[torchrec]'
"$python" -m pip install --quiet --disable-pip-version-check --no-deps torchrec==1.8.0
"$python" -c 'import torchrec, fbgemm_gpu; print("torchrec", torchrec.__version__, "imports")'
