"""Where every row lives: the map ``row -> (server, slot)`` and ``stripe -> parity servers``.

Rows of a table are grouped into stripes of ``k`` data rows; stripe ``s`` has
``k + m`` members on the distinct servers ``(s + t) % S`` for ``t = 0..k+m-1``:
members ``t < k`` hold data row ``s*k + t``, members ``t >= k`` hold parity
``t - k``.  So parity positions rotate across servers stripe by stripe (RAID-5
style) and parity work is balanced.  A strategy without parity uses ``m = 0``
and ``k = S``, which spreads rows round-robin.

Slots are dense per server: in every block of ``S`` consecutive stripes a
server holds exactly ``k`` data rows and ``m`` parity rows, so
``data slot = (s // S) * k + t`` and ``parity slot = (s // S) * m + j``.

Everything here is a pure function of ``(S, k, m)`` and of the table's row
count: the client, every server and the coordinator compute it the same way.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    num_servers: int
    k: int
    m: int = 0

    def __post_init__(self) -> None:
        if self.num_servers < 1 or self.k < 1 or self.m < 0:
            raise ValueError(f"invalid layout S={self.num_servers} k={self.k} m={self.m}")
        if self.k + self.m > self.num_servers:
            raise ValueError(f"k + m = {self.k + self.m} > servers = {self.num_servers}")

    # --- data rows -------------------------------------------------------------------------------
    def num_stripes(self, num_rows: int) -> int:
        return -(-num_rows // self.k)

    def data_slots_per_server(self, num_rows: int) -> int:
        return -(-self.num_stripes(num_rows) // self.num_servers) * self.k

    def parity_slots_per_server(self, num_rows: int) -> int:
        return -(-self.num_stripes(num_rows) // self.num_servers) * self.m

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(server, data slot)`` of each row id (int64 arrays)."""
        ids = np.asarray(ids, dtype=np.int64)
        stripe, pos = np.divmod(ids, self.k)
        server = (stripe + pos) % self.num_servers
        slot = (stripe // self.num_servers) * self.k + pos
        return server, slot

    def stripe_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(stripe, position in stripe)`` of each row id."""
        return np.divmod(np.asarray(ids, dtype=np.int64), self.k)

    def ids_of_slots(self, server: int, slots: np.ndarray) -> np.ndarray:
        """Row ids of ``server``'s data slots (the inverse of :meth:`locate`; ids past the table's end are
        virtual)."""
        block, pos = np.divmod(np.asarray(slots, dtype=np.int64), self.k)
        stripe = block * self.num_servers + (server - pos) % self.num_servers
        return stripe * self.k + pos

    def rows_of(self, server: int, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Every row id held by ``server`` and its slot, sorted by slot (:meth:`ids_of_slots` of every slot,
        computed block by position without a division per slot)."""
        n, k, S = self.data_slots_per_server(num_rows), self.k, self.num_servers
        pos = np.arange(k, dtype=np.int64)
        ids = ((np.arange(n // k, dtype=np.int64)[:, None] * S + (server - pos) % S) * k + pos).reshape(-1)
        slots = np.arange(n, dtype=np.int64)
        keep = ids < num_rows
        return (ids, slots) if keep.all() else (ids[keep], slots[keep])

    # --- stripes ---------------------------------------------------------------------------------
    def member_server(self, stripes: np.ndarray, member: int) -> np.ndarray:
        """Server of member ``member`` (``0..k-1`` data, ``k..k+m-1`` parity) of each stripe."""
        return (np.asarray(stripes, dtype=np.int64) + member) % self.num_servers

    def stripe_row_ids(self, stripes: np.ndarray) -> np.ndarray:
        """``(len(stripes), k)`` row ids of the stripes' data members (ids >= the row count are virtual
        zero rows)."""
        return np.asarray(stripes, dtype=np.int64)[:, None] * self.k + np.arange(self.k, dtype=np.int64)[None, :]

    # --- parity rows -----------------------------------------------------------------------------
    def parity_servers(self, stripes: np.ndarray) -> np.ndarray:
        """``(len(stripes), m)`` server of each parity of each stripe."""
        stripes = np.asarray(stripes, dtype=np.int64)
        j = np.arange(self.m, dtype=np.int64)
        return self.member_server(stripes[:, None], self.k + j[None, :])

    def parity_slot(self, stripes: np.ndarray, parity_index: np.ndarray | int) -> np.ndarray:
        stripes = np.asarray(stripes, dtype=np.int64)
        return (stripes // self.num_servers) * self.m + np.asarray(parity_index, dtype=np.int64)

    def parity_rows_of(self, server: int, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(stripe, parity index, slot)`` of every parity row held by ``server``."""
        if self.m == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        n, m, S = self.parity_slots_per_server(num_rows), self.m, self.num_servers
        j = np.arange(m, dtype=np.int64)
        stripe = (np.arange(n // m, dtype=np.int64)[:, None] * S + (server - self.k - j) % S).reshape(-1)
        j = np.broadcast_to(j, (n // m, m)).reshape(-1)
        slots = np.arange(n, dtype=np.int64)
        keep = stripe < self.num_stripes(num_rows)
        return stripe[keep], j[keep], slots[keep]

    def stripe_members(self, stripe: int) -> list[int]:
        """Servers of stripe ``stripe``: data positions ``0..k-1`` then parities."""
        return [int(self.member_server(stripe, t)) for t in range(self.k + self.m)]

    # --- dense parameters ------------------------------------------------------------------------
    def dense_servers(self, name: str) -> list[int]:
        """Primary then ``m`` backups of a dense tensor (replication, not coding)."""
        primary = zlib.crc32(name.encode()) % self.num_servers
        return [(primary + r) % self.num_servers for r in range(self.m + 1)]
