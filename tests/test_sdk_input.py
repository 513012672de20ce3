"""What the SDK takes from a user and what it refuses, before anything reaches a server: arguments that used to
be taken and then failed far away (or never), copies and pickles of a model holding the cluster, a client whose
message limit is small.  Real servers: each refusal is checked to have changed nothing there."""

from __future__ import annotations

import copy
import math
import pickle
import threading

import numpy as np
import pytest
import torch

from ecrec.client import Cluster, ClusterError, EmbeddingBag
from ecrec.config import ClientConfig


def test_a_client_setting_of_the_wrong_kind_is_refused_naming_it():
    # each of these was taken and failed at the first call (a TypeError far from the setting), or was taken as 1
    for settings, said in [({"retry_deadline_s": None}, "retry_deadline_s (--retry-deadline-s) None: must be a number"),
                           ({"rpc_timeout_s": "5"}, "rpc_timeout_s (--rpc-timeout-s) '5': must be a number"),
                           ({"rpc_timeout_s": True}, "rpc_timeout_s (--rpc-timeout-s) True: must be a number"),
                           ({"max_message_bytes": 70000.5}, "must be a whole number"),
                           ({"max_message_bytes": 2**40}, "at most 2147483647")]:
        with pytest.raises(ValueError) as caught:
            ClientConfig(**settings)
        assert said in str(caught.value), (settings, str(caught.value))
    config = ClientConfig(rpc_timeout_s=np.float32(5), max_message_bytes=70000.0, retry_deadline_s=torch.tensor(9.0))
    # a number of any kind is one (numpy, torch), kept as the setting's own type: a whole float as an int size
    assert (config.rpc_timeout_s, config.max_message_bytes, config.retry_deadline_s) == (5.0, 70000, 9.0)
    assert type(config.max_message_bytes) is int and type(config.retry_deadline_s) is float


def test_connect_refuses_a_wait_that_is_not_a_number_of_seconds_and_an_address_that_is_none():
    outcome = []

    def connect():  # a NaN wait never ended against a coordinator that does not answer
        try:
            Cluster.connect("127.0.0.1:1", wait_ready_s=math.nan)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "Cluster.connect(wait_ready_s=nan) was still waiting after 20 s"
    assert isinstance(outcome[0], ValueError) and "wait_ready_s must be a number of seconds" in str(outcome[0])
    for wait in (-1, "5", -math.inf):
        with pytest.raises(ValueError, match="wait_ready_s"):
            Cluster.connect("127.0.0.1:1", wait_ready_s=wait)
    with pytest.raises(TypeError, match="address must be a coordinator's host:port"):
        Cluster.connect(None)


@pytest.mark.cluster
def test_connect_takes_the_coordinators_as_a_list(shared_cluster):
    local = shared_cluster(servers=2, strategy="none")
    cluster = Cluster.connect([local.coordinator_address])  # sdk.md: "one coordinator address or a list"
    try:
        assert cluster.address == local.coordinator_address and cluster.map.ready
    finally:
        cluster.close()


@pytest.mark.cluster
def test_create_table_refuses_values_past_float32_sizes_that_are_not_whole_and_names_that_are_no_text(
        shared_cluster):
    local = shared_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    try:
        bad = [
            # taken before: a table of +-inf rows (and a snapshot holding it refused whole at its load), inf
            # accumulators, every update refused; a 10 x 3 table for 10.9 x 3.7; a name the map cannot carry
            (("inf_rows", 10, 4), {"init_scale": 1e39}, "init_scale must be finite in float32"),
            (("inf_acc", 10, 4), {"optimizer": "adagrad", "initial_accumulator_value": 1e39},
             "initial_accumulator_value must be finite in float32"),
            (("inf_lr", 10, 4), {"lr": 1e39}, "lr must be finite in float32"),
            (("tiny_eps", 10, 4), {"optimizer": "adagrad", "eps": 1e-50}, "division by zero"),
            (("fraction", 10.9, 3), {}, "num_rows must be a whole number, got 10.9"),
            (("text", "12", 3), {}, "num_rows must be a whole number, got '12'"),
            (("flag", 10, True), {}, "dim must be a whole number, got True"),
            (("lr_text", 10, 3), {"lr": "0.1"}, "lr must be a number"),
            (("a\udc80", 10, 3), {}, "is not valid text"),
            (("x" * 2000, 10, 3), {}, "is 2000 bytes in UTF-8; at most 1024"),
            # a newline forged a line of the coordinator's log, a NUL made it binary, a bidi override hid the name
            (("a\nINFO created table b", 10, 3), {}, "holds a control or format character ('\\n')"),
            (("a\x00b", 10, 3), {}, "holds a control or format character"),
            (("\u202etxt", 10, 3), {}, "holds a control or format character"),
        ]
        for args, kwargs, said in bad:
            with pytest.raises(ValueError) as caught:
                cluster.create_table(*args, **kwargs)
            assert said in str(caught.value), (args[0][:20], str(caught.value))
        assert [t.name for t in cluster.refresh_map().tables] == []  # nothing was created
        spec = cluster.create_table("whole", np.int64(10), 4.0, seed=torch.tensor(3), lr=np.float32(0.5))
        assert (spec.num_rows, spec.dim, spec.seed) == (10, 4, 3)
        assert cluster.create_table("tensors", torch.tensor(12.0), np.array(2.0)).num_rows == 12
    finally:
        cluster.close()


@pytest.mark.cluster
def test_register_dense_refuses_a_name_another_parameter_holds_and_a_parameter_under_a_second_name(shared_cluster):
    """Two MLPs registered without prefixes (both ``0.weight``, ``0.bias``): the second took the first one's
    tensors over -- its own initial values replaced, the first never trained again, its gradient piling up.  One
    module under two prefixes trained one name only (the other stayed at its initial value in every snapshot)."""
    local = shared_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    try:
        bottom = torch.nn.Sequential(torch.nn.Linear(4, 4))
        top = torch.nn.Sequential(torch.nn.Linear(4, 4))
        top_values = [p.detach().clone() for p in top.parameters()]
        assert cluster.register_dense(bottom, lr=0.1) == ["0.weight", "0.bias"]
        assert cluster.register_dense(bottom, lr=0.1) == ["0.weight", "0.bias"]  # the same module again: harmless
        with pytest.raises(ValueError, match="'0.weight' is registered already, by another parameter.*prefix="):
            cluster.register_dense(top, lr=0.1)
        assert all(torch.equal(p, v) for p, v in zip(top.parameters(), top_values))  # untouched
        assert cluster.register_dense(top, lr=0.1, prefix="top.") == ["top.0.weight", "top.0.bias"]
        with pytest.raises(ValueError, match="'again.0.weight' is registered already as '0.weight'"):
            cluster.register_dense(bottom, lr=0.1, prefix="again.")
        assert sorted(d.name for d in cluster.refresh_map().dense) == ["0.bias", "0.weight", "top.0.bias",
                                                                        "top.0.weight"]
        before = bottom[0].weight.detach().clone()
        top(bottom(torch.randn(8, 4))).pow(2).sum().backward()
        cluster.step()
        assert not torch.equal(bottom[0].weight, before), "the first module no longer trains"
        assert bottom[0].weight.grad is None or not bottom[0].weight.grad.any()
    finally:
        cluster.close()


@pytest.mark.cluster
def test_a_copy_of_a_model_shares_its_cluster_and_a_pickle_says_why_it_cannot_be(shared_cluster):
    local = shared_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    try:
        cluster.create_table("copied", 10, 3, init="normal")
        model = torch.nn.Sequential(EmbeddingBag(cluster, "copied"), torch.nn.Linear(3, 1))
        twin = copy.deepcopy(model)  # was: TypeError: cannot pickle '_thread.RLock' object
        assert twin[0].cluster is cluster and twin[1].weight is not model[1].weight
        ids = torch.tensor([[1, 2], [3, 4]])
        with torch.no_grad():
            assert torch.equal(twin(ids), model(ids))
        assert copy.copy(cluster) is cluster
        with pytest.raises(TypeError, match="a Cluster .* is a connection and cannot be pickled: save the model's "
                                            "state_dict"):
            pickle.dumps(model)
    finally:
        cluster.close()


@pytest.mark.cluster
def test_a_client_with_a_small_message_limit_reads_and_writes_a_table_larger_than_it(shared_cluster):
    """``read_table`` asked for replies of 64 MiB whatever the client's ``max_message_bytes``: a client with a
    smaller limit (any from 64 KiB) could not read, ``state_dict()`` or save a table larger than it."""
    local = shared_cluster(servers=2, strategy="none")
    writer = Cluster.connect(local.coordinator_address)
    small = Cluster.connect(local.coordinator_address, ClientConfig(max_message_bytes=float(1 << 17)))
    try:
        values = np.random.default_rng(0).standard_normal((4000, 16)).astype(np.float32)
        writer.create_table("wide", 4000, 16)
        small.write_rows("wide", np.arange(4000), values)  # ~260 KB of values, pushes under the limit
        assert np.array_equal(small.read_table("wide"), values)
        assert np.array_equal(small.read_rows("wide", np.arange(3999, -1, -1)), values[::-1])
    finally:
        small.close()
        writer.close()


@pytest.mark.parametrize("name, why", [("w\n1", "control character"), ("w\x1b[2J", "control character"),
                                       ("w\u2028x", "control character"), ("w\ud800", "not UTF-8"),
                                       ("rank\u202e1", "text-direction"), ("w\u200b", "invisible"),
                                       ("rank1\ufe00", "invisible"), ("\u3164", "invisible"),
                                       ("rank1\u200d", "joiner"), ("\u200crank1", "joiner"),
                                       ("rank1\ufe0f", "presentation selector"), ("rank1\u00a0", "white space"),
                                       ("rank1 ", "white space"), ("w\x7f", "control character")])
def test_a_worker_name_no_push_could_carry_is_refused_at_connect(name, why):
    """A worker name with a lone surrogate was taken, and the first push failed in protobuf's encoder (after the
    step's pulls); one with a newline, a line separator or an escape went into every server's logs and ``status``,
    one with a text-direction control, a zero-width space, a joiner beside nothing to join or white space at an
    end showed there as another name.  Refused when the client is made, before any connection, naming the
    character."""
    with pytest.raises(ValueError, match=why):
        Cluster("127.0.0.1:1", worker=name)
    Cluster("127.0.0.1:1", worker="wörker-1 (rank 0)").close()  # printable text of any script is a name
    Cluster("127.0.0.1:1", worker="\u0645\u06cc\u200c\u0631\u0648\u062f").close()  # a joiner the script needs too
    Cluster("127.0.0.1:1", worker="rank \u2764\ufe0f").close()  # an emoji with its presentation selector


@pytest.mark.cluster
def test_a_worker_name_longer_than_the_servers_take_is_refused_when_the_client_is_made(shared_cluster):
    """A name past the servers' ``--max-worker-name-bytes`` (256) was taken, and every push refused (after the
    step's pulls): refused when the client is made, counted in UTF-8 bytes; one the servers were told to take
    (a larger bound on both sides) trains."""
    with pytest.raises(ValueError, match=r"is 257 bytes \(UTF-8\), longer than 256 \(ClientConfig.max_worker_name_"):
        Cluster("127.0.0.1:1", worker="w" * 257)
    with pytest.raises(ValueError, match="is 258 bytes"):
        Cluster("127.0.0.1:1", worker="\u00e9" * 129)  # 129 characters, 2 bytes each
    Cluster("127.0.0.1:1", worker="w" * 256).close()
    with pytest.raises(ValueError, match="max_worker_name_bytes"):
        ClientConfig(max_worker_name_bytes=0)
    local = shared_cluster(servers=2, strategy="none", server_options={"max_worker_name_bytes": 400})
    cluster = Cluster.connect(local.coordinator_address, config=ClientConfig(max_worker_name_bytes=400),
                              worker="w" * 300)
    try:
        cluster.create_table("long_named", 4, 2, optimizer="sgd", lr=1.0, init="zeros")
        EmbeddingBag(cluster, "long_named")(torch.tensor([[1]])).sum().backward()
        cluster.step()
        np.testing.assert_array_equal(cluster.read_rows("long_named", [1]), [[-1.0, -1.0]])
    finally:
        cluster.close()


def test_every_format_character_is_refused_in_a_worker_name_or_named_as_visible():
    """Format characters (Unicode category Cf) are invisible but for a few: every one this Python knows is either
    refused in a worker name or listed as one a name may hold (a newer Unicode's new ones fail here first)."""
    import unicodedata

    from ecrec.net import transport

    unlisted = [f"U+{c:04X}" for c in range(0x110000) if unicodedata.category(chr(c)) == "Cf"
                and chr(c) not in transport.VISIBLE_FORMAT and transport.worker_name_problem(chr(c)) is None]
    assert not unlisted, unlisted
    assert all(transport.worker_name_problem(f"\u0645{c}\u0645") is None for c in transport.VISIBLE_FORMAT)


def _child_leaves_a_client_open(marker: str) -> None:
    import ecrec.client.cluster as module

    original = module.Cluster.close

    def close(self, *args, **kwargs):
        with open(marker, "w") as f:
            f.write(repr(kwargs))
        return original(self, *args, **kwargs)

    module.Cluster.close = close
    Cluster("127.0.0.1:1")  # (connects to nothing until called) left open; the child then ends


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_multiprocessing_child_closes_the_clients_it_leaves_open_when_it_ends(tmp_path, method):
    """A client a process leaves open is closed at its exit, waiting for confirmations as ``close()`` does
    (``ClientConfig.confirm_at_exit_s``): a ``multiprocessing`` child started by fork ends without running exit
    handlers, so it is closed among the child's finalizers."""
    import multiprocessing

    marker = tmp_path / "closed"
    child = multiprocessing.get_context(method).Process(target=_child_leaves_a_client_open, args=(str(marker),))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert marker.read_text() == "{'confirm_timeout_s': 0}"  # nothing held: nothing waited for


@pytest.mark.cluster
def test_large_lookups_go_in_pieces_and_a_step_too_large_for_one_push_is_refused_whole(make_cluster):
    """A lookup whose rows did not fit in one reply (or named more ids than a server takes in one request) failed:
    it is pulled in pieces now.  Gradients accumulated over several lookups of the same rows went to each server
    with every repeat, and a step larger than a server takes was applied by some servers and refused by others
    (``StepPartlyApplied``, not to be retried): repeats are summed before sending, as the server sums them, and a
    step still too large for one push is refused before anything is sent, its gradients kept."""
    from ecrec.client.steps import ClusterError

    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_options={"max_ids_per_request": 1000})
    client = Cluster.connect(local.coordinator_address, ClientConfig(max_message_bytes=65536, max_ids_per_request=1000))
    try:
        client.create_table("t", 4000, 16, optimizer="sgd", lr=1.0, init="zeros")
        client.create_table("u", 4000, 4, optimizer="sgd", lr=1.0, seed=3)
        expected = client.read_rows("u", np.arange(4000))
        # 4000 rows of 4 floats: more ids than a server takes at once; 2000 rows of 16 floats: more than a reply holds
        np.testing.assert_array_equal(client.pull("u", np.arange(4000)).numpy(), expected)
        np.testing.assert_array_equal(client.pull("t", np.arange(2000)).numpy(), np.zeros((2000, 16), np.float32))
        bag = EmbeddingBag(client, "t")
        shared = torch.arange(0, 2400, 3)  # 800 rows, ~270 per server: a push each once summed, not 3 times over
        for _ in range(3):
            bag(shared[None, :]).sum().backward()
        client.step()
        rows = client.read_rows("t", np.arange(2400))
        np.testing.assert_array_equal(rows[::3], np.full((800, 16), -3.0, np.float32))
        np.testing.assert_array_equal(np.delete(rows, np.arange(0, 2400, 3), axis=0), 0.0)
        before = client.read_payload("t")[1].copy()
        for part in (torch.arange(0, 1800), torch.arange(1800, 3600)):  # 3600 distinct rows: ~1200 per server
            bag(part[None, :]).sum().backward()
        with pytest.raises(ClusterError, match=r"step refused before anything was sent: server \d's part would name "
                                               r"\d+ row ids.*, more than one push may \(1000: "
                                               r"ClientConfig.max_ids_per_request.*; look up fewer rows"):
            client.step()
        np.testing.assert_array_equal(client.read_payload("t")[1], before)  # nothing applied anywhere
        client.zero_grad()
        assert client.step()["rows"] == 0
        # gradients finite each, their sum not: refused whole by the worker (each server refused its part before)
        client.create_table("s", 12, 2, optimizer="sgd", lr=1.0, init="zeros")
        small = EmbeddingBag(client, "s")
        for _ in range(2):
            (small(torch.arange(12)[None, :]).sum() * 3e38).backward()
        with pytest.raises(ClusterError, match="step refused before anything was sent: the gradient of table 's' "
                                               "holds NaN or Inf"):
            client.step()
        client.zero_grad()
        np.testing.assert_array_equal(client.read_rows("s", np.arange(12)), 0.0)
        # rows of one float: a request of 8 bytes per id is larger than its reply
        client.create_table("narrow", 20000, 1, optimizer="sgd", lr=1.0, seed=5)
        narrow = client.read_rows("narrow", np.arange(20000))
        np.testing.assert_array_equal(client.pull("narrow", np.arange(20000)).numpy(), narrow)
        # a dense tensor whose gradient fills most of a message still goes (the margin is counted, not guessed)
        linear = torch.nn.Linear(15000, 1, bias=False)
        client.register_dense(linear, optimizer="sgd", lr=0.5)
        weight = linear.weight.detach().clone()
        linear(torch.ones(1, 15000)).sum().backward()
        client.step()
        np.testing.assert_array_equal(linear.weight.detach().numpy(), (weight - 0.5).numpy())
    finally:
        client.close()


@pytest.mark.cluster
def test_inputs_that_failed_with_no_word_on_what_is_wrong_are_refused_naming_it_or_taken(shared_cluster):
    """Each of these failed far from the cause (``Value out of range: 9223372036854775808``, ``got ()`` for rows
    given as lists, ``too many values to unpack``, a bare ``NotImplementedError``) or, for bool ids of
    ``lookup_jagged``, was read as rows 0 and 1 (``EmbeddingBag`` refuses them)."""
    from ecrec.client import EmbeddingBagCollection

    local = shared_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    try:
        with pytest.raises(ValueError, match=r"table 'huge': num_rows must be in \[1, 2\*\*63\)"):
            cluster.create_table("huge", 2**63, 2)
        cluster.create_table("listed", 2, 2, init=[[1.0, 2.0], [3.0, 4.0]])  # rows as nested lists: taken
        np.testing.assert_array_equal(cluster.read_rows("listed", [0, 1]), [[1, 2], [3, 4]])
        cluster.write_rows("listed", [1], [[5.0, 6.0]])
        assert cluster.write_rows("listed", [], []) == 0  # nothing, as lists (it failed: shape (0,))
        np.testing.assert_array_equal(cluster.read_rows("listed", [0, 1]), [[1, 2], [5, 6]])
        with pytest.raises(ValueError, match="table 'listed': weights given as a list must be rows of numbers"):
            cluster.write_rows("listed", [0, 1], [[1.0], [2.0, 3.0]])
        np.testing.assert_array_equal(cluster.read_rows("listed", [0, 1]), [[1, 2], [5, 6]])  # nothing written
        cluster.create_table("other", 4, 2)
        ebc = EmbeddingBagCollection(cluster, ["listed", "other"])
        with pytest.raises(TypeError, match=r"the input of table 'listed' must be a pair \(indices, offsets\), got "
                                            "tuple of 3"):
            ebc([(torch.tensor([1]), torch.tensor([0]), torch.tensor([1.0])), (torch.tensor([1]), torch.tensor([0]))])
        with pytest.raises(TypeError, match="ids must be integers, got torch.bool"):
            ebc.lookup_jagged(["listed", "other"], torch.tensor([True, False]), torch.tensor([1, 0, 0, 1]))
        with pytest.raises(RuntimeError, match=r'"weight" \(cluster table .listed.\): a tensor on the meta device '
                                               "holds no data"):
            EmbeddingBag(cluster, "listed").load_state_dict({"weight": torch.ones(2, 2, device="meta")})
        np.testing.assert_array_equal(cluster.read_rows("listed", [0, 1]), [[1, 2], [5, 6]])
    finally:
        cluster.close()


@pytest.mark.cluster
def test_register_dense_refused_by_the_coordinator_partway_leaves_nothing_registered_here(shared_cluster):
    """A second model whose first layer matches a registered one and whose second does not: the coordinator
    refused the second layer after the first was registered, and the first stayed this worker's -- never loaded
    with the servers' values, its gradients pushed to tensors another model trained at the next step.  Its
    learning rate as a string or a bool (lr=True was 1.0) was taken where create_table refuses them."""
    from ecrec.client.dense_state import registered

    local = shared_cluster(servers=2, strategy="none")
    first, second = (Cluster.connect(local.coordinator_address) for _ in range(2))
    try:
        first.register_dense(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)), prefix="pd.", lr=0.1)
        other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # layer 1: another shape
        with pytest.raises(ClusterError, match="pd.1.weight.*ALREADY_EXISTS"):
            second.register_dense(other, prefix="pd.", lr=0.1)
        assert second._dense == {} and registered(other) == {}
        other(torch.randn(2, 4)).sum().backward()
        assert second.step()["rows"] == 0 and not second._dense  # nothing of it pushed
        for lr in ("0.1", True):
            with pytest.raises(ValueError, match=f"register_dense: lr must be a number, got {lr!r}"):
                second.register_dense(torch.nn.Linear(2, 1), prefix="pl.", lr=lr)
        assert not any(d.name.startswith("pl.") for d in second.refresh_map().dense)
        # a module registered before and registered again in a call refused partway stays registered
        mine = torch.nn.Sequential(torch.nn.Linear(4, 3))
        assert second.register_dense(mine, prefix="pk.", lr=0.1) == ["pk.0.weight", "pk.0.bias"]
        first.register_dense(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)), prefix="pk.", lr=0.1)
        grown = torch.nn.Sequential(mine[0], torch.nn.Linear(3, 2))  # pk.0.* again (harmless), pk.1.* refused
        with pytest.raises(ClusterError, match="pk.1.weight.*ALREADY_EXISTS"):
            second.register_dense(grown, prefix="pk.", lr=0.1)
        assert sorted(second._dense) == ["pk.0.bias", "pk.0.weight"]  # the earlier call's stay this worker's
        assert sorted(registered(mine)) == ["0.bias", "0.weight"]
    finally:
        first.close()
        second.close()


@pytest.mark.cluster
def test_a_frozen_module_records_no_gradient_and_its_own_zero_grad_drops_what_it_recorded(shared_cluster):
    """An SDK module has no parameters, so requires_grad_(False) froze nothing: its lookups went on recording
    gradients and the next step trained the table.  Its zero_grad() dropped nothing either."""
    from ecrec.client import EmbeddingBagCollection

    local = shared_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    try:
        cluster.create_table("frozen_t", 50, 4, optimizer="sgd", lr=1.0)
        emb = EmbeddingBag(cluster, "frozen_t")
        before = cluster.read_table("frozen_t").copy()
        assert emb.requires_grad_(False) is emb
        out = emb(torch.tensor([1, 2]), torch.tensor([0]))
        assert not out.requires_grad
        torch.nn.Linear(4, 1)(out).sum().backward()
        cluster.step()
        assert np.array_equal(cluster.read_table("frozen_t"), before), "a frozen table trained"
        emb.requires_grad_(True)
        emb(torch.tensor([3]), torch.tensor([0])).sum().backward()
        emb.zero_grad()  # as a torch module's: this batch's gradient is dropped
        emb(torch.tensor([4]), torch.tensor([0])).sum().backward()
        cluster.step()
        after = cluster.read_table("frozen_t")
        assert np.array_equal(after[3], before[3]) and np.allclose(after[4], before[4] - 1.0)
        both = EmbeddingBagCollection(cluster, ["frozen_t"]).requires_grad_(False)
        assert not both([(torch.tensor([5]), torch.tensor([0]))])[0].requires_grad
        from ecrec.client import modules  # the lookup stays a graph break under torch.compile
        assert getattr(modules._lookup, "_torchdynamo_disable", False)
    finally:
        cluster.close()


@pytest.mark.cluster
def test_module_inputs_that_failed_far_from_their_cause_are_refused_naming_it(shared_cluster):
    """An address where the Cluster belongs (an AttributeError), one string of feature names (list('f1') was two
    features), an unsigned id past int64 (reported as id -1), a URL as the coordinator, an empty address."""
    from ecrec.client import EmbeddingBagCollection

    local = shared_cluster(servers=2, strategy="none")
    with pytest.raises(TypeError, match="EmbeddingBag: cluster must be a connected ecrec.client.Cluster"):
        EmbeddingBag(local.coordinator_address, "t")
    with pytest.raises(ValueError, match="host:port, not a URL"):
        Cluster.connect(f"http://{local.coordinator_address}")
    with pytest.raises(ValueError, match="address must be a coordinator's host:port"):
        Cluster.connect("  ")
    from ecrec.net.peers import coordinator_stub  # gRPC's own target names stay taken, as before

    for target in ("dns:///127.0.0.1:7000", "ipv4:127.0.0.1:7000", "[::1]:7000"):
        coordinator_stub(target)
    with pytest.raises(ValueError, match=r"in brackets before its port \(\[ADDRESS\]:PORT, e.g. \[::1\]:7000\)"):
        coordinator_stub("2001:db8::7000")  # no sure split into an address and a port
    cluster = Cluster.connect(local.coordinator_address)
    try:
        cluster.create_table("jag_t", 10, 4)
        with pytest.raises(TypeError, match="names must be a list of table names, not one string"):
            EmbeddingBagCollection(cluster, "jag_t")
        ebc = EmbeddingBagCollection(cluster, ["jag_t"])
        with pytest.raises(TypeError, match="keys must be a list of feature names, not one string"):
            ebc.lookup_jagged("jag_t", torch.tensor([1]), torch.tensor([1]))
        with pytest.raises(IndexError, match="row id 18446744073709551615 out of range"):
            ebc.lookup_jagged(["jag_t"], torch.tensor([2**64 - 1], dtype=torch.uint64), torch.tensor([1]))
        assert ebc.lookup_jagged(["jag_t"], torch.tensor([9], dtype=torch.uint64), torch.tensor([1]))["jag_t"].shape \
            == (1, 4)
    finally:
        cluster.close()


@pytest.mark.cluster
def test_calls_that_hung_overwrote_or_failed_far_away_refuse_their_input_and_change_nothing(shared_cluster, tmp_path):
    """Found by a review: ``strategy_call`` to index 2 of two servers waited two minutes for a server that cannot
    come (after running on index 0); ``save(overwrite="false")`` replaced the snapshot there; ``wait_confirmed(nan)``
    never ended while a push waited; ``pull_dense("abc")`` read three names, and a name not registered raised a
    bare KeyError from the reply."""
    local = shared_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address, worker="review-inputs")
    try:
        for bad, error in (([0, 2], ValueError), ([-1], ValueError), ([True], TypeError), (["0"], TypeError),
                           ("01", TypeError), (0, TypeError)):
            with pytest.raises(error, match="strategy_call: "):
                cluster.strategy_call("no-such-command", indices=bad)
        for bad in (float("nan"), None, "5", -1.0, True):
            with pytest.raises(ValueError, match="wait_confirmed: timeout_s must be a number of seconds"):
                cluster.wait_confirmed(bad)
        assert cluster.wait_confirmed(math.inf) == cluster.wait_confirmed(1e300) == 0  # nothing waits: at once
        cluster.create_table("review-kept", 4, 2, init=np.zeros((4, 2), np.float32))
        path = tmp_path / "snap"
        cluster.save(str(path))
        files = {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()}
        cluster.write_rows("review-kept", [0], [[9.0, 9.0]])
        for bad in ("false", "no", 1, None):
            with pytest.raises(ValueError, match="save: overwrite must be True or False"):
                cluster.save(str(path), overwrite=bad)
        assert {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()} == files  # not written again
        with pytest.raises(TypeError, match="pull_dense: names must be a list of names, not the string 'abc'"):
            cluster.pull_dense("abc")
        with pytest.raises(ValueError, match="pull_dense: 'w' not registered by this client"):
            cluster.pull_dense(["w"])
        cluster.pull_dense([])  # nothing asked: nothing done
    finally:
        cluster.close()
