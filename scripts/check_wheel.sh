#!/usr/bin/env bash
# Builds the wheel, installs it (not editable) in a fresh virtual environment and checks that an ordinary
# install works: the CUDA kernel source is found as package data, the strategies resolve by name, and the
# command lines start.  Used by CI; run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$work/dist" . >/dev/null
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0 "$work"/dist/ecrec-*.whl
cd "$work"  # away from the source tree, so only the installed package can be imported
"$work/venv/bin/python" - <<'PY'
import ecrec, pathlib
from ecrec.kernels.gpu import cuda_kernels_dir
from ecrec.strategies import available, get_spec
src = cuda_kernels_dir()
assert "site-packages" in str(pathlib.Path(ecrec.__file__)), ecrec.__file__
assert (src / "gf256_delta.cu").is_file(), f"kernel source not installed under {src}"
assert set(available()) >= {"none", "ecrec", "full", "cpr", "cpr-mfu", "cpr-ssu"}, available()
for name in available():
    get_spec(name).load_class()
print(f"wheel install ok: kernel source at {src}, strategies {', '.join(available())}")
PY
"$work/venv/bin/ecrec-server" local --help >/dev/null
"$work/venv/bin/ecrec-bench" --help >/dev/null
echo "wheel install ok: ecrec-server local --help and ecrec-bench --help run"
