"""Delta-kernel backends, chosen by name (like pyeclib's ``ec_type``).

A kernel applies a batch of parity row deltas in place (see
:class:`ecrec.coding.kernels.base.KernelBackend`); :class:`ecrec.coding.codec.Codec` computes the
per-row coefficients and calls it.  Names:

- ``auto`` -- ``gpu`` when cupy imports, a CUDA device exists and the kernel compiles;
  otherwise ``cpu``, saying why in one log line (logger ``ecrec.kernels``), never failing;
- ``cpu`` -- the fastest CPU implementation that works here (ISA-L, else numba);
- ``gpu`` -- the CUDA kernel on cupy arrays; raises ``RuntimeError`` when unusable;
- ``isal``, ``numba``, ``numpy`` -- one CPU implementation each (benchmarks, tests).
"""

from __future__ import annotations

import importlib
import logging

from ecrec.coding.kernels.base import KernelBackend, gf_mul, gf_mul_table, is_device_array

log = logging.getLogger("ecrec.kernels")

# name -> "module:class"; imported only when asked for
_BACKENDS = {
    "cpu": "ecrec.coding.kernels.cpu:CpuKernel",
    "gpu": "ecrec.coding.kernels.gpu:GpuKernel",
    "isal": "ecrec.coding.kernels.cpu:IsalKernel",
    "numba": "ecrec.coding.kernels.cpu:NumbaKernel",
    "numpy": "ecrec.coding.kernels.cpu:NumpyKernel",
}

__all__ = [
    "KernelBackend",
    "available_kernels",
    "get_kernel",
    "gf_mul",
    "gf_mul_table",
    "is_device_array",
    "kernel_class",
    "kernel_names",
]


def kernel_names() -> list[str]:
    """Every name :func:`get_kernel` accepts."""
    return ["auto", *_BACKENDS]


def kernel_class(name: str) -> type[KernelBackend]:
    """The backend class registered under ``name`` (not ``auto``)."""
    if not isinstance(name, str):
        raise TypeError(f"kernel name must be a string, got {type(name).__name__}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel {name!r}; choose one of {', '.join(kernel_names())}")
    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def available_kernels() -> list[str]:
    """The registered backends usable in this process (probes the GPU: may compile once)."""
    return [name for name in _BACKENDS if kernel_class(name).available()]


def get_kernel(name: str = "auto") -> KernelBackend:
    """A ready backend by name; ``auto`` falls back from gpu to cpu with one log line."""
    if name == "auto":
        from ecrec.coding.kernels import gpu

        ok, why = gpu.probe()
        if ok:
            return gpu.GpuKernel()
        kernel = kernel_class("cpu")()
        log.info("GPU kernel not used: %s; using %s", why, kernel.description)
        return kernel
    return kernel_class(name)()
