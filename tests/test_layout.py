"""The layout is a pure function: every row has exactly one home, stripes span distinct servers,
parity rotates, and the inverse maps agree with the forward ones."""


import numpy as np
import pytest

from ecrec.coding.layout import Layout


@pytest.mark.parametrize("servers,k,m", [(1, 1, 0), (4, 4, 0), (3, 2, 1), (4, 2, 1), (5, 2, 2), (8, 4, 3), (6, 3, 3)])
@pytest.mark.parametrize("num_rows", [1, 7, 100, 1001])
def test_rows_have_unique_homes_and_inverse_agrees(servers, k, m, num_rows):
    layout = Layout(servers, k, m)
    ids = np.arange(num_rows)
    srv, slot = layout.locate(ids)
    assert srv.min() >= 0 and srv.max() < servers
    assert slot.min() >= 0 and slot.max() < layout.data_slots_per_server(num_rows)
    homes = set(zip(srv.tolist(), slot.tolist()))
    assert len(homes) == num_rows  # no two rows share a (server, slot)
    seen = []
    for s in range(servers):
        owned, slots = layout.rows_of(s, num_rows)
        s2, sl2 = layout.locate(owned)
        assert (s2 == s).all() and (sl2 == slots).all()
        seen.extend(owned.tolist())
    assert sorted(seen) == list(range(num_rows))


@pytest.mark.parametrize("servers,k,m", [(3, 2, 1), (4, 2, 1), (5, 2, 2), (8, 4, 3)])
def test_stripe_members_distinct_and_parity_rotates(servers, k, m):
    layout = Layout(servers, k, m)
    num_rows = k * servers * 5
    stripes = np.arange(layout.num_stripes(num_rows))
    parity = layout.parity_servers(stripes)
    for s in stripes:
        ids = np.arange(s * k, s * k + k)
        data_servers = layout.locate(ids)[0].tolist()
        members = data_servers + parity[s].tolist()
        assert len(set(members)) == k + m
        assert members == layout.stripe_members(int(s))
    # every server holds the same number of parity rows (balanced), and parity slots are unique
    counts = np.bincount(parity.reshape(-1), minlength=servers)
    assert counts.min() == counts.max()
    for srv in range(servers):
        st, j, slots = layout.parity_rows_of(srv, num_rows)
        assert len(set(slots.tolist())) == len(slots)
        assert (parity[st, j] == srv).all()
        assert (layout.parity_slot(st, j) == slots).all()


def test_layout_depends_only_on_spec():
    a, b = Layout(4, 2, 1), Layout(4, 2, 1)
    ids = np.random.default_rng(0).integers(0, 10_000, 500)
    assert all((x == y).all() for x, y in zip(a.locate(ids), b.locate(ids)))
    assert a.dense_servers("mlp.0.weight") == b.dense_servers("mlp.0.weight")


def test_dense_replicas_distinct():
    layout = Layout(5, 2, 2)
    for name in (f"p{i}" for i in range(50)):
        servers = layout.dense_servers(name)
        assert len(servers) == 3 and len(set(servers)) == 3


@pytest.mark.parametrize("servers,k,m", [(2, 2, 1), (3, 0, 1), (0, 1, 0), (3, 1, -1)])
def test_invalid_layout_rejected(servers, k, m):
    with pytest.raises(ValueError):
        Layout(servers, k, m)
