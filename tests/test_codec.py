"""The erasure codec against pyeclib: encode, reconstruct, parity deltas, and bad input.

Everything is bit-exact: parity bytes must equal pyeclib's own fragment payloads, and
parity maintained through deltas must equal a fresh encode.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from pyeclib.ec_iface import ECDriver

from ecrec.coding.codec import SUPPORTED_BACKENDS, Codec, gf_mul

from ecrec.coding.kernels import gpu as gpu_mod

BACKENDS = list(SUPPORTED_BACKENDS)
KS, MS = [2, 4, 8], [1, 2, 3]
# every CPU kernel, unfiltered: if ISA-L (or numba) stops loading here its cases fail instead of vanishing
CPU_KERNELS = ["cpu", "isal", pytest.param("numba", marks=pytest.mark.slow), "numpy"]


@functools.lru_cache(maxsize=None)
def codec(k, m, backend="isa_l_rs_vand", chunk_bytes=None, kernel="cpu"):
    extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    return Codec(k, m, backend, kernel=kernel, **extra)


def pyeclib_parity(k, m, backend, data):
    frags = ECDriver(k=k, m=m, ec_type=backend).encode(data.tobytes())
    return np.stack([np.frombuffer(f, np.uint8, offset=80) for f in frags[k:]])


def lost_sets(k, m):
    return itertools.chain.from_iterable(itertools.combinations(range(k + m), r) for r in range(1, m + 1))


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,m", [(1, 1), (4, 2), (10, 4), (3, 3)])
def test_coefficients_are_pyeclibs(backend, k, m):
    c = codec(k, m, backend)
    assert (c.k, c.m, c.backend) == (k, m, backend)
    assert c.coefficients.shape == (m, k) and c.coefficients.dtype == np.uint8
    assert not c.coefficients.flags.writeable
    for i in range(k):  # the definition: a unit byte at position i gives c[:, i]
        unit = np.zeros((k, 1), dtype=np.uint8)
        unit[i] = 1
        assert np.array_equal(pyeclib_parity(k, m, backend, unit)[:, 0], c.coefficients[:, i])
    rng = np.random.default_rng(k * 10 + m)
    data = rng.integers(0, 256, (k, 9), dtype=np.uint8)
    parity = np.zeros((m, 9), dtype=np.uint8)
    for j in range(m):
        for i in range(k):
            parity[j] ^= gf_mul(c.coefficients[j, i], data[i])
    assert np.array_equal(parity, pyeclib_parity(k, m, backend, data))
    assert c.kernel.name == "cpu"


def test_default_kernel_is_auto_gpu_when_usable_else_cpu():
    c = Codec(2, 1)
    assert c.backend == "isa_l_rs_vand" and c.kernel.name == ("gpu" if gpu_mod.probe()[0] else "cpu")
    assert "Codec(k=2, m=1" in repr(c)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((0, 1), {}, ValueError, "k .* must be >= 1"),
        ((2, 0), {}, ValueError, "m .* must be >= 1"),
        ((-1, 2), {}, ValueError, "k .* must be >= 1"),
        ((30, 3), {"backend": "isa_l_rs_cauchy"}, ValueError, "k \\+ m must be <= 32"),
        ((2.0, 1), {}, TypeError, "k must be an int"),
        ((True, 1), {}, TypeError, "k must be an int"),
        ((4, 2), {"backend": "liberasurecode_rs_vand"}, ValueError, "16-bit words"),
        ((4, 2), {"backend": "jerasure_rs_vand"}, ValueError, "unsupported backend"),
        ((4, 2), {"backend": 7}, TypeError, "backend must be"),
        ((6, 5), {}, ValueError, "not MDS"),
        ((22, 4), {}, ValueError, "not MDS"),
        ((4, 2), {"kernel": "tpu"}, ValueError, "unknown kernel"),
        ((4, 2), {"kernel": 3}, TypeError, "kernel must be"),
        ((4, 2), {"chunk_bytes": 0}, ValueError, "chunk_bytes"),
    ],
)
def test_invalid_construction(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Codec(*args, **kwargs)


def test_cauchy_allows_what_vand_does_not():
    assert Codec(6, 5, "isa_l_rs_cauchy", kernel="cpu").m == 5
    assert Codec(21, 4, kernel="cpu").k == 21


# ------------------------------------------------------------------ encode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_encode_bit_exact_with_pyeclib(backend, k, m):
    rng = np.random.default_rng(k * 100 + m)
    # small chunks force both chunking paths: column ranges of one stripe, and groups of stripes
    for chunk_bytes in (None, 40 * k):
        c = codec(k, m, backend, chunk_bytes)
        for n in (1, 7, 333, 1001):
            data = rng.integers(0, 256, (k, n), dtype=np.uint8)
            parity = c.encode(data)
            assert parity.shape == (m, n) and parity.dtype == np.uint8
            assert np.array_equal(parity, pyeclib_parity(k, m, backend, data))
            stripes = rng.integers(0, 256, (5, k, n), dtype=np.uint8)
            many = c.encode_stripes(stripes)
            assert many.shape == (5, m, n)
            for s in range(5):
                assert np.array_equal(many[s], pyeclib_parity(k, m, backend, stripes[s]))


def test_encode_accepts_views_and_empty():
    c = codec(4, 2)
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, (8, 50), dtype=np.uint8)
    view = big[::2, 3:40]  # non-contiguous
    assert np.array_equal(c.encode(view), pyeclib_parity(4, 2, "isa_l_rs_vand", np.ascontiguousarray(view)))
    assert c.encode(np.zeros((4, 0), np.uint8)).shape == (2, 0)
    assert c.encode_stripes(np.zeros((0, 4, 3), np.uint8)).shape == (0, 2, 3)


def test_encode_rejects_bad_input():
    c = codec(4, 2)
    with pytest.raises(TypeError, match="uint8"):
        c.encode(np.zeros((4, 8), np.float32))
    with pytest.raises(TypeError, match="numpy array"):
        c.encode([[0] * 8] * 4)
    with pytest.raises(ValueError, match="shape \\(k=4, n\\)"):
        c.encode(np.zeros((3, 8), np.uint8))
    with pytest.raises(ValueError, match="2-D"):
        c.encode(np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="stripes, k=4, n"):
        c.encode_stripes(np.zeros((2, 5, 8), np.uint8))


# ------------------------------------------------------------------ reconstruct
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_reconstruct_every_loss_pattern(backend, k, m):
    rng = np.random.default_rng(k * 7 + m)
    n = 37
    c = codec(k, m, backend, 24 * k)  # small chunks: several pyeclib calls per stripe batch
    data = rng.integers(0, 256, (4, k, n), dtype=np.uint8)
    full = np.concatenate([data, c.encode_stripes(data)], axis=1)  # (stripes, k+m, n)
    for lost in lost_sets(k, m):
        avail = {i: full[:, i] for i in range(k + m) if i not in lost}
        rebuilt = c.reconstruct_stripes(avail, list(lost))
        assert sorted(rebuilt) == sorted(lost)
        for i in lost:
            assert np.array_equal(rebuilt[i], full[:, i]), (lost, i)
        one = c.reconstruct({i: a[1] for i, a in avail.items()}, reversed(lost))
        for i in lost:
            assert one[i].shape == (n,) and np.array_equal(one[i], full[1, i]), (lost, i)


def test_reconstruct_wide_rows_and_from_parity_only():
    c = codec(2, 3)
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, (2, 100_003), dtype=np.uint8)
    parity = c.encode(data)
    rebuilt = c.reconstruct({2: parity[0], 4: parity[2]}, [0, 1, 3])
    assert np.array_equal(rebuilt[0], data[0]) and np.array_equal(rebuilt[1], data[1])
    assert np.array_equal(rebuilt[3], parity[1])
    assert c.reconstruct({0: data[0], 1: data[1]}, []) == {}


def test_reconstruct_rejects_bad_input():
    c = codec(4, 2)
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, (4, 16), dtype=np.uint8)
    parity = c.encode(data)
    full = {i: data[i] for i in range(4)} | {4: parity[0], 5: parity[1]}
    avail = {i: full[i] for i in (1, 2, 3, 4)}
    with pytest.raises(ValueError, match="at least k=4"):
        c.reconstruct({i: full[i] for i in (1, 2, 3)}, [0])
    with pytest.raises(ValueError, match="differ in shape"):
        c.reconstruct(avail | {5: parity[1][:8]}, [0])
    with pytest.raises(ValueError, match="missing index 6 out of range"):
        c.reconstruct(avail, [6])
    with pytest.raises(ValueError, match="available index 9 out of range"):
        c.reconstruct(avail | {9: parity[0]}, [0])
    with pytest.raises(ValueError, match="both available and missing"):
        c.reconstruct(avail, [1])
    with pytest.raises(ValueError, match="twice"):
        c.reconstruct(avail, [0, 0])
    with pytest.raises(TypeError, match="uint8"):
        c.reconstruct(avail | {5: parity[1].astype(np.int64)}, [0])
    with pytest.raises(TypeError, match="mapping"):
        c.reconstruct([full[i] for i in range(4)], [4])
    with pytest.raises(TypeError, match="int"):
        c.reconstruct(avail, ["0"])
    with pytest.raises(ValueError, match="1-D"):
        c.reconstruct({i: full[i][None] for i in (1, 2, 3, 4)}, [0])
    with pytest.raises(ValueError, match="2-D"):
        c.reconstruct_stripes(avail, [0])


# ------------------------------------------------------------------ deltas
def _stripe_store(rng, stripes, k, m, n, c):
    """Data of many stripes and their parity laid out like a parity server: (stripes*m, n) rows."""
    data = rng.integers(0, 256, (stripes, k, n), dtype=np.uint8)
    slot_of = rng.permutation(stripes * m).reshape(stripes, m)  # (stripe, j) -> row of the store
    store = np.zeros((stripes * m, n), dtype=np.uint8)
    store[slot_of] = c.encode_stripes(data)
    return data, slot_of, store


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (8, 3)])
def test_delta_updates_keep_parity_equal_to_encode(kernel, backend, k, m):
    rng = np.random.default_rng(k + 10 * m)
    n, stripes = 45, 6
    c = codec(k, m, backend, None, kernel)
    data, slot_of, store = _stripe_store(rng, stripes, k, m, n, c)
    parity = c.encode_stripes(data)  # per-stripe (m, n) copy for the single-row forms
    for step in range(40):
        s, i = int(rng.integers(stripes)), int(rng.integers(k))
        new = rng.integers(0, 256, n, dtype=np.uint8)
        delta = data[s, i] ^ new
        data[s, i] = new
        form = step % 3
        if form == 0:
            c.apply_delta(parity[s], i, delta)
        else:
            for j in range(m):
                c.apply_delta(parity[s, j], i, delta, parity_index=j)
        # batched form on the parity-server layout: one row per (stripe, j)
        c.apply_delta(store, i, np.broadcast_to(delta, (m, n)), slots=slot_of[s], parity_index=np.arange(m))
    expect = c.encode_stripes(data)
    assert np.array_equal(parity, expect)
    assert np.array_equal(store[slot_of], expect)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_batched_deltas_with_duplicate_slots(kernel):
    k, m, n, stripes = 4, 3, 29, 5
    rng = np.random.default_rng(99)
    c = codec(k, m, "isa_l_rs_cauchy", None, kernel)
    data, slot_of, store = _stripe_store(rng, stripes, k, m, n, c)
    # one batch of 30 row updates, the same rows several times over (so slots repeat)
    slots, positions, pidx, deltas = [], [], [], []
    for _ in range(30):
        s, i = int(rng.integers(2)), int(rng.integers(k))  # only two stripes: many duplicates
        new = rng.integers(0, 256, n, dtype=np.uint8)
        d = data[s, i] ^ new
        data[s, i] = new
        for j in range(m):
            slots.append(slot_of[s, j])
            positions.append(i)
            pidx.append(j)
            deltas.append(d)
    assert len(set(slots)) < len(slots)
    c.apply_delta(store, np.array(positions), np.stack(deltas), slots=np.array(slots), parity_index=np.array(pidx))
    assert np.array_equal(store[slot_of], c.encode_stripes(data))


def test_batched_deltas_scalar_position_and_m1_default_index():
    k, n = 3, 16
    c = codec(k, 1)
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, (4, k, n), dtype=np.uint8)
    store = c.encode_stripes(data)[:, 0, :].copy()  # (stripes, n): slot = stripe
    new = rng.integers(0, 256, (4, n), dtype=np.uint8)
    delta = data[:, 2] ^ new
    data[:, 2] = new
    c.apply_delta(store, 2, delta, slots=np.arange(4))  # m == 1: parity_index defaults to 0
    assert np.array_equal(store, c.encode_stripes(data)[:, 0])


def test_delta_applied_twice_cancels():
    c = codec(4, 2)
    rng = np.random.default_rng(8)
    parity = rng.integers(0, 256, (2, 33), dtype=np.uint8)
    before = parity.copy()
    delta = rng.integers(0, 256, 33, dtype=np.uint8)
    c.apply_delta(parity, 3, delta)
    assert not np.array_equal(parity, before)
    c.apply_delta(parity, 3, delta)
    assert np.array_equal(parity, before)


def test_apply_delta_rejects_bad_input_and_changes_nothing():
    k, m, n = 4, 2, 16
    c = codec(k, m)
    rng = np.random.default_rng(5)
    parity = rng.integers(0, 256, (m, n), dtype=np.uint8)
    store = rng.integers(0, 256, (10, n), dtype=np.uint8)
    snapshot = (parity.copy(), store.copy())
    delta = rng.integers(0, 256, n, dtype=np.uint8)
    batch = rng.integers(0, 256, (3, n), dtype=np.uint8)
    cases = [
        (TypeError, "uint8", lambda: c.apply_delta(parity.astype(np.int32), 0, delta)),
        (TypeError, "uint8", lambda: c.apply_delta(parity, 0, delta.astype(np.float64))),
        (TypeError, "numpy array", lambda: c.apply_delta(parity, 0, list(delta))),
        (ValueError, "position 4 out of range", lambda: c.apply_delta(parity, 4, delta)),
        (ValueError, "position -1 out of range", lambda: c.apply_delta(parity, -1, delta)),
        (TypeError, "position must be an int", lambda: c.apply_delta(parity, 1.0, delta)),
        (ValueError, "shape \\(m=2, n\\)", lambda: c.apply_delta(parity[:1], 0, delta)),
        (ValueError, "delta length 15", lambda: c.apply_delta(parity, 0, delta[:15])),
        (ValueError, "delta must be 1-D", lambda: c.apply_delta(parity, 0, batch)),
        (ValueError, "parity_index 2 out of range", lambda: c.apply_delta(parity[0], 0, delta, parity_index=2)),
        (ValueError, "parity must be 1-D", lambda: c.apply_delta(parity, 0, delta, parity_index=0)),
        (ValueError, "parity_index is required", lambda: c.apply_delta(store, 0, batch, slots=[0, 1, 2])),
        (ValueError, "slot 10 out of range",
         lambda: c.apply_delta(store, 0, batch, slots=[0, 10, 2], parity_index=0)),
        (ValueError, "batch sizes differ", lambda: c.apply_delta(store, 0, batch, slots=[0, 1], parity_index=0)),
        (ValueError, "position must be a scalar or have shape \\(3,\\)",
         lambda: c.apply_delta(store, [0, 1], batch, slots=[0, 1, 2], parity_index=0)),
        (ValueError, "position 5 out of range",
         lambda: c.apply_delta(store, [0, 5, 1], batch, slots=[0, 1, 2], parity_index=0)),
        (ValueError, "parity_index 2 out of range",
         lambda: c.apply_delta(store, 0, batch, slots=[0, 1, 2], parity_index=[0, 1, 2])),
        (TypeError, "parity_index must be an int or an integer array",
         lambda: c.apply_delta(store, 0, batch, slots=[0, 1, 2], parity_index=[0.5, 1, 0])),
        (ValueError, "width", lambda: c.apply_delta(store, 0, batch[:, :8], slots=[0, 1, 2], parity_index=0)),
        (ValueError, "2-D", lambda: c.apply_delta(store, 0, batch[0], slots=[0], parity_index=0)),
    ]  # fmt: skip
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
        assert np.array_equal(parity, snapshot[0]) and np.array_equal(store, snapshot[1]), match


def test_gf_mul_helper():
    assert gf_mul(2, 0x80) == 0x1D and gf_mul(np.uint8(3), 7) == 9
    arr = gf_mul(np.array([1, 2, 3]), np.array([5, 0x80, 0]))
    assert arr.dtype == np.uint8 and arr.tolist() == [5, 0x1D, 0]
    with pytest.raises(ValueError, match="bytes"):
        gf_mul(300, 1)
    with pytest.raises(ValueError):
        gf_mul(np.array([1, 999]), 2)


# ------------------------------------------------------------------ GPU (cupy arrays)
@pytest.mark.gpu
@pytest.mark.skipif(not gpu_mod.probe()[0], reason="needs cupy and a usable CUDA device")
def test_apply_delta_on_cupy_arrays_matches_numpy():
    import cupy as cp

    k, m, n, stripes = 4, 2, 1001, 8
    rng = np.random.default_rng(12)
    c = Codec(k, m, kernel="gpu")
    assert c.kernel.name == "gpu"
    data, slot_of, store = _stripe_store(rng, stripes, k, m, n, c)
    parity = c.encode_stripes(data)
    d_store, d_parity = cp.asarray(store), cp.asarray(parity)
    for step in range(20):
        s, i = int(rng.integers(stripes)), int(rng.integers(k))
        new = rng.integers(0, 256, n, dtype=np.uint8)
        delta = data[s, i] ^ new
        data[s, i] = new
        dd = cp.asarray(delta)
        if step % 2:
            c.apply_delta(d_parity[s], i, dd)
        else:
            for j in range(m):
                c.apply_delta(d_parity[s, j], i, dd, parity_index=j)
        c.apply_delta(d_store, cp.full(m, i), cp.broadcast_to(dd, (m, n)), slots=cp.asarray(slot_of[s]),
                      parity_index=np.arange(m))  # fmt: skip
    expect = c.encode_stripes(data)
    assert np.array_equal(cp.asnumpy(d_parity), expect)
    assert np.array_equal(cp.asnumpy(d_store)[slot_of], expect)
    # numpy arrays on a gpu codec run on the CPU kernel, with the same result
    host = parity[0].copy()  # one stripe's m parity rows
    expect_host = parity[0].copy()
    delta = rng.integers(1, 256, n, dtype=np.uint8)
    c.apply_delta(host, 1, delta)
    Codec(k, m, kernel="cpu").apply_delta(expect_host, 1, delta)
    assert isinstance(host, np.ndarray) and np.array_equal(host, expect_host) and not np.array_equal(host, parity[0])
    assert c._kernels["cpu"].name == "cpu" and c.kernel.name == "gpu"
