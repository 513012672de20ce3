"""Parity batches as one frame: the direct path's bulk bytes without protobuf.

A big group (at scale: megabytes of deltas) goes from its owner to each parity server directly, in an
``ApplyParityFrames`` call (a server-to-server gRPC method registered by hand, as ``StreamStripes`` is: its request
is this frame, not a protobuf message).  As ``ParityBatches`` messages its bytes were copied into each field, the
message, the serialized request, then out of the parsed request and each field again; as a frame they are joined
once on the owner and read in place on the parity server (numpy views of the received buffer).

Layout (little-endian), each section 8-byte aligned (zero padding)::

    header      16 bytes: b"ECPB", version (u32), length of the metadata (u64)
    metadata    a ``ParityBatches`` whose batches carry everything but the bulk fields of their table entries
    sections    for each batch, for each table entry, in order: table_rows, parity_slots, positions, deltas,
                old_versions, seqs -- each a u64 length, then the bytes (the same bytes the protobuf fields hold)

:func:`encode` writes one from the metadata and the entries' arrays; :func:`decode` checks a received one and
returns the metadata and, per batch and table entry, the sections as views of the buffer.  A frame that does not
match raises :class:`FrameError` (answered ``INVALID_ARGUMENT``; nothing applied).
"""

from __future__ import annotations

import struct

from ecrec.strategies.erasure.frames import SERVICE
from ecrec.wire import parity_pb2

#: the gRPC method (registered by hand beside the generated ones and ``StreamStripes``: its request is a frame)
METHOD = "ApplyParityFrames"
FULL_METHOD = f"/{SERVICE}/{METHOD}"
MAGIC = b"ECPB"
VERSION = 1
HEADER = struct.Struct("<4sIQ")
LENGTH = struct.Struct("<Q")
#: the bulk fields of a table entry of a ``ParityBatch``, in the order a frame carries them
FIELDS = ("table_rows", "parity_slots", "positions", "deltas", "old_versions", "seqs")


class FrameError(ValueError):
    """A received frame does not parse (another version, cut short, lengths that do not add up)."""


def _pad(n: int) -> int:
    return -n % 8


def encode(meta: parity_pb2.ParityBatches, sections: list[list[tuple]]) -> bytes:
    """One frame: ``meta`` (batches without their entries' bulk fields) and, per batch and table entry, the six
    sections in :data:`FIELDS` order (bytes-like or arrays; ``sections[i][j]`` belongs to
    ``meta.batches[i].tables[j]``)."""
    return b"".join(encode_parts(meta, sections))


def encode_parts(meta: parity_pb2.ParityBatches, sections: list[list[tuple]]) -> list:
    """The buffers of :func:`encode`'s frame, in order, the sections' bytes not copied (for a socket's
    ``sendmsg``)."""
    if len(sections) != len(meta.batches):
        raise ValueError(f"{len(sections)} batches of sections for {len(meta.batches)} batches")
    head = meta.SerializeToString()
    parts = [HEADER.pack(MAGIC, VERSION, len(head)), head, b"\0" * _pad(len(head))]
    for b, entries in zip(meta.batches, sections):
        if len(entries) != len(b.tables):
            raise ValueError(f"{len(entries)} table entries of sections for {len(b.tables)}")
        for entry in entries:
            if len(entry) != len(FIELDS):
                raise ValueError(f"a table entry needs {len(FIELDS)} sections, got {len(entry)}")
            for section in entry:
                view = memoryview(section).cast("B")
                parts += [LENGTH.pack(len(view)), view, b"\0" * _pad(len(view))]
    return parts


def decode(data) -> tuple[parity_pb2.ParityBatches, list[list[tuple[memoryview, ...]]]]:
    """The metadata and the sections (views of ``data``) of a frame; raises :class:`FrameError`."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise FrameError(f"a parity frame of {len(view)} bytes is shorter than its header")
    magic, version, size = HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"not a parity frame of version {VERSION} (magic {magic!r}, version {version})")
    offset = HEADER.size
    if size > len(view) - offset:
        raise FrameError(f"a parity frame's metadata of {size} bytes runs past its end")
    meta = parity_pb2.ParityBatches()
    try:
        meta.ParseFromString(view[offset:offset + size])
    except Exception as exc:  # noqa: BLE001 - any parse failure is the frame's
        raise FrameError(f"a parity frame's metadata does not parse: {exc}") from None
    offset += size + _pad(size)
    out = []
    for b in meta.batches:
        entries = []
        for t in b.tables:
            if any(getattr(t, name) for name in FIELDS):
                raise FrameError("a parity frame's metadata carries bulk bytes: they belong in its sections")
            entry = []
            for _ in FIELDS:
                if offset + LENGTH.size > len(view):
                    raise FrameError("a parity frame ends before its last section")
                (n,) = LENGTH.unpack_from(view, offset)
                offset += LENGTH.size
                if n > len(view) - offset:
                    raise FrameError(f"a parity frame's section of {n} bytes runs past its end")
                entry.append(view[offset:offset + n])
                offset += n + _pad(n)
            entries.append(tuple(entry))
        out.append(entries)
    if offset > len(view):
        raise FrameError("a parity frame ends inside its last section's padding")
    if offset != len(view):
        raise FrameError(f"a parity frame has {len(view) - offset} bytes beyond its last section")
    return meta, out


def sections_nbytes(entries) -> int:
    """Bytes of the sections of one batch's table entries (what they add to its metadata's size)."""
    return sum(len(memoryview(s).cast("B")) for entry in entries for s in entry)


def fill(batch: parity_pb2.ParityBatch, entries) -> parity_pb2.ParityBatch:
    """A copy of ``batch`` (metadata only) with its table entries' bulk fields set from ``entries``: the
    ``ParityBatch`` a relay or the protobuf path carries."""
    full = parity_pb2.ParityBatch()
    full.CopyFrom(batch)
    for t, entry in zip(full.tables, entries):
        for name, section in zip(FIELDS, entry):
            setattr(t, name, bytes(memoryview(section).cast("B")))
    return full
