"""Who may call what: mutual TLS, a shared token, and the roles that guard the control and parity planes.

Every process of a cluster takes the same three options (``Security``): ``--tls-cert``/``--tls-key``/
``--tls-ca`` turn every port (servers, their health ports, the coordinator) into TLS ports that demand a
client certificate signed by the CA, and every channel a process opens presents its own certificate;
``--token-file`` adds (or, without TLS, replaces) a shared secret that every call carries as
``authorization: Bearer <token>`` and every server checks.  Neither is on by default: a cluster bound to
loopback (the default) needs none, and binding another address without either prints a warning.

Roles come from the certificate's common name: ``ecrec-coordinator`` is the coordinator,
``ecrec-server`` (or ``ecrec-server-<anything>``) a server, any other name the CA signed a client.  With
TLS on, only the coordinator may send maps, promote or create shards on a server
(:data:`COORDINATOR_ONLY`), and only servers may call the parity plane or register, renew a lease and
report redundancy or data loss (:data:`SERVER_ONLY`).  A token alone proves membership of the cluster, not
a role: every holder is trusted with every method.

Clients use it through ``ClientConfig.security`` (``ecrec.client.Cluster``); servers and the coordinator
through their configs; channels and ports are made by :func:`secure_channel` and :func:`bind`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import re
from dataclasses import dataclass, field

import grpc

from ecrec.net.refusals import REFUSALS

log = logging.getLogger("ecrec.security")

COORDINATOR_ROLE = "ecrec-coordinator"
SERVER_ROLE = "ecrec-server"

#: methods only the coordinator may call (full gRPC method names)
COORDINATOR_ONLY = frozenset({
    "/ecrec.wire.EmbeddingServer/UpdateClusterMap",
    "/ecrec.wire.EmbeddingServer/Promote",
    "/ecrec.wire.EmbeddingServer/CreateTable",
    "/ecrec.wire.EmbeddingServer/CreateDense",
})
#: methods (or whole services, ending in "/") only servers may call
SERVER_ONLY = frozenset({
    "/ecrec.wire.ParityService/",
    "/ecrec.wire.Coordinator/Register",
    "/ecrec.wire.Coordinator/RenewLease",
    "/ecrec.wire.Coordinator/ReportRedundant",
    "/ecrec.wire.Coordinator/ReportDataLoss",
})
#: methods anyone who reaches the port may call (liveness)
OPEN = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class SecurityError(ValueError):
    """A security option is unusable (a file missing or unreadable, a key without a certificate, ...)."""


@dataclass(frozen=True)
class Security:
    """The transport security of one process (see the module docstring)."""

    tls_cert: str | None = None  # PEM certificate this process presents
    tls_key: str | None = None  # its private key
    tls_ca: str | None = None  # the CA that signed every process's certificate
    token_file: str | None = None  # a file holding the shared secret
    _loaded: dict = field(default_factory=dict, repr=False, compare=False, metadata={"cli": False})

    def __post_init__(self) -> None:
        given = [n for n in ("tls_cert", "tls_key", "tls_ca") if getattr(self, n)]
        if given and len(given) != 3:
            missing = sorted({"tls_cert", "tls_key", "tls_ca"} - set(given))
            raise SecurityError("mutual TLS needs --tls-cert, --tls-key and --tls-ca together; missing "
                                + ", ".join("--" + m.replace("_", "-") for m in missing))
        for name in ("tls_cert", "tls_key", "tls_ca", "token_file"):
            path = getattr(self, name)
            if path:
                try:
                    with open(path, "rb") as f:
                        self._loaded[name] = f.read()
                        mode = os.fstat(f.fileno()).st_mode
                except OSError as exc:
                    raise SecurityError(f"--{name.replace('_', '-')} {path}: {exc.strerror or exc}") from None
                if name in ("tls_key", "token_file") and mode & 0o077:  # a secret others on the host can read
                    log.warning("--%s %s can be read by group or others (mode %o): chmod 600 it", name.replace("_", "-"),
                                path, mode & 0o777)
        if self.tls_cert:
            self._check_tls_files()
        if self.token_file:
            token = self._loaded["token_file"].strip()
            if not token:
                raise SecurityError(f"--token-file {self.token_file} is empty")
            if any(c < 0x21 or c > 0x7E for c in token):
                raise SecurityError(f"--token-file {self.token_file}: the token must be printable ASCII without spaces")
            self._loaded["token"] = token.decode("ascii")

    def _check_tls_files(self) -> None:
        """SecurityError naming the file when the certificate, its key or the CA is no PEM gRPC can use, or the key
        is not the certificate's (gRPC itself says only "Failed to bind" on a server, and a client's handshake
        fails at every call, read as an unreachable coordinator)."""
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        # the files as gRPC's own TLS takes them: not this host's OpenSSL policy on key sizes and digests
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key, password=lambda: b"")
        except ssl.SSLError as exc:
            raise SecurityError(f"--tls-cert {self.tls_cert} with --tls-key {self.tls_key}: not a PEM certificate and "
                                f"the unencrypted PEM private key that goes with it ({exc.reason or exc})") from None
        try:
            context.load_verify_locations(cafile=self.tls_ca)
        except ssl.SSLError as exc:
            raise SecurityError(f"--tls-ca {self.tls_ca}: no PEM CA certificate in it ({exc.reason or exc})") from None

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def token(self) -> str | None:
        return self._loaded.get("token")

    @property
    def enabled(self) -> bool:
        return self.tls or self.token is not None


NO_SECURITY = Security()


# --- channels ---------------------------------------------------------------------------------------------------
class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, getattr(details, "compression", None)
        self.metadata = metadata


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        return _CallDetails(details, list(details.metadata or ()) + [self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def secure_channel(address: str, options: list, security: Security | None) -> grpc.Channel:
    """A channel to ``address``: TLS with this process's certificate when ``security.tls``, the token on
    every call when ``security.token``, a plain channel otherwise."""
    security = security or NO_SECURITY
    if security.tls:
        creds = grpc.ssl_channel_credentials(root_certificates=security._loaded["tls_ca"],
                                             private_key=security._loaded["tls_key"],
                                             certificate_chain=security._loaded["tls_cert"])
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security.token is not None:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(security.token))
    return channel


# --- ports --------------------------------------------------------------------------------------------------------
_warned_hosts: set[str] = set()


def bind(server: grpc.Server, host: str, port: int, security: Security | None) -> int:
    """Binds ``host:port`` (port 0: any free port) with TLS when configured; returns the port or raises
    ``OSError`` naming the address.  Warns when a non-loopback address is bound without TLS or a token."""
    security = security or NO_SECURITY
    if not security.enabled and not is_loopback(host) and host not in _warned_hosts:
        _warned_hosts.add(host)  # once per address and process (a server binds its data and health ports)
        log.warning("binding %s without --tls-cert/--tls-key/--tls-ca or --token-file: anyone who reaches this "
                    "port can read and change the model and its parity", host)
    try:
        if security.tls:
            creds = grpc.ssl_server_credentials([(security._loaded["tls_key"], security._loaded["tls_cert"])],
                                                root_certificates=security._loaded["tls_ca"],
                                                require_client_auth=True)
            bound = server.add_secure_port(f"{host}:{port}", creds)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # gRPC says only "Failed to bind"
        raise OSError(f"cannot bind {host}:{port}: in use (another process serves it) or not a local address "
                      f"({exc})") from exc
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port} (in use or not a local address)")
    return bound


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# --- checking callers -------------------------------------------------------------------------------------------
def role_of(context) -> str | None:
    """The role of an authenticated TLS peer (``ecrec-coordinator``, ``ecrec-server`` or ``client``), or None
    when the call did not come over TLS."""
    auth = context.auth_context() if hasattr(context, "auth_context") else {}
    names = auth.get("x509_common_name") or []
    if not names:
        return None
    if _common_names_in_subject(auth) > 1:
        # gRPC names one of them (the first): a subject "CN=ecrec-coordinator, CN=worker" that a CA checking the
        # last CN issued to a worker acted as the coordinator.  Ambiguous: no privileged role
        return "client"
    name = names[0].decode() if isinstance(names[0], bytes) else str(names[0])
    if name == COORDINATOR_ROLE:
        return COORDINATOR_ROLE
    if name == SERVER_ROLE or name.startswith(SERVER_ROLE + "-"):
        return SERVER_ROLE
    return "client"


def _common_names_in_subject(auth) -> int:
    """How many CN attributes the peer certificate's subject holds (``x509_subject``, RFC 2253: attributes apart
    by ``,`` or ``+``, escaped ones inside values)."""
    subject = (auth.get("x509_subject") or [b""])[0]
    subject = subject.decode("utf-8", "replace") if isinstance(subject, bytes) else str(subject)
    return sum(1 for part in re.split(r"(?<!\\)[,+]", subject) if part.strip().upper().startswith("CN="))


def caller_identity(context) -> str:
    """What an authenticated TLS caller proved: its certificate's common name and subject alternative names,
    joined ("" when the call did not come over TLS).  The servers hash it into the caller's push ids
    (:func:`ecrec.strategies.base.push_key`), so a push id made under one certificate is nobody's under
    another.  Names, not the certificate's bytes: a renewed certificate for the same names is the same
    caller."""
    auth = context.auth_context() if context is not None and hasattr(context, "auth_context") else {}
    parts = []
    for prop in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(prop) or []:
            parts.append(prop + "=" + (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)))
    return "\n".join(parts)


def required_role(method: str) -> str | None:
    if method in COORDINATOR_ONLY:
        return COORDINATOR_ROLE
    if method in SERVER_ONLY or any(p.endswith("/") and method.startswith(p) for p in SERVER_ONLY):
        return SERVER_ROLE
    return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call against the process's :class:`Security`: the token (UNAUTHENTICATED when absent or
    wrong) and, with TLS, the caller's role (PERMISSION_DENIED naming the method and the role it needs).
    Health checks are open."""

    def __init__(self, security: Security):
        self.security = security

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method in OPEN:
            return handler
        sec = self.security
        if sec.token is not None:
            meta = dict(details.invocation_metadata or ())
            given = meta.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {sec.token}".encode()):
                why = "no token" if not given else "a wrong token"
                return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED,
                               f"{details.method}: the call carries {why}; pass --token-file (the cluster's shared "
                               "token)")
        role = required_role(details.method) if sec.tls else None
        if role is None:
            return handler
        return _guard(handler, role, details.method)


def _wrap(handler, make):
    kinds = [("unary_unary", grpc.unary_unary_rpc_method_handler), ("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler),
             ("stream_stream", grpc.stream_stream_rpc_method_handler)]
    for attr, factory in kinds:
        fn = getattr(handler, attr)
        if fn is not None:
            return factory(make(fn), request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    return handler


def _refuse(handler, code, message):
    def make(_fn):
        def refuse(request, context):
            REFUSALS.add(message.split(":", 1)[0].rsplit("/", 1)[-1], code)
            context.abort(code, message)
        return refuse
    return _wrap(handler, make)


def _guard(handler, role: str, method: str):
    def make(fn):
        def guarded(request, context):
            caller = role_of(context)
            if caller != role:
                REFUSALS.add(method.rsplit("/", 1)[-1], grpc.StatusCode.PERMISSION_DENIED)
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"{method} may be called only by the {role.replace('ecrec-', '')} (certificate common "
                              f"name {role}{'[-*]' if role == SERVER_ROLE else ''}); the caller is {caller or 'unknown'}")
            return fn(request, context)
        return guarded
    return _wrap(handler, make)


def interceptors(security: Security | None) -> tuple:
    """The server interceptors for ``security`` (none when it is off)."""
    return (AuthInterceptor(security),) if security is not None and security.enabled else ()


def tls_hint(exc: grpc.RpcError, security) -> str:
    """A word on TLS when the connection ended in its handshake: a plain client at a TLS port sees its socket
    closed, a TLS client at a plain port a handshake error."""
    details = (exc.details() or "").lower()
    tls = security is not None and getattr(security, "tls", False)
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    if not tls and "socket closed" in details:
        return (" (a cluster with TLS closes plain connections: if it uses TLS, pass --tls-ca, --tls-cert and --tls-key;"
                " in the SDK, ClientConfig's tls_ca, tls_cert and tls_key)")
    if tls and ("handshake" in details or "ssl" in details or "tls" in details):
        return " (the TLS handshake failed: a cluster without TLS, or a CA or certificate it does not take)"
    return ""
