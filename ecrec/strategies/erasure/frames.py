"""The bytes of one ``StreamStripes`` reply: a frame of several blocks of a survivor's stripe members.

The fast rebuild moves most of a lost server's shard over the network (``k`` rows received per row
rebuilt), so its replies skip protobuf: a protobuf message of ``bytes`` fields costs three more copies of
every byte on each side (set the field, serialize, parse) than the gRPC transfer itself.  A frame is one
``bytes`` object that gRPC sends as it is; the replacement reads its sections as numpy views of the
received buffer and decodes straight from them.

Layout (little-endian), sections in this order, each immediately after the previous one::

    header            48 bytes: b"ECSF", version (u16), k (u16), first_block (i64), blocks (i64),
                      data positions p (u32), parity indices j (u32), row_bytes (u32), 4 bytes of padding,
                      confirmed_upto (i64): the sender's confirmed bound, read after its data rows (a data row
                      above it must not be embedded in a rebuilt parity: ``ReadRowsReply.confirmed_upto``)
    data_versions     int64 (p, blocks)
    parity_versions   int64 (j, blocks, k)
    data              uint8 (p, blocks, row_bytes): each position's rows one contiguous run, in block order
    parity            uint8 (j, blocks, row_bytes)
    data_ready        uint8 (p, blocks): 1 = ready
    parity_ready      uint8 (j, blocks)

The int64 sections come first so that they start 8-byte aligned.  :func:`allocate` gives a survivor a
buffer (header written) and writable views to fill; :func:`parse` checks a received frame against what was
asked and returns views of it; :func:`size_from_header` tells a reader of a byte stream how much to read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

#: the gRPC method (registered by hand, not in parity.proto: its replies are frames, not protobuf messages)
SERVICE, METHOD = "ecrec.wire.ParityService", "StreamStripes"
FULL_METHOD = f"/{SERVICE}/{METHOD}"
MAGIC = b"ECSF"
VERSION = 2
HEADER = struct.Struct("<4sHHqqIII4xq")
#: where ``confirmed_upto`` sits in the header (written after the rows: :func:`set_confirmed`)
CONFIRMED = struct.Struct("<q")
CONFIRMED_OFFSET = HEADER.size - CONFIRMED.size


class FrameError(ValueError):
    """A received frame does not match what was asked (a peer speaking another version, or a bug)."""


@dataclass
class Frame:
    """Views of one frame's sections (see the module docstring for their shapes)."""

    first_block: int
    blocks: int
    confirmed_upto: int
    data: np.ndarray
    data_versions: np.ndarray
    data_ready: np.ndarray
    parity: np.ndarray
    parity_versions: np.ndarray
    parity_ready: np.ndarray


def block_bytes(positions: int, indices: int, row_bytes: int, k: int) -> int:
    """Bytes one block adds to a frame of ``positions`` data positions and ``indices`` parity indices."""
    return positions * (row_bytes + 9) + indices * (row_bytes + 8 * k + 1)


def frame_bytes(blocks: int, positions: int, indices: int, row_bytes: int, k: int) -> int:
    return HEADER.size + blocks * block_bytes(positions, indices, row_bytes, k)


def _views(buffer: np.ndarray, blocks: int, p: int, j: int, row_bytes: int, k: int, ready_dtype) -> dict:
    sizes = [("data_versions", np.int64, (p, blocks)), ("parity_versions", np.int64, (j, blocks, k)),
             ("data", np.uint8, (p, blocks, row_bytes)), ("parity", np.uint8, (j, blocks, row_bytes)),
             ("data_ready", np.uint8, (p, blocks)), ("parity_ready", np.uint8, (j, blocks))]
    out, offset = {}, HEADER.size
    for name, dtype, shape in sizes:
        count = int(np.prod(shape))
        view = buffer[offset:offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
        offset += count * np.dtype(dtype).itemsize
        out[name] = view
    if ready_dtype is bool:
        out["data_ready"] = out["data_ready"] != 0
        out["parity_ready"] = out["parity_ready"] != 0
    return out


def allocate(first_block: int, blocks: int, positions: int, indices: int, row_bytes: int, k: int
             ) -> tuple[np.ndarray, Frame]:
    """A frame's buffer (header written) and writable views of its sections, for the sender to fill; the
    buffer is what goes on the wire (as it is over a connection, as ``bytes`` on the gRPC stream)."""
    buffer = np.empty(frame_bytes(blocks, positions, indices, row_bytes, k), np.uint8)
    buffer[:HEADER.size] = np.frombuffer(HEADER.pack(MAGIC, VERSION, k, first_block, blocks, positions, indices,
                                                     row_bytes, 0), np.uint8)
    return buffer, Frame(first_block, blocks, 0, **_views(buffer, blocks, positions, indices, row_bytes, k, np.uint8))


def set_confirmed(buffer: np.ndarray, confirmed_upto: int) -> None:
    """Writes the sender's confirmed bound into a frame's header (after its data rows were read)."""
    buffer[CONFIRMED_OFFSET:HEADER.size] = np.frombuffer(CONFIRMED.pack(confirmed_upto), np.uint8)


def _header(frame) -> tuple:
    if len(frame) < HEADER.size:
        raise FrameError(f"frame of {len(frame)} bytes is shorter than its {HEADER.size}-byte header")
    fields = HEADER.unpack_from(frame)
    if fields[0] != MAGIC or fields[1] != VERSION:
        raise FrameError(f"not a version-{VERSION} stripe frame (magic {fields[0]!r}, version {fields[1]})")
    return fields


def size_from_header(header) -> int:
    """A frame's size in bytes from its first :data:`HEADER` ``.size`` bytes (a reader of a byte stream)."""
    _, _, k, _, blocks, p, j, rb, _ = _header(header)
    if blocks < 1:
        raise FrameError(f"frame header announces {blocks} blocks")
    return frame_bytes(blocks, p, j, rb, k)


def parse(frame, positions: int, indices: int, row_bytes: int, k: int) -> Frame:
    """Views of a received frame (``bytes`` or a uint8 array; ready flags as bool copies); raises
    :class:`FrameError` when its header or size does not match ``positions``, ``indices``, ``row_bytes``
    and ``k``."""
    _, _, fk, first_block, blocks, p, j, rb, confirmed_upto = _header(frame)
    if (fk, p, j, rb) != (k, positions, indices, row_bytes) or blocks < 1 or first_block < 0:
        raise FrameError(f"frame of k={fk}, {p} positions, {j} parity indices, {rb}-byte rows, {blocks} blocks "
                         f"from block {first_block}; asked for k={k}, {positions} positions, {indices} indices, "
                         f"{row_bytes}-byte rows")
    expected = frame_bytes(blocks, p, j, rb, k)
    if len(frame) != expected:
        raise FrameError(f"frame of {blocks} blocks has {len(frame)} bytes, expected {expected}")
    buffer = frame if isinstance(frame, np.ndarray) else np.frombuffer(frame, np.uint8)
    return Frame(first_block, blocks, confirmed_upto, **_views(buffer, blocks, p, j, rb, k, bool))
