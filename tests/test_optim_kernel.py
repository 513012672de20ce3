"""The compiled optimizer pass (``ecrec.tables.optim_kernel``) against the numpy reference (``ecrec.tables.optim``):
bit for bit the same rows, the same old bytes, the same rows refused; the table itself untouched."""

import numpy as np
import pytest

from ecrec import errors
from ecrec.coding.layout import Layout
from ecrec.tables import optim, optim_kernel
from ecrec.tables.shards import TableShard
from ecrec.tables.spec import TableSpec


def _table(rng, n, dim, state_width, scale):
    weights = rng.standard_normal((n, dim)).astype(np.float32) * np.float32(scale)
    state = np.abs(rng.standard_normal((n, dim * state_width))).astype(np.float32) * np.float32(scale)
    return np.ascontiguousarray(np.concatenate([weights, state], axis=1))


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
@pytest.mark.parametrize("dim", [1, 3, 16, 64])
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e6, 1e18])
@pytest.mark.parametrize("keep", ["nothing", "old", "delta"])
def test_the_compiled_pass_equals_the_numpy_reference_bit_for_bit(optimizer, dim, scale, keep):
    keep_old = keep != "nothing"
    rng = np.random.default_rng(dim * 7 + int(np.log10(scale) + 40))
    table = _table(rng, 500, dim, optim.state_width(optimizer), scale)
    before = table.copy()
    slots = rng.choice(500, size=200, replace=False).astype(np.int64)
    grads = (rng.standard_normal((200, dim)) * scale).astype(np.float32)
    lr, eps = 0.05, 1e-10
    rows, old, bad = optim_kernel.update_rows(table, slots, grads, optimizer, dim, lr, eps, keep_old=keep == "old",
                                              delta=keep == "delta")
    expected = table[slots]
    with np.errstate(over="ignore", invalid="ignore"):
        optim.apply(optimizer, expected, grads, dim, lr, eps)
    assert rows.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes()  # bits, not values
    if keep == "delta":  # the old bytes XOR the new ones, bit for bit, written by the pass itself
        assert old.tobytes() == np.bitwise_xor(table[slots].view(np.uint8), expected.view(np.uint8)).tobytes()
    else:
        assert (old.tobytes() == table[slots].view(np.uint8).tobytes()) if keep_old else old is None
    reference_bad = ~np.isfinite(expected).all(axis=1)
    if reference_bad.any():
        assert bad is not None and (bad == reference_bad).all()
    else:
        assert bad is None
    assert table.tobytes() == before.tobytes()  # only read


def test_a_shard_keeps_the_delta_in_the_optimizers_pass_bit_for_bit_as_numpy_makes_it_apart():
    """Parity's delta (a row's bytes before XOR after) comes out of the compiled pass itself -- no pass of its own
    in ``commit`` (``delta_cpu_s`` counts only such passes) -- and is bit for bit the one numpy computes after the
    update; a push's rows, versions and the table end the same either way."""
    layout = Layout(num_servers=3, k=2, m=1)
    spec = TableSpec("t", 1000, 5, optimizer="adagrad", lr=0.05, eps=1e-10, seed=4)
    compiled, reference = TableShard(spec, layout, 0), TableShard(spec, layout, 0)
    reference._compiled = False
    rng = np.random.default_rng(5)
    ids = compiled.owned_ids[rng.choice(len(compiled.owned_ids), 200, replace=False)]
    for version in range(1, 4):
        grads = rng.standard_normal((200, 5)).astype(np.float32)
        out = [shard.apply_gradients(shard.slots_for(ids), grads, version, keep_old=False, delta=True)
               for shard in (compiled, reference)]
        (d1, new1, v1), (d2, new2, v2) = out
        assert d1.tobytes() == d2.tobytes() and new1.tobytes() == new2.tobytes() and (v1 == v2).all()
    assert compiled._payload.tobytes() == reference._payload.tobytes()
    assert compiled.delta_cpu_s == 0.0 and reference.delta_cpu_s > 0.0
    prepared = compiled.prepare_gradients(compiled.slots_for(ids), grads, keep_old=True, delta=True)
    with pytest.raises(ValueError, match="delta"):  # a delta is never handed over as the old bytes
        compiled.commit(prepared, 9, delta=False)
    assert compiled._payload.tobytes() == reference._payload.tobytes()  # nothing written


def test_rows_that_would_overflow_are_flagged_and_old_bytes_kept_only_when_asked():
    table = np.ones((4, 4), dtype=np.float32)  # adagrad, dim 2
    grads = np.array([[1e20, 0.0], [1.0, 1.0]], dtype=np.float32)  # 1e20 squared overflows the accumulator
    rows, old, bad = optim_kernel.update_rows(table, np.array([3, 1]), grads, "adagrad", 2, 0.1, 1e-10, keep_old=False)
    assert old is None and bad.tolist() == [True, False]
    assert np.isfinite(rows[1]).all()


def test_a_shard_updates_through_the_compiled_pass_as_through_numpy_and_refuses_the_same_rows():
    layout = Layout(num_servers=3, k=2, m=1)
    spec = TableSpec("t", 1000, 8, optimizer="adagrad", lr=0.05, eps=1e-10, seed=3)
    compiled, reference = TableShard(spec, layout, 0), TableShard(spec, layout, 0)
    assert compiled._compiled
    reference._compiled = False
    rng = np.random.default_rng(1)
    ids = compiled.owned_ids[rng.choice(len(compiled.owned_ids), 100, replace=False)]
    for version in range(1, 6):
        grads = rng.standard_normal((100, 8)).astype(np.float32)
        for shard in (compiled, reference):
            shard.apply_gradients(shard.slots_for(ids), grads, version, keep_old=False, delta=True)
    assert compiled._payload.tobytes() == reference._payload.tobytes()
    huge = np.full((100, 8), 1e20, dtype=np.float32)
    messages = []
    for shard in (compiled, reference):
        before = shard._payload.tobytes()
        with pytest.raises(errors.InvalidRequest) as refused:
            shard.prepare_gradients(shard.slots_for(ids), huge, keep_old=True)
        messages.append(str(refused.value))
        assert shard._payload.tobytes() == before  # nothing changed
    assert messages[0] == messages[1] and "non-finite" in messages[0]


def test_a_division_by_zero_is_refused_as_not_finite_as_numpy_refuses_it():
    """Adagrad with eps 0 on a zero accumulator and a zero gradient divides 0 by 0: numpy gives NaN and the row is
    refused as not finite; the compiled pass must do the same (not raise ZeroDivisionError: an INTERNAL error)."""
    layout = Layout(num_servers=3, k=2, m=1)
    spec = TableSpec("t", 100, 4, optimizer="adagrad", lr=0.1, eps=0.0, initial_accumulator_value=0.1, init="blank")
    messages = []
    for compiled in (True, False):
        shard = TableShard(spec, layout, 0)
        shard._compiled = compiled
        ids = shard.owned_ids[:3]
        grads = np.zeros((3, 4), dtype=np.float32)
        with pytest.raises(errors.InvalidRequest) as refused:
            shard.prepare_gradients(shard.slots_for(ids), grads, keep_old=False)
        messages.append(str(refused.value))
    assert messages[0] == messages[1]


def test_read_only_gradients_and_slots_out_of_range():
    table = np.ones((4, 4), dtype=np.float32)
    grads = np.full((2, 2), 0.5, dtype=np.float32)
    grads.setflags(write=False)  # a request's bytes seen as floats in place
    rows, old, bad = optim_kernel.update_rows(table, np.array([0, 2]), grads, "sgd", 2, 0.1, 0.0, keep_old=False)
    assert bad is None and old is None and rows[0, 0] == np.float32(1) + np.float32(-0.1) * np.float32(0.5)
    for slots in ([0, 4], [-1, 0]):
        with pytest.raises(IndexError, match="out of range"):
            optim_kernel.update_rows(table, np.array(slots), grads, "sgd", 2, 0.1, 0.0, keep_old=True)
    assert (table == 1).all()


@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 20])
def test_the_pass_reads_nothing_past_a_push_around_its_fetch_distance(rows):
    """The pass fetches the table row ``FETCH_ROWS`` rows ahead: pushes shorter, as long and longer than that give the
    numpy reference's rows, bit for bit, and the same loop compiled with bounds checks (an index one row too far
    raises there) gives the same rows, old bytes and flags."""
    from numba import njit

    assert optim_kernel.FETCH_ROWS == 8  # the distance these sizes are chosen around
    checked = njit(boundscheck=True, cache=False, error_model="numpy")(optim_kernel._update.py_func)
    rng = np.random.default_rng(rows)
    dim = 16
    table = _table(rng, 64, dim, optim.state_width("adagrad"), 1.0)
    slots = rng.choice(64, size=rows, replace=False).astype(np.int64)
    grads = rng.standard_normal((rows, dim)).astype(np.float32)
    rows_out, delta, _ = optim_kernel.update_rows(table, slots, grads, "adagrad", dim, 0.05, 1e-10, False, True)
    expected = table[slots]
    optim.apply("adagrad", expected, grads, dim, 0.05, 1e-10)
    assert rows_out.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes()
    again = np.empty_like(rows_out)
    old = np.empty((rows, table.shape[1] * 4), np.uint8)
    bad = np.empty(rows, np.bool_)
    assert checked(table, table.view(np.uint32), slots, grads, dim, optim_kernel.ADAGRAD, np.float32(-0.05),
                   np.float32(1e-10), again, again.view(np.uint32), old.view(np.uint32), optim_kernel.KEEP_DELTA,
                   bad) == 0
    assert again.tobytes() == rows_out.tobytes() and old.tobytes() == delta.tobytes() and not bad.any()
