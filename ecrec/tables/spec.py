"""Embedding-table and dense-tensor specs, their validation, and deterministic initial values.

A row's *payload* is its float32 weights followed by its optimizer state (the
Adagrad sum), stored as bytes so that fault-tolerance strategies see the old and
new bytes of every update.  Initial rows depend only on ``(seed, table name, row
id)`` -- never on the number of servers -- through a counter-based hash, so any
process can compute the initial value of any row.
"""

from __future__ import annotations

import functools
import math
import time
import unicodedata
import zlib
from dataclasses import dataclass

import numpy as np

from ecrec.tables import optim
from ecrec.wire import cluster_pb2

#: "blank": every float zero, the optimizer state included: a table whose every row is written right after
#: (a restore), created without computing initial rows or their parity
INITS = ("uniform", "normal", "zeros", "blank")
MAX_DIM = 1 << 16


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The optimizer settings a table and a dense tensor both carry (:class:`TableSpec` and :class:`DenseSpec`
    extend it): keyword-only, so a spec's own fields keep their places in its constructor."""

    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def _check_optimizer(self, what: str) -> None:
        optim.check_params(self.optimizer, self.lr, self.eps, self.initial_accumulator_value, what=what)

    @property
    def state_width(self) -> int:
        return optim.state_width(self.optimizer)

    @staticmethod
    def _optimizer_fields(spec) -> dict:
        """The optimizer fields of a spec or of its proto (``cluster_pb2.TableSpec``, ``DenseSpec``: the same
        names), as keywords for the other."""
        return {name: getattr(spec, name) for name in ("optimizer", "lr", "eps", "initial_accumulator_value")}


#: the longest name of a table or dense tensor, in UTF-8 bytes (every name is in the map every process fetches)
MAX_NAME_BYTES = 1024


def check_name(name, what: str) -> None:
    """ValueError unless ``name`` is a non-empty string of at most :data:`MAX_NAME_BYTES` in UTF-8."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} name {name!r} is not valid text ({exc.reason} at position {exc.start})") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"{what} name {name[:40]!r}... is {size} bytes in UTF-8; at most {MAX_NAME_BYTES}")
    odd = next((c for c in name if unicodedata.category(c) in ("Cc", "Cf")), None)
    if odd is not None:  # a newline forged log lines, a NUL made logs binary, a bidi override hid what a name says
        raise ValueError(f"{what} name {name!r} holds a control or format character ({odd!r}); names are text")


@dataclass(frozen=True)
class TableSpec(OptimizerSpec):
    name: str
    num_rows: int
    dim: int
    init: str = "uniform"
    init_scale: float = 0.0  # 0: 1/sqrt(num_rows) for uniform, 1.0 for normal
    seed: int = 0

    def validate(self) -> "TableSpec":
        check_name(self.name, "table")
        for field in ("num_rows", "dim", "seed"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"table {self.name!r}: {field} must be a whole number, got {value!r}")
        if not 1 <= self.num_rows < 2**63:
            raise ValueError(f"table {self.name!r}: num_rows must be in [1, 2**63) (row ids are int64), got "
                             f"{self.num_rows}")
        if not 1 <= self.dim <= MAX_DIM:
            raise ValueError(f"table {self.name!r}: dim must be in [1, {MAX_DIM}], got {self.dim}")
        self._check_optimizer(f"table {self.name!r}")
        if self.init not in INITS:
            raise ValueError(f"table {self.name!r}: init must be one of {INITS}, got {self.init!r}")
        if not math.isfinite(self.init_scale) or not 0 <= self.init_scale <= optim.FLOAT32_MAX:
            raise ValueError(f"table {self.name!r}: init_scale must be finite in float32 and >= 0, got "
                             f"{self.init_scale}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"table {self.name!r}: seed must be in [0, 2**64)")
        return self

    @property
    def initially_zero(self) -> bool:
        """Every initial float is zero (weights and state): a fresh zeroed array already holds the initial rows
        and their parity."""
        return self.init == "blank" or (self.init == "zeros" and (self.state_width == 0
                                                                  or self.initial_accumulator_value == 0))

    @property
    def row_floats(self) -> int:
        return self.dim * (1 + self.state_width)

    @property
    def row_bytes(self) -> int:
        return 4 * self.row_floats

    def to_proto(self) -> cluster_pb2.TableSpec:
        return cluster_pb2.TableSpec(
            name=self.name, num_rows=self.num_rows, dim=self.dim, init=self.init, init_scale=self.init_scale,
            seed=self.seed, **self._optimizer_fields(self),
        )

    @classmethod
    def from_proto(cls, p: cluster_pb2.TableSpec) -> "TableSpec":
        return cls(name=p.name, num_rows=p.num_rows, dim=p.dim, init=p.init, init_scale=p.init_scale, seed=p.seed,
                   **cls._optimizer_fields(p))


@dataclass(frozen=True)
class DenseSpec(OptimizerSpec):
    name: str
    shape: tuple

    def validate(self) -> "DenseSpec":
        check_name(self.name, "dense tensor")
        if any(int(d) < 1 for d in self.shape) or len(self.shape) == 0:
            raise ValueError(f"dense tensor {self.name!r}: shape must be non-empty with positive dims, got {self.shape}")
        self._check_optimizer(f"dense tensor {self.name!r}")
        return self

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def payload_bytes(self) -> int:
        return 4 * self.numel * (1 + self.state_width)

    def to_proto(self) -> cluster_pb2.DenseSpec:
        return cluster_pb2.DenseSpec(name=self.name, shape=list(self.shape), **self._optimizer_fields(self))

    @classmethod
    def from_proto(cls, p: cluster_pb2.DenseSpec) -> "DenseSpec":
        return cls(name=p.name, shape=tuple(int(d) for d in p.shape), **cls._optimizer_fields(p))


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
    key = _uniform_key(spec, stream)
    counter = ids.astype(np.uint64)[:, None] * np.uint64(spec.dim) + np.arange(spec.dim, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        bits = _splitmix64(_splitmix64(counter ^ key))
    return (bits >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def initial_weights(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """Initial float32 weights ``(len(ids), dim)`` of the given rows."""
    ids = np.asarray(ids, dtype=np.int64)
    if spec.init in ("zeros", "blank"):
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


def _uniform_key(spec: TableSpec, stream: int) -> np.uint64:
    return _splitmix64(np.array([spec.seed ^ (zlib.crc32(spec.name.encode()) << 32) ^ stream], dtype=np.uint64))[0]


@functools.lru_cache(maxsize=1)
def _uniform_kernel():
    """The ``uniform`` initial rows written straight into their slots (numba, cached on disk): the same
    arithmetic as :func:`_uniform01` and :func:`initial_weights`, bit for bit, without the numpy
    temporaries (a 4M x 64 table made them 512 MB each and table creation took 20 s)."""
    from numba import njit

    @njit(cache=True, nogil=True, boundscheck=False)
    def fill(ids, slots, out, dim, key, scale, state_value):  # pragma: no cover - numba
        golden = np.uint64(0x9E3779B97F4A7C15)
        m1 = np.uint64(0xBF58476D1CE4E5B9)
        m2 = np.uint64(0x94D049BB133111EB)
        s30, s27, s31, s40 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
        unit = np.float32(1.0 / (1 << 24))
        two, one = np.float32(2.0), np.float32(1.0)
        width = out.shape[1]
        for r in range(ids.shape[0]):
            row = out[slots[r]]
            base = np.uint64(ids[r]) * np.uint64(dim)
            for c in range(dim):
                x = (base + np.uint64(c)) ^ key
                for _ in range(2):
                    x = x + golden
                    x = (x ^ (x >> s30)) * m1
                    x = (x ^ (x >> s27)) * m2
                    x = x ^ (x >> s31)
                u = np.float32(x >> s40) * unit
                row[c] = (u * two - one) * scale
            for c in range(dim, width):
                row[c] = state_value
    return fill


def warm_up() -> float:
    """Compiles (or loads from numba's disk cache) the kernels that write new rows and apply the optimizer, and
    returns the seconds it took.  A server does this before it registers: a standby promoted later fills its
    tables at once instead of paying 0.9-1.3 s of compilation inside the failure (whatever its strategy)."""
    from ecrec.tables import optim_kernel  # the optimizer's compiled pass (a push's first table must not wait)

    t0 = time.perf_counter()
    spec = TableSpec("warm-up", 2, 2, optimizer="adagrad").validate()
    fill_initial_payload(spec, np.arange(2, dtype=np.int64), np.empty((2, spec.row_floats), dtype=np.float32))
    optim_kernel.warm_up()
    return time.perf_counter() - t0


def kernels_ready() -> bool:
    """Whether the row-writing kernel is compiled in this process (``warm_up`` ran, or a table was filled)."""
    return bool(_uniform_kernel().signatures)


def fill_initial_payload(spec: TableSpec, ids: np.ndarray, out: np.ndarray, slots: np.ndarray | None = None) -> None:
    """Writes the initial payload of rows ``ids`` into ``out[slots]`` (``out``: float32 ``(rows, row_floats)``;
    ``slots`` default ``0..len(ids)-1``), without temporaries the size of the table."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    slots = np.arange(len(ids), dtype=np.int64) if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[1] != spec.row_floats or len(slots) != len(ids):
        raise ValueError(f"table {spec.name!r}: out must be float32 (rows, {spec.row_floats}) with a slot per id")
    if not len(ids):
        return
    if spec.init == "uniform":
        scale = np.float32(spec.init_scale or 1.0 / math.sqrt(spec.num_rows))
        _uniform_kernel()(ids, slots, out, spec.dim, _uniform_key(spec, 0), scale,
                          np.float32(spec.initial_accumulator_value))
        return
    chunk = max(1, (1 << 22) // max(spec.dim, 1))  # bounded temporaries for the numpy paths
    for start in range(0, len(ids), chunk):
        out[slots[start:start + chunk]] = _initial_payload_numpy(spec, ids[start:start + chunk])


def initial_payload(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """Initial payload rows (weights then optimizer state) as float32 ``(len(ids), row_floats)``."""
    out = np.empty((len(ids), spec.row_floats), dtype=np.float32)
    fill_initial_payload(spec, ids, out)
    return out


def _initial_payload_numpy(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The reference (numpy) form of :func:`initial_payload`."""
    out = np.empty((len(ids), spec.row_floats), dtype=np.float32)
    out[:, : spec.dim] = initial_weights(spec, ids)
    out[:, spec.dim :] = np.float32(0.0 if spec.init == "blank" else spec.initial_accumulator_value)
    return out
