"""Configuration dataclasses: one place for every knob of a cluster and a server.

``ClusterSpec`` is fixed when the coordinator starts and handed to every server
that registers (the layout is a pure function of it); ``ServerConfig`` and
``ClientConfig`` hold per-process settings such as timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterSpec:
    """What every process of one cluster agrees on."""

    num_servers: int
    strategy: str = "none"
    k: int = 0  # data rows per stripe (0: the strategy decides)
    m: int = 0  # parity rows per stripe (0: no parity)
    strategy_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")
        if self.k < 0 or self.m < 0:
            raise ValueError(f"k and m must be >= 0, got k={self.k} m={self.m}")
        if self.k + self.m > self.num_servers:
            raise ValueError(
                f"k + m = {self.k + self.m} exceeds the number of servers ({self.num_servers}): "
                "every member of a stripe must be on a distinct server"
            )


@dataclass
class ServerConfig:
    """Settings of one ``ecrec-server serve`` process."""

    coordinator: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"  # "cpu" | "cuda": where parity kernels run
    standby: bool = False
    want_index: int = -1
    rpc_timeout_s: float = 10.0
    max_workers: int = 16
    max_message_bytes: int = 256 * 1024 * 1024


@dataclass
class CoordinatorConfig:
    """Settings of one ``ecrec-server coordinator`` process."""

    cluster: ClusterSpec
    host: str = "127.0.0.1"
    port: int = 0
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    failures_before_dead: int = 2
    rpc_timeout_s: float = 30.0
    state_path: str | None = None  # where the map is persisted (survives a coordinator restart)


@dataclass
class ClientConfig:
    """Settings of a client (``ecrec.client.Cluster``)."""

    rpc_timeout_s: float = 30.0
    retry_deadline_s: float = 120.0  # how long a call keeps retrying through failures
    max_message_bytes: int = 256 * 1024 * 1024

