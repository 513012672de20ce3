"""Delta-kernel backends: bit-exact against the GF(2^8) table, validation, registry, GPU fallback.

GPU tests are marked ``gpu`` and skip unless cupy imports and a CUDA device is usable.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ecrec.coding.kernels import KernelBackend, available_kernels, get_kernel, gf_mul, gf_mul_table, kernel_names
from ecrec.coding.kernels import gpu as gpu_mod
from ecrec.coding.kernels.gpu import cuda_kernels_dir

# every CPU kernel, unfiltered: if ISA-L (or numba) stops loading here its cases fail instead of vanishing
CPU_KERNELS = ["cpu", "isal", pytest.param("numba", marks=pytest.mark.slow), "numpy"]


def reference(parity, slots, coeffs, delta):
    """Plain-Python semantics: rows applied one after another (duplicates accumulate)."""
    out = parity.copy()
    mul = gf_mul_table()
    for r in range(len(slots)):
        out[slots[r]] ^= mul[coeffs[r]][delta[r]]
    return out


def random_batch(rng, rows, width, b):
    parity = rng.integers(0, 256, (rows, width), dtype=np.uint8)
    delta = rng.integers(0, 256, (b, width), dtype=np.uint8)
    slots = rng.integers(0, rows, b)  # duplicates likely
    coeffs = rng.integers(0, 256, b).astype(np.uint8)
    coeffs[:2] = (0, 1)
    return parity, slots, coeffs, delta


# ------------------------------------------------------------------ GF(2^8)
def test_gf_mul_known_values():
    assert gf_mul(2, 0x80) == 0x1D  # x * x^7 = x^8 = x^4 + x^3 + x^2 + 1 (mod 0x11d)
    assert gf_mul(0x53, 1) == 0x53 and gf_mul(0, 0x99) == 0
    table = gf_mul_table()
    assert table.shape == (256, 256) and table.dtype == np.uint8 and not table.flags.writeable
    for a in (0, 1, 2, 3, 0x1D, 0x8E, 0xFF):
        assert [gf_mul(a, b) for b in range(256)] == table[a].tolist()
    assert np.array_equal(table, table.T)
    # every non-zero element has an inverse: each row of a non-zero a is a permutation
    assert all(len(set(table[a].tolist())) == 256 for a in range(1, 256))
    with pytest.raises(ValueError, match="bytes"):
        gf_mul(256, 1)


# ------------------------------------------------------------------ CPU kernels
@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("width", [1, 3, 4, 7, 63, 64, 65, 1000, 4099])
def test_cpu_kernel_bit_exact(name, width):
    rng = np.random.default_rng(width)
    kernel = get_kernel(name)
    parity, slots, coeffs, delta = random_batch(rng, 9, width, 23)
    expect = reference(parity, slots, coeffs, delta)
    kernel.apply_delta_batch(parity, slots, coeffs, delta)
    assert np.array_equal(parity, expect)


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_cpu_kernel_layouts(name):
    """Unaligned parity views, strided rows, a broadcast delta and int32 slots all work."""
    rng = np.random.default_rng(7)
    kernel = get_kernel(name)
    parity, slots, coeffs, delta = random_batch(rng, 6, 130, 11)
    expect = reference(parity, slots, coeffs, delta)
    backing = np.zeros((6, 135), dtype=np.uint8)
    backing[:, 3:133] = parity
    view = backing[:, 3:133]  # rows not 4-byte aligned, row stride 135
    kernel.apply_delta_batch(view, slots.astype(np.int32), coeffs, delta)
    assert np.array_equal(view, expect)
    assert not backing[:, :3].any() and not backing[:, 133:].any()  # neighbours untouched

    one = delta[0]
    bcast = np.broadcast_to(one, (4, 130))
    par2 = parity.copy()
    kernel.apply_delta_batch(par2, [0, 2, 2, 5], coeffs[:4], bcast)
    assert np.array_equal(par2, reference(parity, [0, 2, 2, 5], coeffs[:4], np.stack([one] * 4)))


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_cpu_kernel_duplicates_and_cancellation(name):
    kernel = get_kernel(name)
    rng = np.random.default_rng(3)
    parity = rng.integers(0, 256, (2, 64), dtype=np.uint8)
    before = parity.copy()
    d = rng.integers(0, 256, (1, 64), dtype=np.uint8)
    # the same delta twice on the same slot cancels (XOR), in one batch
    kernel.apply_delta_batch(parity, [1, 1], [0x35, 0x35], np.concatenate([d, d]))
    assert np.array_equal(parity, before)


@functools.lru_cache(maxsize=1)
def _checked_isal_loops():
    """The ISA-L loops as servers run them, compiled again with bounds checks (not cached): an index past a batch's
    end -- a prefetch one row too far -- raises ``IndexError`` here instead of reading whatever lies there."""
    from numba import njit

    from ecrec.coding.kernels import isal_loops

    checked = dict(nogil=True, boundscheck=True, cache=False)
    return njit(**checked)(isal_loops._loop), njit(**checked)(isal_loops._versioned)


@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16, 17, 300])
@pytest.mark.parametrize("width", [16, 100, 512, 2048])
def test_the_isal_loops_keep_their_contract_around_their_prefetch_distance(rows, width):
    """The ISA-L loops fetch the parity row ``PREFETCH_ROWS`` ahead: batches shorter, as long and longer than that,
    over rows wider and narrower than what is fetched (and not starting at a cache line), with repeated rows (later
    pushes later, as the contract has them), rows not built and versions already held, come out as
    ``KernelBackend.apply_versioned``'s contract says, row after row; and no loop reads past a batch's end (the same
    loops with bounds checks)."""
    from ecrec.coding.kernels import isal_loops
    from ecrec.coding.kernels.cpu import _load_isal

    rng = np.random.default_rng(rows * 10_000 + width)
    k, arena = 3, 40
    parity = rng.integers(0, 256, (arena, width), dtype=np.uint8)
    versions = rng.integers(0, 6, (arena, k)).astype(np.int64)
    built = rng.random(arena) > 0.2
    slots = rng.integers(0, arena, rows).astype(np.int64)  # repeats likely
    positions = rng.integers(0, k, rows).astype(np.int64)
    seqs = np.cumsum(rng.integers(1, 3, rows)).astype(np.int64)  # increasing; the first ones below some versions
    coeff_row = np.array([1, 0x8E, 0], dtype=np.uint8)  # a plain XOR, a multiply, and a zero coefficient
    delta = rng.integers(0, 256, (rows, width), dtype=np.uint8)
    expect, expect_versions, applied = parity.copy(), versions.copy(), 0
    mul = gf_mul_table()
    for r in range(rows):  # the contract, row after row
        s, p = slots[r], positions[r]
        if built[s] and seqs[r] > expect_versions[s, p]:
            expect_versions[s, p] = seqs[r]
            expect[s] ^= mul[coeff_row[p]][delta[r]]
            applied += 1
    generic_parity, generic_versions = parity.copy(), versions.copy()
    assert KernelBackend.apply_versioned(get_kernel("numpy"), generic_parity, slots, positions, coeff_row, delta,
                                         generic_versions, built, seqs) == applied  # the generic path agrees
    assert np.array_equal(generic_parity, expect) and np.array_equal(generic_versions, expect_versions)
    checked_parity, checked_versions = parity.copy(), versions.copy()
    isal = get_kernel("isal")
    assert isal.apply_versioned(parity, slots, positions, coeff_row, delta, versions, built, seqs) == applied
    assert np.array_equal(parity, expect) and np.array_equal(versions, expect_versions)

    loop, versioned = _checked_isal_loops()
    lib = _load_isal()
    parity2, versions2 = checked_parity, checked_versions
    args = (*lib._entry, parity2.ctypes.data, parity2.strides[0], delta.ctypes.data, delta.strides[0])
    assert versioned(*args, slots, positions, coeff_row, versions2.reshape(-1), built, seqs, k,
                     lib.tables.ctypes.data, width, 64) == applied
    assert np.array_equal(parity2, expect) and np.array_equal(versions2, expect_versions)
    plain = rng.integers(0, 256, (arena, width), dtype=np.uint8)
    plain_expect = reference(plain, slots, coeff_row[positions], delta)
    loop(*lib._entry, plain.ctypes.data, plain.strides[0], delta.ctypes.data, delta.strides[0], slots,
         coeff_row[positions], lib.tables.ctypes.data, width, 64)
    assert np.array_equal(plain, plain_expect)
    assert isal_loops.PREFETCH_ROWS == 8  # the distance these batch sizes are chosen around


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_cpu_kernel_empty_batches(name):
    kernel = get_kernel(name)
    parity = np.ones((3, 5), dtype=np.uint8)
    kernel.apply_delta_batch(parity, np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros((0, 5), np.uint8))
    kernel.apply_delta_batch(parity[:, :0], [0], [3], np.zeros((1, 0), np.uint8))
    assert (parity == 1).all()


def test_kernel_validation_changes_nothing():
    kernel = get_kernel("cpu")
    rng = np.random.default_rng(1)
    parity = rng.integers(0, 256, (4, 16), dtype=np.uint8)
    before = parity.copy()
    good = dict(slots=[0, 3], coeffs=[1, 2], delta=np.ones((2, 16), np.uint8))
    bad_cases = [
        (TypeError, "uint8", dict(parity=parity.astype(np.int16))),
        (TypeError, "uint8", dict(delta=np.ones((2, 16), np.int32))),
        (TypeError, "numpy array", dict(delta=[[1] * 16] * 2)),
        (ValueError, "2-D", dict(parity=parity[0])),
        (ValueError, "slot 4 out of range", dict(slots=[0, 4])),
        (ValueError, "slot -1 out of range", dict(slots=[-1, 0])),
        (ValueError, "batch sizes differ", dict(slots=[0, 1, 2])),
        (ValueError, "batch sizes differ", dict(coeffs=[1])),
        (ValueError, "width", dict(delta=np.ones((2, 15), np.uint8))),
        (ValueError, "not a byte", dict(coeffs=[1, 256])),
        (TypeError, "integers", dict(slots=[0.0, 1.0])),
        (ValueError, "contiguous", dict(delta=np.ones((2, 32), np.uint8)[:, ::2])),
    ]
    for exc, match, override in bad_cases:
        args = dict(parity=parity, **good)
        args.update(override)
        with pytest.raises(exc, match=match):
            kernel.apply_delta_batch(args["parity"], args["slots"], args["coeffs"], args["delta"])
        assert np.array_equal(parity, before), f"rejected call {override} mutated parity"
    ro = parity.copy()
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        kernel.apply_delta_batch(ro, **good)


# ------------------------------------------------------------------ registry
def test_cpu_kernel_is_isal_from_the_pyeclib_wheel():
    """The CPU kernel ``ecrec-bench codec`` measures is ISA-L's ``gf_vect_mad`` (shipped inside pyeclib's wheel): ``cpu`` must pick it."""
    kernel = get_kernel("cpu")
    assert kernel.description.startswith("cpu: isal (gf_vect_mad, libisal"), kernel.description
    assert {"cpu", "isal", "numpy"} <= set(available_kernels())


def test_registry_names_and_errors():
    assert set(kernel_names()) >= {"auto", "cpu", "gpu", "numba", "numpy", "isal"}
    cpu = get_kernel("cpu")
    assert isinstance(cpu, KernelBackend) and cpu.name == "cpu" and cpu.device == "cpu"
    assert "cpu" in available_kernels() and "numpy" in available_kernels()
    with pytest.raises(ValueError, match="unknown kernel 'tpu'"):
        get_kernel("tpu")
    with pytest.raises(TypeError):
        get_kernel(3)


# ------------------------------------------------------------------ CUDA source / fallback
@pytest.mark.slow
def test_cuda_sources_compile_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    sources = sorted(cuda_kernels_dir().glob("*.cu"))
    assert sources, f"no .cu files in {cuda_kernels_dir()}"
    for src in sources:
        out = tmp_path / (src.stem + ".ptx")
        proc = subprocess.run(
            [nvcc, "-ptx", "-arch=compute_90", str(src), "-o", str(out)], capture_output=True, text=True
        )
        assert proc.returncode == 0, f"nvcc failed on {src.name}:\n{proc.stderr}"
        assert gpu_mod.FUNCTION_NAME in out.read_text()


def _cupy_importable() -> bool:
    try:
        import cupy  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


def _kernel_log_records(caplog):
    return [r for r in caplog.records if r.name.startswith("ecrec.kernels") and r.levelno >= logging.INFO]


@pytest.mark.skipif(not _cupy_importable(), reason="cupy is not importable")
def test_auto_falls_back_with_real_cupy_and_no_device(caplog):
    if gpu_mod.probe()[0]:
        assert get_kernel("auto").name == "gpu"  # a usable GPU: auto takes it
        return
    caplog.set_level(logging.INFO, logger="ecrec.kernels")
    kernel = get_kernel("auto")
    assert kernel.name == "cpu"
    records = _kernel_log_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "cupy imports but" in records[0].getMessage()
    with pytest.raises(RuntimeError, match="kernel 'gpu' is not available"):
        get_kernel("gpu")


def test_auto_falls_back_when_cupy_import_fails(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    caplog.set_level(logging.INFO, logger="ecrec.kernels")
    ok, why = gpu_mod.probe()
    assert not ok and "cupy does not import" in why
    kernel = get_kernel("auto")
    assert kernel.name == "cpu"
    records = _kernel_log_records(caplog)
    assert len(records) == 1 and "cupy does not import" in records[0].getMessage()
    with pytest.raises(RuntimeError, match="kernel 'gpu' is not available: cupy does not import"):
        get_kernel("gpu")
    assert "gpu" not in available_kernels()


# ------------------------------------------------------------------ GPU
gpu = pytest.mark.skipif(not gpu_mod.probe()[0], reason="needs cupy and a usable CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("width", [1, 3, 4, 5, 64, 1000, 4099])
def test_gpu_kernel_matches_cpu(width):
    import cupy as cp

    rng = np.random.default_rng(width)
    parity, slots, coeffs, delta = random_batch(rng, 17, width, 300)
    expect = parity.copy()
    get_kernel("cpu").apply_delta_batch(expect, slots, coeffs, delta)
    kernel = get_kernel("gpu")
    assert kernel.name == "gpu"
    got = cp.asarray(parity)
    kernel.apply_delta_batch(got, slots, coeffs, cp.asarray(delta))  # numpy slots/coeffs welcome
    assert np.array_equal(cp.asnumpy(got), expect)
    got = cp.asarray(parity)
    kernel.apply_delta_batch(got, cp.asarray(slots), cp.asarray(coeffs), cp.asarray(delta))
    assert np.array_equal(cp.asnumpy(got), expect)


@pytest.mark.gpu
@gpu
def test_gpu_kernel_layouts_and_grid_limits():
    import cupy as cp

    kernel = get_kernel("gpu")
    cpu = get_kernel("cpu")
    rng = np.random.default_rng(5)
    # unaligned parity view, broadcast delta
    parity, slots, coeffs, delta = random_batch(rng, 8, 301, 40)
    expect = parity.copy()
    cpu.apply_delta_batch(expect, slots, coeffs, delta)
    backing = cp.zeros((8, 305), dtype=cp.uint8)
    backing[:, 1:302] = cp.asarray(parity)
    view = backing[:, 1:302]
    kernel.apply_delta_batch(view, slots, coeffs, cp.asarray(delta))
    assert np.array_equal(cp.asnumpy(view), expect)
    assert not cp.asnumpy(backing[:, :1]).any() and not cp.asnumpy(backing[:, 302:]).any()
    one = cp.asarray(delta[0])
    got = cp.asarray(parity)
    kernel.apply_delta_batch(got, slots[:5], coeffs[:5], cp.broadcast_to(one, (5, 301)))
    exp2 = parity.copy()
    cpu.apply_delta_batch(exp2, slots[:5], coeffs[:5], np.broadcast_to(delta[0], (5, 301)))
    assert np.array_equal(cp.asnumpy(got), exp2)
    # more batch rows than gridDim.y allows, and a row wider than one grid-stride pass
    parity, slots, coeffs, delta = random_batch(rng, 1000, 8, 70000)
    expect = parity.copy()
    cpu.apply_delta_batch(expect, slots, coeffs, delta)
    got = cp.asarray(parity)
    kernel.apply_delta_batch(got, slots, coeffs, cp.asarray(delta))
    assert np.array_equal(cp.asnumpy(got), expect)
    width = 9 * 1024 * 1024 + 3
    parity = rng.integers(0, 256, (1, width), dtype=np.uint8)
    delta = rng.integers(0, 256, (2, width), dtype=np.uint8)
    expect = parity.copy()
    cpu.apply_delta_batch(expect, [0, 0], [7, 0x8E], delta)
    got = cp.asarray(parity)
    kernel.apply_delta_batch(got, [0, 0], [7, 0x8E], cp.asarray(delta))
    assert np.array_equal(cp.asnumpy(got), expect)


@pytest.mark.gpu
@gpu
def test_gpu_kernel_validation_changes_nothing():
    import cupy as cp

    kernel = get_kernel("gpu")
    parity = cp.zeros((4, 16), dtype=cp.uint8)
    with pytest.raises(TypeError, match="cupy array"):
        kernel.apply_delta_batch(np.zeros((4, 16), np.uint8), [0], [1], cp.ones((1, 16), cp.uint8))
    with pytest.raises(ValueError, match="out of range"):
        kernel.apply_delta_batch(parity, [4], [1], cp.ones((1, 16), cp.uint8))
    assert not cp.asnumpy(parity).any()


@pytest.mark.slow
def test_cpu_kernel_falls_back_to_numba_without_isal(tmp_path):
    """With no usable libisal the cpu kernel runs numba (checked in a fresh process)."""
    import os

    env = dict(os.environ, ECREC_ISAL_LIBRARY=str(tmp_path / "missing-libisal.so"))
    code = (
        "import numpy as np; from ecrec.coding.kernels import get_kernel, gf_mul_table\n"
        "k = get_kernel('cpu'); print(k.description)\n"
        "p = np.zeros((2, 70), np.uint8); d = np.arange(140, dtype=np.uint8).reshape(2, 70)\n"
        "k.apply_delta_batch(p, [1, 1], [3, 5], d)\n"
        "m = gf_mul_table(); assert (p[1] == (m[3][d[0]] ^ m[5][d[1]])).all() and not p[0].any()\n"
        "from ecrec.coding.kernels import available_kernels; assert 'isal' not in available_kernels()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu: numba"


@pytest.mark.slow
def test_the_isal_loops_do_without_prefetching_where_llvm_will_not_take_it(tmp_path):
    """Where this numba's LLVM cannot emit ``llvm.prefetch`` (simulated: declaring it raises), the ISA-L loops compile
    without it, say so, and give the same results (a fresh process, with an empty numba cache: nothing compiled
    with the hint is loaded instead)."""
    import os

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    code = (
        "from llvmlite import ir\n"
        "declare = ir.Module.declare_intrinsic\n"
        "def refuse(self, name, *args, **kwargs):\n"
        "    if name == 'llvm.prefetch':\n"
        "        raise NotImplementedError('no llvm.prefetch here')\n"
        "    return declare(self, name, *args, **kwargs)\n"
        "ir.Module.declare_intrinsic = refuse\n"
        "import numpy as np\n"
        "from ecrec.coding.kernels import get_kernel, gf_mul_table, isal_loops\n"
        "assert not isal_loops.PREFETCHES\n"
        "k = get_kernel('cpu'); print(k.description)\n"
        "rng = np.random.default_rng(1); p = rng.integers(0, 256, (5, 64), dtype=np.uint8); e = p.copy()\n"
        "d = rng.integers(0, 256, (20, 64), dtype=np.uint8); s = rng.integers(0, 5, 20); c = rng.integers(0, 256, 20)\n"
        "k.apply_delta_batch(p, s, c.astype(np.uint8), d)\n"
        "m = gf_mul_table()\n"
        "for r in range(20): e[s[r]] ^= m[c[r]][d[r]]\n"
        "assert (p == e).all()\n"
        "from ecrec.coding.kernels import prefetch\n"
        "assert not prefetch.ENABLED\n"
        "from ecrec.strategies.erasure.parity_store import place_rows\n"  # the other loops with the hint run too
        "one = np.ones(1, np.int64)\n"
        "assert place_rows(np.zeros(1, np.int64), one, np.zeros(1, np.int64), one, np.zeros(1, np.int64), 2,\n"
        "                  np.zeros(1, np.int64))[1] == 1\n"
        "from ecrec.tables import optim_kernel\n"
        "optim_kernel.update_rows(np.ones((4, 2), np.float32), np.arange(2), np.ones((2, 1), np.float32), 'adagrad',\n"
        "                         1, 0.1, 1e-8, False, True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("cpu: isal (gf_vect_mad") and "prefetched" not in proc.stdout
    # the probe said it, at warning level (the speed lost is said), before any loop was compiled
    assert "this numba's LLVM does not take llvm.prefetch" in proc.stderr
    assert "the ISA-L loops compile without prefetching" not in proc.stderr
    # and nothing built without the hint was cached, to be loaded where the hint compiles
    cached = [p.name for p in (tmp_path / "numba-cache").rglob("*.nb[ic]")]
    loops = ("isal_loops", "place_kernel", "optim_kernel")
    assert not [name for name in cached if any(loop in name for loop in loops)], cached


@pytest.mark.slow
@pytest.mark.skipif(gpu_mod.probe()[0], reason="a GPU works here: scripts/gpu_check.sh runs the GPU tests")
def test_gpu_check_without_a_gpu_fails_and_says_why(tmp_path):
    """The prepared GPU check must not pass on a machine where nothing on the GPU path ran."""
    import os
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"no GPU: {gpu_mod.probe()[1]} -- nothing on the GPU path was checked" in proc.stderr
    assert "== pytest" not in proc.stdout and not (tmp_path / "pytest-gpu.xml").exists()
