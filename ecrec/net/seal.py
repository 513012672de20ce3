"""Proof that a server made what a worker carries: a MAC (keyed BLAKE3) under a key only servers hold.

ECRec's parity path rides on the worker's requests (``docs/protocol.md``): an owner's parity batches travel to
their parity servers inside the worker's pulls, and the parity servers' watermarks travel back inside its
pushes.  A worker is not trusted with parity, so everything it carries is *sealed*: a MAC under the
cluster's server key, which the coordinator makes when the cluster starts (32 random bytes, kept in its
state file) and hands to each server in its ``Register`` reply -- never in the map clients read.  A server
refuses (and counts) anything whose seal does not check, so a worker can drop or delay what it carries,
never change it, make it up, or make it count twice.

The same key proves a server's identity on server-to-server calls (``ecrec-caller-proof``), so the parity
plane refuses callers that merely claim a server's id.

Each use has its own key derived from the server key, so a MAC of one kind never checks as another.  Keyed
BLAKE3 is a PRF, so a MAC: measured here on one core, 2.5 GB/s on an 83 KB batch (HMAC-SHA256 with the SHA
extensions: 1.4 GB/s) and 1.6 us on a watermark (HMAC: 4.3 us).
"""

from __future__ import annotations

import hmac
import os
import struct

import blake3

#: bytes of the server key the coordinator makes
KEY_BYTES = 32
#: bytes of a MAC as sent (128 bits)
MAC_BYTES = 16

_WATERMARK = struct.Struct("<iiQ")


def _derive(key: bytes, purpose: bytes) -> bytes:
    """The key of one use of the server key (BLAKE3's keyed hash of the purpose)."""
    return blake3.blake3(purpose, key=key).digest()


def new_key() -> bytes:
    """A fresh server key (the coordinator's, when a cluster starts)."""
    return os.urandom(KEY_BYTES)


def check_key(key: bytes) -> bytes:
    """``key`` when it can be a server key, else ValueError naming the problem."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"a server key is {KEY_BYTES} bytes, got {len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__}")
    return bytes(key)


class Sealer:
    """MACs of parity batches, watermarks and server identities under one server key."""

    def __init__(self, key: bytes):
        key = check_key(key)
        self._batch = _derive(key, b"ecrec parity batch")
        self._watermark = _derive(key, b"ecrec parity watermark")
        self._caller = _derive(key, b"ecrec server identity")

    # --- parity batches (serialized ParityBatch messages) ----------------------------------------------------
    def batch_mac(self, data: bytes) -> bytes:
        return blake3.blake3(data, key=self._batch).digest(MAC_BYTES)

    def batch_ok(self, data: bytes, mac: bytes) -> bool:
        return len(mac) == MAC_BYTES and hmac.compare_digest(self.batch_mac(data), mac)

    # --- watermarks (a destination applied a source's chain up to a sequence) --------------------------------
    def watermark_mac(self, source: int, source_id: str, destination: int, destination_id: str,
                      applied_upto: int) -> bytes:
        message = (_WATERMARK.pack(source, destination, applied_upto) + source_id.encode() + b"\0"
                   + destination_id.encode())
        return blake3.blake3(message, key=self._watermark).digest(MAC_BYTES)

    def watermark_ok(self, wm) -> bool:
        """Whether a ``ParityWatermark`` carries its destination's seal."""
        if len(wm.mac) != MAC_BYTES or not 0 <= wm.applied_upto < 1 << 64:
            return False
        try:
            expected = self.watermark_mac(wm.source, wm.source_id, wm.destination, wm.destination_id, wm.applied_upto)
        except struct.error:  # an index out of int32 range: not one a server made
            return False
        return hmac.compare_digest(expected, wm.mac)

    def seal_watermark(self, wm):
        wm.mac = self.watermark_mac(wm.source, wm.source_id, wm.destination, wm.destination_id, wm.applied_upto)
        return wm

    # --- a server's identity on server-to-server calls -------------------------------------------------------
    def caller_proof(self, server_id: str) -> str:
        """What a server sends as ``ecrec-caller-proof`` beside ``ecrec-caller`` (hex)."""
        return blake3.blake3(server_id.encode(), key=self._caller).digest(MAC_BYTES).hex()

    def caller_ok(self, server_id: str, proof: str) -> bool:
        return bool(server_id) and hmac.compare_digest(self.caller_proof(server_id).encode(), (proof or "").encode())
