"""Embedding-table and dense-tensor specs, their validation, and deterministic initial values.

A row's *payload* is its float32 weights followed by its optimizer state (the
Adagrad sum), stored as bytes so that fault-tolerance strategies see the old and
new bytes of every update.  Initial rows depend only on ``(seed, table name, row
id)`` -- never on the number of servers -- through a counter-based hash, so any
process can compute the initial value of any row.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from ecrec import optim
from ecrec.wire import cluster_pb2

INITS = ("uniform", "normal", "zeros")
MAX_DIM = 1 << 16


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int
    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    init: str = "uniform"
    init_scale: float = 0.0  # 0: 1/sqrt(num_rows) for uniform, 1.0 for normal
    seed: int = 0

    def validate(self) -> "TableSpec":
        if not self.name or not isinstance(self.name, str):
            raise ValueError("table name must be a non-empty string")
        if self.num_rows < 1:
            raise ValueError(f"table {self.name!r}: num_rows must be >= 1, got {self.num_rows}")
        if not 1 <= self.dim <= MAX_DIM:
            raise ValueError(f"table {self.name!r}: dim must be in [1, {MAX_DIM}], got {self.dim}")
        optim.check_params(self.optimizer, self.lr, self.eps, self.initial_accumulator_value, what=f"table {self.name!r}")
        if self.init not in INITS:
            raise ValueError(f"table {self.name!r}: init must be one of {INITS}, got {self.init!r}")
        if not math.isfinite(self.init_scale) or self.init_scale < 0:
            raise ValueError(f"table {self.name!r}: init_scale must be finite and >= 0")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"table {self.name!r}: seed must be in [0, 2**64)")
        return self

    @property
    def state_width(self) -> int:
        return optim.state_width(self.optimizer)

    @property
    def row_floats(self) -> int:
        return self.dim * (1 + self.state_width)

    @property
    def row_bytes(self) -> int:
        return 4 * self.row_floats

    def to_proto(self) -> cluster_pb2.TableSpec:
        return cluster_pb2.TableSpec(
            name=self.name, num_rows=self.num_rows, dim=self.dim, optimizer=self.optimizer, lr=self.lr,
            eps=self.eps, initial_accumulator_value=self.initial_accumulator_value, init=self.init,
            init_scale=self.init_scale, seed=self.seed,
        )

    @classmethod
    def from_proto(cls, p: cluster_pb2.TableSpec) -> "TableSpec":
        return cls(
            name=p.name, num_rows=p.num_rows, dim=p.dim, optimizer=p.optimizer, lr=p.lr, eps=p.eps,
            initial_accumulator_value=p.initial_accumulator_value, init=p.init, init_scale=p.init_scale,
            seed=p.seed,
        )


@dataclass(frozen=True)
class DenseSpec:
    name: str
    shape: tuple
    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def validate(self) -> "DenseSpec":
        if not self.name or not isinstance(self.name, str):
            raise ValueError("dense tensor name must be a non-empty string")
        if any(int(d) < 1 for d in self.shape) or len(self.shape) == 0:
            raise ValueError(f"dense tensor {self.name!r}: shape must be non-empty with positive dims, got {self.shape}")
        optim.check_params(self.optimizer, self.lr, self.eps, self.initial_accumulator_value, what=f"dense tensor {self.name!r}")
        return self

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def state_width(self) -> int:
        return optim.state_width(self.optimizer)

    @property
    def payload_bytes(self) -> int:
        return 4 * self.numel * (1 + self.state_width)

    def to_proto(self) -> cluster_pb2.DenseSpec:
        return cluster_pb2.DenseSpec(
            name=self.name, shape=list(self.shape), optimizer=self.optimizer, lr=self.lr, eps=self.eps,
            initial_accumulator_value=self.initial_accumulator_value,
        )

    @classmethod
    def from_proto(cls, p: cluster_pb2.DenseSpec) -> "DenseSpec":
        return cls(
            name=p.name, shape=tuple(int(d) for d in p.shape), optimizer=p.optimizer, lr=p.lr, eps=p.eps,
            initial_accumulator_value=p.initial_accumulator_value,
        )


# --- deterministic initial values ------------------------------------------------------------------

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _uniform01(spec: TableSpec, ids: np.ndarray, stream: int) -> np.ndarray:
    """Uniform [0, 1) float32 of shape (len(ids), dim), a pure function of (seed, name, id, col, stream)."""
    key = _splitmix64(np.array([spec.seed ^ (zlib.crc32(spec.name.encode()) << 32) ^ stream], dtype=np.uint64))[0]
    counter = ids.astype(np.uint64)[:, None] * np.uint64(spec.dim) + np.arange(spec.dim, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        bits = _splitmix64(_splitmix64(counter ^ key))
    return (bits >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def initial_weights(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """Initial float32 weights ``(len(ids), dim)`` of the given rows."""
    ids = np.asarray(ids, dtype=np.int64)
    if spec.init == "zeros":
        return np.zeros((len(ids), spec.dim), dtype=np.float32)
    if spec.init == "uniform":
        scale = spec.init_scale or 1.0 / math.sqrt(spec.num_rows)
        u = _uniform01(spec, ids, 0)
        return ((u * np.float32(2.0) - np.float32(1.0)) * np.float32(scale)).astype(np.float32)
    # normal: Box-Muller on two independent streams
    scale = spec.init_scale or 1.0
    u1 = _uniform01(spec, ids, 1).astype(np.float64)
    u2 = _uniform01(spec, ids, 2).astype(np.float64)
    z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
    return (z * scale).astype(np.float32)


def initial_payload(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """Initial payload rows (weights then optimizer state) as float32 ``(len(ids), row_floats)``."""
    out = np.empty((len(ids), spec.row_floats), dtype=np.float32)
    out[:, : spec.dim] = initial_weights(spec, ids)
    out[:, spec.dim :] = np.float32(spec.initial_accumulator_value)
    return out
