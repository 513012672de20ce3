"""Authentication and roles: mutual TLS on every port, a shared token, and who may call what.

Certificates are made at run time with ``trustme`` (one CA; common names ``ecrec-server``,
``ecrec-coordinator`` and a client's).  Real processes on 127.0.0.1.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import torch

from ecrec.net import security, transport
from ecrec.client import Cluster, EmbeddingBag
from ecrec.config import ClientConfig
from ecrec.wire import (cluster_pb2, coordinator_pb2, coordinator_pb2_grpc, embedding_pb2, embedding_pb2_grpc,
                        parity_pb2, parity_pb2_grpc)
from helpers import issue

trustme = pytest.importorskip("trustme")


@pytest.fixture
def pki(tmp_path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return ca, tmp_path


def train_a_little(client: Cluster, steps: int = 5) -> None:
    bag = EmbeddingBag(client, "t")
    for step in range(steps):
        ids = torch.tensor([[step % 40, (step * 7) % 40]])
        bag(ids).sum().backward()
        client.step()


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


# --- options ------------------------------------------------------------------------------------------------------
def test_options_name_what_is_wrong(tmp_path):
    with pytest.raises(security.SecurityError, match="missing --tls-ca, --tls-key"):
        security.Security(tls_cert=str(tmp_path / "x.pem"))
    with pytest.raises(security.SecurityError, match=r"--token-file .*missing"):
        security.Security(token_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(security.SecurityError, match="is empty"):
        security.Security(token_file=str(tmp_path / "empty"))
    (tmp_path / "spaced").write_text("two words")
    with pytest.raises(security.SecurityError, match="printable ASCII"):
        security.Security(token_file=str(tmp_path / "spaced"))
    assert not ClientConfig().security.enabled


def test_exposed_addresses_are_recognized():
    assert security.is_loopback("127.0.0.1") and security.is_loopback("::1") and security.is_loopback("localhost")
    assert not security.is_loopback("0.0.0.0") and not security.is_loopback("10.1.2.3")
    assert not security.is_loopback("")


def test_the_command_line_refuses_an_unusable_certificate(tmp_path):
    from ecrec.cli import main

    rc = main(["coordinator", "--port", "0", "--servers", "2", "--tls-cert", str(tmp_path / "nope.pem"),
               "--tls-key", str(tmp_path / "nope.key"), "--tls-ca", str(tmp_path / "ca.pem")])
    assert rc == 2


def test_a_key_that_is_not_the_certificates_or_a_ca_file_without_a_certificate_is_named(pki):
    """A mismatched key or a CA file holding no PEM was found by gRPC only: a server said its port was "in use
    (another process serves it)", a client read every handshake failure as an unreachable coordinator and
    waited out its minute.  Now the options refuse them, naming the files."""
    import subprocess
    import sys

    ca, tmp = pki
    one, other = ca.issue_cert("ecrec-server"), ca.issue_cert("ecrec-server")
    one.cert_chain_pems[0].write_to_path(str(tmp / "one.pem"))
    one.private_key_pem.write_to_path(str(tmp / "one.key"))
    other.private_key_pem.write_to_path(str(tmp / "other.key"))
    (tmp / "garbage.pem").write_text("not a certificate\n")
    assert security.Security(str(tmp / "one.pem"), str(tmp / "one.key"), str(tmp / "ca.pem")).tls
    with pytest.raises(security.SecurityError, match=r"--tls-cert .*one.pem with --tls-key .*other.key: not a PEM "
                                                     r"certificate and the unencrypted PEM private key"):
        security.Security(str(tmp / "one.pem"), str(tmp / "other.key"), str(tmp / "ca.pem"))
    with pytest.raises(security.SecurityError, match=r"--tls-ca .*garbage.pem: no PEM CA certificate in it"):
        security.Security(str(tmp / "one.pem"), str(tmp / "one.key"), str(tmp / "garbage.pem"))
    with pytest.raises(security.SecurityError, match=r"--tls-cert .*one.key with --tls-key .*one.pem"):
        security.Security(str(tmp / "one.key"), str(tmp / "one.pem"), str(tmp / "ca.pem"))  # swapped
    run = subprocess.run([sys.executable, "-m", "ecrec.cli", "coordinator", "--port", "0", "--servers", "2",
                          "--tls-cert", str(tmp / "one.pem"), "--tls-key", str(tmp / "other.key"),
                          "--tls-ca", str(tmp / "ca.pem")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "other.key" in run.stderr and "in use" not in run.stderr, run.stderr


def test_a_certificate_grpc_takes_is_not_refused_by_this_hosts_openssl_policy(tmp_path):
    """The files are checked with Python's ssl, whose OpenSSL refuses (by this host's security level) a 1024-bit
    RSA key or a SHA-1 signature that gRPC's own TLS takes: the check must not stop a cluster gRPC would run."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ecrec-server")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    (tmp_path / "weak.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "weak.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.TraditionalOpenSSL,
                                                          serialization.NoEncryption()))
    weak = security.Security(str(tmp_path / "weak.pem"), str(tmp_path / "weak.key"), str(tmp_path / "weak.pem"))
    assert weak.tls
    creds = grpc.ssl_server_credentials([(weak._loaded["tls_key"], weak._loaded["tls_cert"])],
                                        root_certificates=weak._loaded["tls_ca"], require_client_auth=True)
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        assert server.add_secure_port("127.0.0.1:0", creds) > 0  # gRPC takes them
    finally:
        server.stop(0)


# --- mutual TLS -----------------------------------------------------------------------------------------------------
@pytest.mark.cluster
def test_mutual_tls_cluster_trains_and_enforces_roles(make_cluster, pki):
    ca, d = pki
    srv, coord, alice = issue(ca, d, "ecrec-server"), issue(ca, d, "ecrec-coordinator"), issue(ca, d, "alice")
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_security=srv, coordinator_security=coord,
                         client_security=alice, options={"coalesce_pushes": "2"})
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(**alice))
    client.create_table("t", 40, 4, optimizer="sgd", lr=1.0)
    train_a_little(client)
    before = client.read_payload("t")[1].copy()
    verify = client.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values()) and sum(v["checked"] for v in verify.values()) > 0
    # on TLS there are no parity channels: small groups ride the worker, sealed (relay=auto)
    assert sum(s.get("relay_batches", 0) for s in client.strategy_call("stats").values()) > 0

    server = client.map.servers[0]
    alice_sec = ClientConfig(**alice).security
    emb = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(server.address, security=alice_sec))
    par = parity_pb2_grpc.ParityServiceStub(transport.make_channel(server.address, security=alice_sec))
    coo = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(local.coordinator_address, security=alice_sec))
    hostile_map = cluster_pb2.ClusterMap()
    hostile_map.CopyFrom(client.map)
    hostile_map.epoch = 10 ** 6
    for call, what in [
        (lambda: emb.UpdateClusterMap(hostile_map, timeout=5), "coordinator"),
        (lambda: emb.Promote(embedding_pb2.PromoteRequest(index=0, map=hostile_map), timeout=5), "coordinator"),
        (lambda: emb.CreateTable(cluster_pb2.TableSpec(name="x", num_rows=4, dim=2, optimizer="sgd", lr=0.1),
                                 timeout=5), "coordinator"),
        (lambda: par.ApplyParity(parity_pb2.ParityBatches(source=1, source_id="stranger"), timeout=5), "server"),
        (lambda: par.ResolveSource(parity_pb2.ResolveSourceRequest(source=1, commit=True), timeout=5), "server"),
        (lambda: coo.Register(coordinator_pb2.RegisterRequest(address=server.address, server_id="evil"), timeout=5),
         "server"),
    ]:
        code, details = code_of(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert f"only by the {what}" in details and "the caller is client" in details, details
    # nothing changed: same map epoch everywhere, same rows, parity still consistent
    assert client.refresh_map().epoch < 10 ** 6
    assert all(s.state == cluster_pb2.ACTIVE for s in client.map.servers)
    np.testing.assert_array_equal(client.read_payload("t")[1].view(np.uint32), before.view(np.uint32))
    verify = client.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values())

    # a plain channel, or a certificate from another CA, does not get through at all
    plain = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(server.address))
    code, _ = code_of(lambda: plain.Echo(embedding_pb2.EchoMessage(data=b"x"), timeout=3))
    assert code == grpc.StatusCode.UNAVAILABLE
    other_ca = trustme.CA()
    other_dir = d / "other"
    other_dir.mkdir()
    other_ca.cert_pem.write_to_path(str(other_dir / "ca.pem"))
    mallory = issue(other_ca, other_dir, "ecrec-coordinator")
    mallory["tls_ca"] = str(d / "ca.pem")  # trusts our CA, but its own certificate is not ours
    stranger = embedding_pb2_grpc.EmbeddingServerStub(
        transport.make_channel(server.address, security=ClientConfig(**mallory).security))
    code, _ = code_of(lambda: stranger.UpdateClusterMap(hostile_map, timeout=3))
    assert code == grpc.StatusCode.UNAVAILABLE  # the handshake fails
    assert client.refresh_map().epoch < 10 ** 6
    # the status command speaks TLS too (exit 0: fully redundant)
    from ecrec.cli import main

    flags = [a for k, v in alice.items() for a in ("--" + k.replace("_", "-"), v)]
    assert main(["status", "--coordinator", local.coordinator_address, "--json", *flags]) == 0
    assert main(["status", "--coordinator", local.coordinator_address, "--json", "--timeout", "3"]) == 2  # no TLS
    from ecrec.ops import status

    with pytest.raises(status.CoordinatorUnreachable, match="a cluster with TLS closes plain connections: if it "
                                                            "uses TLS, pass --tls-ca, --tls-cert and --tls-key"):
        status.collect(local.coordinator_address, timeout_s=3)  # (said only 'Socket closed' before)
    # so do snapshot and restore (and the SDK's Cluster.connect they use): they said "the coordinator does not
    # answer (Socket closed)" after their whole wait
    import contextlib
    import io

    for command in ("snapshot", "restore"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main([command, "--coordinator", local.coordinator_address, "--wait", "2", "--timeout", "3",
                         str(d / "snap")])
        assert code == 1 and "if it uses TLS, pass --tls-ca, --tls-cert and --tls-key" in err.getvalue(), err.getvalue()


# --- token ------------------------------------------------------------------------------------------------------------
@pytest.mark.cluster
def test_a_server_whose_token_the_coordinator_refuses_or_does_not_check_fails_at_once(tmp_path):
    """A wrong token: ``serve`` retried its map read for its whole registration minute, a warning every 0.2 s.
    A token the coordinator does not check (started without one): the servers registered, ``status`` said fully
    redundant, and every table creation failed UNAUTHENTICATED.  Now both end ``serve`` at once, saying why."""
    import select
    import signal
    import subprocess
    import sys

    (tmp_path / "a").write_text("token-a\n")
    (tmp_path / "b").write_text("token-b\n")
    cli = [sys.executable, "-m", "ecrec.cli", "--log-level", "WARNING"]
    coordinators = []
    try:
        addresses = []
        for token in (["--token-file", str(tmp_path / "a")], []):
            proc = subprocess.Popen([*cli, "coordinator", "--port", "0", "--servers", "1", *token],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            coordinators.append(proc)
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline() if ready else ""
            assert line.startswith("ECREC_COORDINATOR "), line
            addresses.append(line.split()[1])
        for address, why in ((addresses[0], "refuses this server: UNAUTHENTICATED"),
                             (addresses[1], "answers calls without the token this server was given")):
            run = subprocess.run([*cli, "serve", "--coordinator", address, "--token-file", str(tmp_path / "b")],
                                 capture_output=True, text=True, timeout=50)
            assert run.returncode == 2 and why in run.stderr, run.stderr[-2000:]
            assert run.stderr.count("WARNING") <= 1, run.stderr[-2000:]
    finally:
        for proc in coordinators:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


@pytest.mark.cluster
def test_token_cluster_refuses_calls_without_the_token(make_cluster, tmp_path):
    (tmp_path / "token").write_text("s3cret-token\n")
    (tmp_path / "wrong").write_text("not-it")
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_security={"token_file": str(tmp_path / "token")})
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(token_file=str(tmp_path / "token")))
    client.create_table("t", 40, 4, optimizer="sgd", lr=1.0)
    train_a_little(client)
    before = client.read_payload("t")[1].copy()

    server = client.map.servers[1]
    for label, sec in [("no token", None), ("wrong", ClientConfig(token_file=str(tmp_path / "wrong")).security)]:
        emb = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(server.address, security=sec))
        ids = np.array([0, 1], np.int64)
        push = embedding_pb2.PushRequest(
            tables=[embedding_pb2.TableGrads(table="t", ids=transport.ids_to_bytes(ids),
                                             grads=np.ones((2, 4), np.float32).tobytes())],
            push_id=embedding_pb2.PushId(worker="intruder", sequence=1))
        code, details = code_of(lambda: emb.Push(push, timeout=5))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "--token-file" in details, (label, code, details)
        coo = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(local.coordinator_address, security=sec))
        code, _ = code_of(lambda: coo.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=5))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    np.testing.assert_array_equal(client.read_payload("t")[1].view(np.uint32), before.view(np.uint32))
    # health checks stay open (liveness probes carry no secret)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(transport.make_channel(server.health_address))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING

    # what `ecrec-server local --token-file` prints works as printed: the snippet connects, the status line answers
    import shlex
    import subprocess
    import sys

    from ecrec.cli import ready_message

    text = ready_message(local.coordinator_address, None, str(tmp_path / "token"))
    code = [line[4:] for line in text.splitlines() if line.startswith("    ") and ("import" in line or "connect" in line)]
    scope: dict = {}
    exec("\n".join(code), scope)
    assert scope["cluster"].map.ready
    scope["cluster"].close()
    [status_line] = [line for line in text.splitlines() if line.startswith("Cluster state: ")]
    argv = shlex.split(status_line.split(": ", 1)[1])
    assert argv[0] == "ecrec-server"
    r = subprocess.run([sys.executable, "-m", "ecrec.cli", *argv[1:]], capture_output=True, text=True, timeout=60)
    assert r.returncode in (0, 1) and "UNAUTHENTICATED" not in r.stderr, r.stderr


def test_binding_a_non_loopback_address_without_tls_or_token_warns_once(tmp_path, caplog):
    """The warning names the address, once per address and process (a server binds two ports there); loopback
    and an authenticated bind say nothing.  The non-loopback address is a bridge this test creates."""
    from concurrent import futures

    from netlab import NetLab

    ok, why = NetLab.available()
    if not ok:
        pytest.skip(f"needs a test network for a non-loopback address: {why}")
    lab = NetLab()
    servers = [grpc.server(futures.ThreadPoolExecutor(1)) for _ in range(4)]
    try:
        token = tmp_path / "token"
        token.write_text("s3cret-token")
        with caplog.at_level("WARNING", logger="ecrec.security"):
            security.bind(servers[0], "127.0.0.1", 0, None)
            assert not [r for r in caplog.records if "anyone who reaches" in r.getMessage()]
            security.bind(servers[1], lab.bridge_ip, 0, security.Security(token_file=str(token)))
            assert not [r for r in caplog.records if "anyone who reaches" in r.getMessage()]
            security.bind(servers[2], lab.bridge_ip, 0, None)
            security.bind(servers[3], lab.bridge_ip, 0, None)
        warnings = [r.getMessage() for r in caplog.records if "anyone who reaches" in r.getMessage()]
        assert len(warnings) == 1 and lab.bridge_ip in warnings[0] and "--token-file" in warnings[0]
    finally:
        for s in servers:
            s.stop(0)
        lab.close()


def _issue_with_names(ca, directory, names: list[str], stem: str) -> dict:
    """A certificate of ``ca`` whose subject holds every one of ``names`` as a CN, in that order."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, n) for n in names]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                              serialization.PrivateFormat.TraditionalOpenSSL,
                                                              serialization.NoEncryption()))
    os.chmod(directory / f"{stem}.key", 0o600)
    return {"tls_cert": str(directory / f"{stem}.pem"), "tls_key": str(directory / f"{stem}.key"),
            "tls_ca": str(directory / "ca.pem")}


@pytest.mark.cluster
def test_a_certificate_with_two_common_names_gets_no_privileged_role(make_cluster, pki):
    """gRPC names one CN of a subject, the first: a certificate 'CN=ecrec-coordinator, CN=worker' (a CA that
    checks the last CN issues it to a worker) sent maps and promoted standbys as the coordinator."""
    ca, d = pki
    srv, coord, alice = issue(ca, d, "ecrec-server"), issue(ca, d, "ecrec-coordinator"), issue(ca, d, "alice")
    local = make_cluster(servers=2, strategy="none", server_security=srv, coordinator_security=coord,
                         client_security=alice)
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(**alice))
    try:
        for names in (["ecrec-coordinator", "worker"], ["ecrec-server", "worker"]):
            two = ClientConfig(**_issue_with_names(ca, d, names, "-".join(names))).security
            server = client.map.servers[0]
            emb = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(server.address, security=two))
            code, details = code_of(lambda: emb.UpdateClusterMap(client.map, timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "the caller is client" in details, (names, details)
            coo = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(local.coordinator_address, security=two))
            code, details = code_of(lambda: coo.Register(coordinator_pb2.RegisterRequest(
                address=server.address, server_id="evil"), timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "the caller is client" in details, (names, details)
            # as a worker it works: a table read
            assert coo.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=5).epoch > 0
    finally:
        client.close()


def test_a_token_or_key_others_can_read_is_named_in_a_warning(tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-the-cluster")
    os.chmod(token, 0o644)
    with caplog.at_level("WARNING", logger="ecrec.security"):
        security.Security(token_file=str(token))
    assert f"--token-file {token} can be read by group or others (mode 644): chmod 600 it" in caplog.text
    caplog.clear()
    os.chmod(token, 0o600)
    with caplog.at_level("WARNING", logger="ecrec.security"):
        security.Security(token_file=str(token))
    assert "can be read" not in caplog.text
