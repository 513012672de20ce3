"""Configuration: one typed dataclass per process kind, each field documented once.

``ClusterSpec`` is fixed when the coordinator starts and handed to every server that registers
(the layout is a pure function of it); ``ServerConfig``, ``CoordinatorConfig`` and
``ClientConfig`` hold per-process settings such as time-outs.  Every field carries its help
text (and, where the command line spells it differently, its flag) in its metadata, and the
``ecrec-server`` command line is built from these fields by :func:`add_arguments`, so a knob
exists in one place.  Strategy options are typed the same way, by each strategy's spec
(``ecrec.strategies.spec``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


def option(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
           cli: bool = True, default_factory: Any = None) -> Any:
    """A documented dataclass field; ``flag`` overrides the command-line spelling, ``cli=False`` keeps
    it off the command line."""
    metadata = {"help": help, "flag": flag, "choices": choices, "cli": cli}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


REQUIRED = dataclasses.MISSING


@dataclass(frozen=True)
class ClusterSpec:
    """What every process of one cluster agrees on."""

    num_servers: int = option(REQUIRED, "number of active embedding servers in the cluster", flag="--servers")
    strategy: str = option("none", "fault-tolerance strategy by name (entry-point group ecrec.strategies)")
    k: int = option(0, "data rows per stripe (erasure-coding strategies need it >= 1; 0: no stripes)")
    m: int = option(0, "parity rows per stripe = failures survived (erasure-coding strategies need it >= 1; 0: no "
                       "parity)")
    strategy_options: dict = option(None, "strategy options as KEY=VALUE strings", flag="--option",
                                    default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")
        if self.num_servers > MAX_SERVERS:
            raise ValueError(f"--servers {self.num_servers:,}: at most {MAX_SERVERS:,} (each registration and status "
                             "walks every index)")
        if self.k < 0 or self.m < 0:
            raise ValueError(f"k and m must be >= 0, got k={self.k} m={self.m}")
        if self.k + self.m > self.num_servers:
            raise ValueError(
                f"k + m = {self.k + self.m} exceeds the number of servers ({self.num_servers}): "
                "every member of a stripe must be on a distinct server"
            )


@dataclass(kw_only=True)
class SecurityOptions:
    """Transport security, the same four options on every process (``ecrec.net.security``)."""

    tls_cert: str | None = option(None, "PEM certificate this process presents: mutual TLS on every port and "
                                        "channel (with --tls-key and --tls-ca)")
    tls_key: str | None = option(None, "PEM private key of --tls-cert")
    tls_ca: str | None = option(None, "PEM certificate of the CA that signed every process's certificate")
    token_file: str | None = option(None, "file holding a shared secret every call carries and every process checks")

    def __post_init__(self) -> None:
        problem = empty_path_problem(self, PATH_SETTINGS)  # "" turned TLS or the token off without a word
        if problem:
            raise ValueError(problem)

    @property
    def security(self):
        """The loaded :class:`ecrec.net.security.Security` (files read once; raises naming an unusable file)."""
        cached = self.__dict__.get("_security")
        if cached is None:
            from ecrec.net.security import Security
            cached = self.__dict__["_security"] = Security(self.tls_cert, self.tls_key, self.tls_ca, self.token_file)
        return cached


@dataclass(kw_only=True)
class EtcdClientOptions:
    """How the control plane (coordinators and servers, never workers) dials etcd."""

    etcd_ca: str | None = option(None, "PEM certificate of the CA that signed etcd's certificates and this process's "
                                       "--etcd-cert.  Give etcd a CA of its own, one that signs no worker's "
                                       "certificate: etcd holds the server key, and it admits every certificate its "
                                       "CA signed.  Default: the cluster's --tls-ca (with a warning)")
    etcd_cert: str | None = option(None, "PEM certificate this process presents to etcd (default: --tls-cert)")
    etcd_key: str | None = option(None, "PEM private key of --etcd-cert (default: --tls-key)")

    def etcd_tls_files(self) -> tuple[tuple[str, str | None, str | None] | None, bool]:
        """``((ca, cert, key) or None for plain, shared)`` to dial etcd with; ``shared``: they are the cluster's
        own ``--tls-*`` files, whose CA signs every worker's certificate too.  Raises ValueError for an
        incomplete set."""
        if self.etcd_ca:
            if bool(self.etcd_cert) != bool(self.etcd_key):
                raise ValueError("--etcd-cert and --etcd-key go together")
            return (self.etcd_ca, self.etcd_cert, self.etcd_key), False
        if self.etcd_cert or self.etcd_key:
            raise ValueError("--etcd-cert/--etcd-key need --etcd-ca (the CA that signed etcd's certificates)")
        tls_ca = getattr(self, "tls_ca", None)
        if tls_ca:
            return (tls_ca, getattr(self, "tls_cert", None), getattr(self, "tls_key", None)), True
        return None, False


#: the warning a control-plane process logs when it dials etcd with the cluster's own certificates
SHARED_CA_WARNING = ("etcd is dialed with the cluster's --tls-ca/--tls-cert: if etcd trusts that CA, every certificate "
                     "it signed -- a worker's included -- can read and write the control plane's keys, the server key "
                     "among them; give etcd a CA of its own (--etcd-ca, --etcd-cert, --etcd-key)")


#: bind addresses that mean "every interface" (not an address to reach a server at)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def bracketed_host(host: str, flag: str = "--host") -> str:
    """``host`` as it goes before ``:port`` in an address: an IPv6 address in brackets (``::1`` -> ``[::1]``, the
    form gRPC and the cluster map take; the servers' own sockets and the metrics endpoint strip them); a ValueError
    for brackets that do not enclose the whole host."""
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if "[" in inner or "]" in inner:
        raise ValueError(f"{flag} {host!r}: brackets go around a whole IPv6 address ([::1]), or none at all")
    if ":" not in inner:
        return inner
    try:
        ipaddress.IPv6Address(inner.split("%", 1)[0])  # a zone (fe80::1%eth0) is the interface's
    except ValueError:
        raise ValueError(f"{flag} {host!r} is neither a host name nor an IPv4 or IPv6 address (a port goes in its "
                         "own flag)") from None
    return f"[{inner}]"


def check_ports(**ports: int | None) -> None:
    """ValueError naming the first port outside 0-65535 (None: not asked for)."""
    for name, value in ports.items():
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"--{name.replace('_', '-')} {value} is not a port (0-65535; 0: any free port)")


#: settings that hold a size in bytes, and the least each can be (a smaller one cannot carry a control message)
LEAST_BYTES = {"max_message_bytes": 64 * 1024}
#: ... and the most (gRPC takes a message size as a C int)
MOST_BYTES = {"max_message_bytes": 2**31 - 1}
#: the most active servers a cluster's map may hold (each registration and ``status`` walks every index)
MAX_SERVERS = 4096
#: the most server processes one machine is asked to start (``ecrec-server local``, the benchmarks)
MAX_LOCAL_SERVERS = 64
#: the most coordinators, and etcd members, one machine is asked to start (``ecrec-server local``, the benchmarks)
LOCAL_MEMBERS = 9


def empty_path_problem(config, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` (path settings of ``config``) given as an empty string, as a sentence, or None: an
    unset shell variable (``--token-file "$TOKEN"``) turned security or a restore off without a word."""
    for f in dataclasses.fields(config):
        if f.name in names:
            value = getattr(config, f.name)
            if isinstance(value, str) and not value.strip():
                return empty_flag(flag_of(f), "a file or URL")
    return None


def empty_flag(flag: str, what: str = "a file") -> str:
    """The refusal of path flag ``flag`` given as an empty string."""
    return f"{flag} is empty: name {what} (leave the flag out for none; an unset shell variable gives an empty one)"


#: path settings that may not be given empty, each meaning something once set
PATH_SETTINGS = ("tls_cert", "tls_key", "tls_ca", "token_file", "etcd_ca", "etcd_cert", "etcd_key", "state_path",
                 "store", "restore", "snapshot_root")


#: the shortest --lease-s (s): a server renews a third of a lease apart, at least 50 ms apart, and a renewal takes
#: a round trip to the coordinator
MIN_LEASE_S = 0.5

#: the longest deadline or interval in seconds a setting may be (about three years: gRPC takes no deadline much
#: beyond it -- 1e10 s fails every call at once with DEADLINE_EXCEEDED)
MAX_SECONDS = 1e8


@functools.lru_cache(maxsize=None)
def _number_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The fields of ``cls`` that hold an int or a float (type hints resolved once per class)."""
    return tuple(f for f in dataclasses.fields(cls) if _field_type(cls, f) in (int, float))


def check_numbers(config, zero_allowed: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
    """ValueError naming the first number setting of ``config`` (a dataclass of options) that is not finite, or is
    negative, or 0 unless ``zero_allowed`` names it (a deadline, an interval, a bound or a count of 0 or NaN made
    the process loop, wait forever or refuse everything); ``skip``: settings checked elsewhere."""
    for f in _number_fields(type(config)):
        if f.name in skip:
            continue
        value = getattr(config, f.name)
        kind = _field_type(type(config), f)
        if value is None and _optional(type(config), f):
            continue
        # a None, a string or a bool failed later, far from here (a TypeError at the first call), or passed; a
        # numpy or torch scalar is a number (kept as the field's own type: sizes and counts are ints)
        if value is None or isinstance(value, (bool, str, bytes)) or type(value).__name__ in ("bool", "bool_") or \
                not hasattr(type(value), "__float__"):
            raise ValueError(f"{f.name} ({flag_of(f)}) {value!r}: must be {'a whole number' if kind is int else 'a number'}")
        number = float(value)
        if kind is int and math.isfinite(number):
            if not number.is_integer():
                raise ValueError(f"{f.name} ({flag_of(f)}) {value!r}: must be a whole number")
            value = value if type(value) is int else int(number)
        elif kind is float or not math.isfinite(number):
            value = number
        setattr(config, f.name, value)
        least, most = LEAST_BYTES.get(f.name), MOST_BYTES.get(f.name)
        seconds = f.name.endswith("_s")
        if not math.isfinite(value) or value < 0 or (value == 0 and f.name not in zero_allowed) or \
                (least is not None and value < least) or (seconds and value > MAX_SECONDS) or \
                (most is not None and value > most):
            want = f"at least {least}" if least is not None else \
                "a finite number >= 0" if f.name in zero_allowed else "a finite number > 0"
            if most is not None:
                want += f" and at most {most} (gRPC's limit)"
            if seconds:
                want += f" and at most {MAX_SECONDS:g} (seconds)"
            raise ValueError(f"{f.name} ({flag_of(f)}) {value}: must be {want}")


@dataclass
class ServerConfig(SecurityOptions, EtcdClientOptions):
    """Settings of one ``ecrec-server serve`` process."""

    coordinator: str = option(REQUIRED, "coordinator address host:port")
    host: str = option("127.0.0.1", "address to bind")
    advertise_host: str | None = option(None, "address other processes reach this server at, put in the cluster "
                                              "map (default: --host; needed when --host is a wildcard such as 0.0.0.0)")
    port: int = option(0, "port (0: any free port)")
    device: Literal["cpu", "cuda"] = option("cpu", "where parity kernels run", choices=("cpu", "cuda"))
    standby: bool = option(False, "register as a spare that replaces a failed server")
    no_standby_reserve: bool = option(False, "a standby does not allocate and touch its future tables' memory while "
                                             "it waits (then a promotion writes fresh pages: slower go-on and rebuild)")
    no_gc_freeze: bool = option(False, "keep the objects of this server's start-up in Python's garbage collections "
                                       "(by default they are frozen once it started: a full collection then walks "
                                       "only what serving made, not the ~130,000 objects of the start-up)")
    want_index: int = option(-1, "take this index (a restarted server replacing itself)", flag="--index")
    rpc_timeout_s: float = option(10.0, "deadline of a call to another server (parity batches, row reads)")
    coordinator_timeout_s: float = option(5.0, "deadline of a call to the coordinator (reports, map reads)")
    register_timeout_s: float = option(60.0, "how long registration keeps retrying an unreachable coordinator")
    max_workers: int = option(16, "gRPC handler threads")
    max_message_bytes: int = option(256 * 1024 * 1024, "largest gRPC message sent or received")
    metrics_port: int | None = option(None, "serve Prometheus metrics on this port (0: any free port; default off)")
    snapshot_root: str | None = option(None, "snapshots (WriteSnapshot) are written only under this directory or "
                                             "URL prefix (default: wherever the caller asks; a file that exists is "
                                             "never overwritten)")
    # --- bounds on what a caller can make this server keep or do (docs/safety.md, "Bounds"; refused beyond them)
    max_worker_name_bytes: int = option(256, "longest worker name a push may carry (bytes, UTF-8)")
    max_incarnation_bytes: int = option(64, "longest worker incarnation a push may carry (bytes, UTF-8)")
    max_ids_per_request: int = option(1 << 22, "most row ids one pull, push or read may name, repeats included")
    max_push_ids_per_batch: int = option(65_536, "most push ids one parity batch may carry")
    max_relay_batches: int = option(4096, "most relayed parity batches (and watermarks) one request may carry; the "
                                          "rest are dropped unread, counted (an owner sends what was not applied "
                                          "again), so that a request of bogus entries costs a bounded time")
    max_push_hold_s: float = option(10.0, "longest a snapshot may hold this server's pushes while it finds a moment "
                                          "no step is half applied (they wait, then apply; milliseconds as a rule); "
                                          "the hold expires by itself after it")
    max_snapshot_s: float = option(3600.0, "longest a snapshot's cut is kept here while the snapshot is written (the "
                                           "rows pushes change meanwhile keep their bytes at the cut: memory up to "
                                           "a copy of the shard); it expires by itself after it")
    forget_idle_marks_s: float = option(3600.0, "with the table of applied pushes full, a worker incarnation idle this "
                                                "long with every push confirmed is forgotten to admit a new one (a "
                                                "push of a forgotten incarnation is refused, never applied twice); far "
                                                "beyond any worker's retry deadline")
    max_applied_bytes: int = option(64 << 20, "bytes of the table of worker incarnations whose pushes this server "
                                              "applied (retries answered \"already applied\"); a new incarnation "
                                              "beyond it is refused unless idle ones can be forgotten "
                                              "(--forget-idle-marks-s)")
    max_held_bytes: int = option(64 << 20, "bytes of parity batches held back per source until their predecessor "
                                           "arrives")
    map_refresh_interval_s: float = option(0.05, "least time between two map refreshes that a caller's newer epoch "
                                                 "asks for")
    fault_spec: str = option("", "fault injection for tests (point@count,...); read from ECREC_FAULT", cli=False)

    def __post_init__(self) -> None:
        check_ports(port=self.port, metrics_port=self.metrics_port)
        check_numbers(self, zero_allowed=("map_refresh_interval_s",), skip=("port", "metrics_port", "want_index"))
        problem = empty_path_problem(self, PATH_SETTINGS)
        if problem:
            raise ValueError(problem)
        self.host = bracketed_host(self.host)
        if self.advertise_host:
            self.advertise_host = bracketed_host(self.advertise_host, "--advertise-host")
        if self.want_index < -1:
            raise ValueError(f"--index {self.want_index}: an index is >= 0 (-1, the default: whichever is free)")

    @property
    def public_host(self) -> str:
        """The host in this server's addresses in the cluster map (``advertise_host``, else ``host``); raises
        ValueError for a wildcard ``host`` without ``advertise_host`` (no other process could reach it)."""
        if self.advertise_host:
            return self.advertise_host
        if self.host.strip("[]") in WILDCARD_HOSTS:
            raise ValueError(f"--host {self.host} binds every interface, so it is no address other processes can "
                             "reach this server at: pass --advertise-host with one (e.g. this host's IP)")
        return self.host


@dataclass
class CoordinatorConfig(SecurityOptions, EtcdClientOptions):
    """Settings of one ``ecrec-server coordinator`` process."""

    cluster: ClusterSpec = option(REQUIRED, "the cluster (servers, strategy, k, m, options)", cli=False)
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(7000, "port (0: any free port)")
    health_interval_s: float = option(0.5, "seconds between health checks", flag="--health-interval")
    health_timeout_s: float = option(1.0, "deadline of one health check")
    failures_before_dead: int = option(3, "failed health checks in a row that declare a server failed ...")
    failure_timeout_s: float = option(1.5, "... over at least this many seconds (a refused connection declares it "
                                           "at once: the process is gone)")
    lease_s: float = option(3.0, "a server serves only while its lease lasts; a replacement is promoted only after "
                                 "the lease of the server it replaces ran out (unless its process is gone); with an "
                                 "etcd store, the TTL of each server's etcd lease (whole seconds, at least 2): also "
                                 "how long the servers serve on through a loss of etcd's quorum")
    rpc_timeout_s: float = option(30.0, "deadline of a call to a server (map update)")
    promote_timeout_s: float = option(5.0, "deadline of one Promote call; a standby still healthy past it is asked "
                                           "again (Promote is idempotent), one that stops answering health checks is "
                                           "declared failed and skipped for the next standby")
    create_timeout_s: float = option(600.0, "deadline of creating a table or dense tensor on the servers (initial "
                                            "values and parity of a large table take a while)")
    max_server_bytes: int | None = option(None, "the most table and dense-tensor memory the map may ask of one server "
                                                "(a table's shard of rows with optimizer state and its parity rows; "
                                                "every dense tensor); a table or dense tensor beyond it is "
                                                "refused with RESOURCE_EXHAUSTED and nothing is created (one near a "
                                                "server's memory would take down every server and standby at once). "
                                                "Default: 60 percent of this host's memory; set it when the servers' hosts "
                                                "differ")
    state_path: str | None = option(None, "file where the map is persisted across coordinator restarts")
    store: str | None = option(None, "where the map is kept: etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (one etcd key "
                                     "written by compare-and-swap; run two or more coordinators on it, one leads; "
                                     "TLS to etcd with --tls-ca/--tls-cert/--tls-key when they are set) or "
                                     "file://PATH (= --state-path); default: --state-path, else memory only")
    election_ttl_s: int = option(3, "with an etcd store: the TTL in seconds of the leader's etcd lease (a follower "
                                    "takes over within it after the leader dies; at least 2)")
    metrics_port: int | None = option(None, "serve Prometheus metrics on this port (0: any free port; default off)")
    restore: str | None = option(None, "once every index has a server, restore this snapshot (a directory or fsspec "
                                       "URL written by `ecrec-server snapshot` or Cluster.save) onto the cluster, "
                                       "whatever shape it was saved from; the coordinator exits 1 if it cannot. "
                                       "Start the workers once it logs `restored` (the restore's writes would "
                                       "replace theirs)")

    def __post_init__(self) -> None:
        check_ports(port=self.port, metrics_port=self.metrics_port)
        check_numbers(self, zero_allowed=("max_server_bytes",), skip=("port", "metrics_port"))  # 0: the default
        self.host = bracketed_host(self.host)
        problem = empty_path_problem(self, PATH_SETTINGS) or state_path_problem(self.state_path)  # (found at the
        # first save before; an empty --restore or --token-file was no restore, no token)
        if problem:
            raise ValueError(problem)
        if self.lease_s < MIN_LEASE_S:  # a server renews every max(0.05 s, a third of it) and serves until 0.9 of
            # it from each renewal's start: 0.01 s served 9 ms of every 50, and refused the rest, without a word
            raise ValueError(f"--lease-s {self.lease_s:g}: at least {MIN_LEASE_S:g} s (a server renews its lease "
                             "every third of it, and serves only while it holds one)")


def state_path_problem(path: str | None, given: str | None = None) -> str | None:
    """Why a coordinator cannot keep its map in the file ``path``, or None; the sentence names the flag as ``given``
    (default ``--state-path PATH``)."""
    if not path:
        return None
    given = given or f"--state-path {path}"
    if os.path.isdir(path):
        return f"{given} is a directory: name the file the map is kept in (it is made if missing)"
    folder = os.path.dirname(os.path.abspath(path))
    return None if os.path.isdir(folder) else f"{given}: no directory {folder} to keep it in"


@dataclass
class ClientConfig(SecurityOptions):
    """Settings of a client (``ecrec.client.Cluster``)."""

    rpc_timeout_s: float = option(30.0, "deadline of one call to a server or the coordinator")
    create_timeout_s: float = option(900.0, "deadline of create_table and register_dense (the coordinator creates "
                                            "the shards on every server)")
    retry_deadline_s: float = option(120.0, "how long a call keeps retrying through failures")
    max_message_bytes: int = option(256 * 1024 * 1024, "largest gRPC message sent or received")
    max_ids_per_request: int = option(1 << 22, "most row ids one request names, as the servers' "
                                               "--max-ids-per-request: a step that would send more to a server is "
                                               "refused before anything is sent, a pull is sent in pieces")
    max_worker_name_bytes: int = option(256, "longest worker name (bytes, UTF-8), as the servers' "
                                             "--max-worker-name-bytes: a longer one is refused when the client is "
                                             "made, not at its first push")
    idle_poll_s: float = option(0.25, "while this worker holds unconfirmed pushes and makes no call, a background "
                                      "thread pulls a row of each of their owners this often: confirmations come "
                                      "back, and an owner's replacement gets them replayed (0: only at the "
                                      "worker's next call)")
    confirm_at_exit_s: float = option(10.0, "a worker whose process ends without close() waits at exit this long "
                                            "for its pushes to be confirmed, as close() does (an owner failing "
                                            "after it is gone would lose those still unconfirmed; 0: no wait)")
    exit_on_sigterm: bool = option(True, "where SIGTERM has no handler (torchrun, SLURM and Kubernetes stop workers "
                                         "with it), a client made in the main thread makes it wait as above for "
                                         "this process's unconfirmed pushes, then end the process as the signal "
                                         "would have (a program's own handler is left alone; "
                                         "ecrec.client.termination)")

    def __post_init__(self) -> None:
        check_numbers(self, zero_allowed=("idle_poll_s", "confirm_at_exit_s"))
        super().__post_init__()  # an empty path: a TLS cluster was waited for in plaintext
        if not isinstance(self.exit_on_sigterm, bool):  # "no" was taken, and turned it on
            raise ValueError(f"exit_on_sigterm {self.exit_on_sigterm!r}: must be True or False")


# --- the command line, built from the fields ------------------------------------------------------------------
def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that appear on the command line."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _optional(cls: type, f: dataclasses.Field) -> bool:
    """Whether the field takes None (``X | None``)."""
    return type(None) in typing.get_args(typing.get_type_hints(cls)[f.name])


def _field_type(cls: type, f: dataclasses.Field):
    hints = typing.get_type_hints(cls)
    t = hints[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) is Literal:
        return str
    if args and typing.get_origin(t) is not Literal:  # Optional[X] / X | None
        t = args[0]
    return t


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, defaults: dict | None = None,
                  exclude: tuple[str, ...] = (), help_overrides: dict | None = None) -> None:
    """Adds one flag per command-line field of ``cls`` (help text, type, default and choices from the field)."""
    for f in cli_fields(cls):
        if f.name in exclude:
            continue
        flag = flag_of(f)
        t = _field_type(cls, f)
        default = (defaults or {}).get(f.name, f.default)
        required = default is dataclasses.MISSING
        help_text = (help_overrides or {}).get(f.name) or (
            f.metadata["help"] + ("" if required or default in (None, False, []) else f" (default {default})"))
        if t is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", help=help_text)
        elif t is dict:
            parser.add_argument(flag, dest=f.name, action="append", default=[], metavar="KEY=VALUE", help=help_text)
        else:
            kwargs = dict(dest=f.name, type=t, help=help_text)
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
            if required:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
            parser.add_argument(flag, **kwargs)


def from_arguments(cls: type, args: argparse.Namespace, **extra: Any):
    """Builds ``cls`` from parsed arguments (fields missing from ``args`` keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flag") == "--option" and f.name in values:
            values[f.name] = parse_key_values(values[f.name])
    values.update(extra)
    return cls(**values)


def parse_key_values(pairs: list[str] | dict) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; raises ValueError naming a malformed pair."""
    if isinstance(pairs, dict):
        return {str(k): str(v) for k, v in pairs.items()}
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option takes KEY=VALUE, got {pair!r}")
        options[key] = value
    return options
