"""GPU delta kernel: ``cuda_kernels/gf256_delta.cu`` compiled at run time through ``cupy.RawModule``.

Works on CuPy arrays already on the device (a parity server that holds its parity in
GPU memory): ``parity``/``delta`` must be cupy arrays; ``slots``/``coeffs`` may be
numpy or cupy.  Launches are asynchronous on cupy's current stream, like any cupy op.
One thread block per (word range, batch row), the coefficient's 256-byte
multiplication row in shared memory, and ``atomicXor`` on 32-bit words so duplicate
slots in one batch accumulate (see the ``.cu`` file).

The CUDA sources are read from ``ECREC_CUDA_KERNELS_DIR`` when set, else from the package
data ``ecrec.cuda_kernels`` (the repository's ``cuda_kernels/``, installed with the wheel).  Nothing here imports cupy at
module import time: :func:`probe` says whether cupy imports, a device exists and the
module compiles, and why not.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path

import numpy as np

from ecrec.coding.kernels.base import KernelBackend, gf_mul_table

CUDA_KERNELS_ENV = "ECREC_CUDA_KERNELS_DIR"
SOURCE_NAME = "gf256_delta.cu"
FUNCTION_NAME = "gf256_delta_batch"
_THREADS = 256
_MAX_GRID_X = 8192  # word ranges per row; larger rows are covered by the grid-stride loop
_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y; more batch rows use the grid-stride loop


def cuda_kernels_dir() -> Path:
    """Where the ``.cu`` sources are: ``$ECREC_CUDA_KERNELS_DIR``, else the installed package data
    ``ecrec.cuda_kernels`` (the repository's ``cuda_kernels/``, found through ``importlib.resources``)."""
    env = os.environ.get(CUDA_KERNELS_ENV)
    if env:
        return Path(env)
    return Path(str(importlib.resources.files("ecrec.cuda_kernels")))


class _Module:
    """The compiled kernel and the multiplication table on the current device."""

    def __init__(self):
        import cupy

        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without driver or device
            raise RuntimeError(f"no usable CUDA device ({_first_line(exc)})") from exc
        if count < 1:
            raise RuntimeError("no CUDA device")
        path = cuda_kernels_dir() / SOURCE_NAME
        if not path.is_file():
            raise RuntimeError(f"CUDA source {path} not found (set ${CUDA_KERNELS_ENV})")
        self.cupy = cupy
        try:
            self.module = cupy.RawModule(code=path.read_text())
            self.function = self.module.get_function(FUNCTION_NAME)  # compiles (NVRTC) and loads
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"compiling {path} failed ({_first_line(exc)})") from exc
        self.table = cupy.asarray(gf_mul_table())
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props.get("name", b"CUDA device")
        self.device = name.decode() if isinstance(name, bytes) else str(name)
        self._self_test()

    def launch(self, parity, slots, coeffs, delta) -> None:
        batch, width = delta.shape
        words = (width + 3) // 4
        grid = (min(max(1, -(-words // _THREADS)), _MAX_GRID_X), min(batch, _MAX_GRID_Y))
        args = (
            parity, np.int64(parity.strides[0]), delta, np.int64(delta.strides[0]),
            slots, coeffs, self.table, np.int64(batch), np.int64(width),
        )  # fmt: skip
        self.function(grid, (_THREADS,), args)

    def _self_test(self) -> None:
        cp = self.cupy
        rng = np.random.default_rng(0x11D)
        mul = gf_mul_table()
        for width in (1, 5, 64, 1027):
            parity = rng.integers(0, 256, (3, width), dtype=np.uint8)
            delta = rng.integers(0, 256, (4, width), dtype=np.uint8)
            slots = np.array([2, 0, 2, 1], dtype=np.int64)
            coeffs = np.array([3, 0, 0x8E, 1], dtype=np.uint8)
            expect = parity.copy()
            for r in range(4):
                expect[slots[r]] ^= mul[coeffs[r]][delta[r]]
            got = cp.asarray(parity)
            self.launch(got, cp.asarray(slots), cp.asarray(coeffs), cp.asarray(delta))
            if not np.array_equal(cp.asnumpy(got), expect):
                raise RuntimeError(f"{SOURCE_NAME} disagrees with the GF(2^8) tables (width {width})")


@functools.lru_cache(maxsize=1)
def _module() -> _Module:
    return _Module()  # lru_cache keeps successes only: a failure is retried (and re-reported) next time


def probe() -> tuple[bool, str]:
    """``(True, device name)`` when the GPU kernel is usable, else ``(False, why not)``; never raises."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA install
        return False, f"cupy does not import ({_first_line(exc)})"
    try:
        return True, _module().device
    except Exception as exc:  # noqa: BLE001
        why = str(exc) if type(exc) is RuntimeError else _first_line(exc)  # ours already say what failed
        return False, f"cupy imports but {why}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class GpuKernel(KernelBackend):
    """CUDA kernel on cupy arrays (atomicXor, so duplicate slots accumulate)."""

    name = "gpu"
    device = "gpu"

    @classmethod
    def available(cls) -> bool:
        return probe()[0]

    def __init__(self):
        ok, why = probe()
        if not ok:
            raise RuntimeError(f"kernel 'gpu' is not available: {why}")
        self._mod = _module()

    @property
    def description(self) -> str:
        return f"gpu ({self._mod.device}, {SOURCE_NAME})"

    def _xp(self):
        return self._mod.cupy

    def _check(self, parity, slots, coeffs, delta):
        cp = self._mod.cupy
        # numpy slots/coeffs are welcome: move them to the device before validating
        slots = cp.asarray(slots) if isinstance(slots, np.ndarray) else slots
        coeffs = cp.asarray(coeffs) if isinstance(coeffs, np.ndarray) else coeffs
        return super()._check(parity, slots, coeffs, delta)

    def _apply(self, parity, slots, coeffs, delta) -> None:
        self._mod.launch(parity, slots, coeffs, delta)
