"""Decoding the numeric fields of a chunk of TSV bytes with numpy, for the Criteo reader (``ecrec.workload.criteo``):
decimal integers and hexadecimal hashes, with a per-field mask of malformed values.

Fields of at most 8 bytes (all of Criteo's) take a word-at-a-time path (:class:`Fields`); longer ones, and integers
with a '+' sign, the general per-character one.
"""

from __future__ import annotations

import numpy as np

_MAX_INT_DIGITS = 18
_MAX_HEX_DIGITS = 64

_HEX = np.full(256, -1, dtype=np.int16)
_HEX[ord("0"):ord("9") + 1] = np.arange(10)
_HEX[ord("a"):ord("f") + 1] = np.arange(10, 16)
_HEX[ord("A"):ord("F") + 1] = np.arange(10, 16)
# _LEN_MASK[l]: the low l bytes of a word
_LEN_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)
_U = np.uint64
_ONES = 0x0101010101010101
_HIGH = _U(0x8080808080808080)


def _not_in_ranges(w: np.ndarray, ranges) -> np.ndarray:
    """Per byte of ``w``: 0xFF-style flag (the byte's high bit) where the byte is in none of ``ranges``."""
    x7 = w & _U(0x7F7F7F7F7F7F7F7F)

    def ge(lo: int) -> np.ndarray:  # high bit of each byte set iff byte >= lo (bytes < 0x80: no carries)
        return (x7 + _U((0x80 - lo) * _ONES)) & _HIGH

    inside = np.zeros_like(w)
    for lo, hi in ranges:
        inside |= ge(lo) & ~ge(hi + 1)
    flag = ((w & _HIGH) | (~inside & _HIGH)) >> _U(7)  # 1 in the low bit of each bad byte
    return flag * _U(0xFF)


class Fields:
    """Vectorized field decoding over one chunk's bytes.

    Fields of at most 8 bytes (all of Criteo's) are decoded eight characters at a
    time: one unaligned big-endian 64-bit load per field, right-aligned, then
    SIMD-within-a-register arithmetic, for the value and for the per-byte
    character-class checks.  Longer fields, and integers with a '+' sign, take
    the general per-character path.
    """

    def __init__(self, padded: np.ndarray, n: int):
        self.padded = padded
        self.arr = padded[:n]
        self.n = n
        self.words = np.ndarray(shape=(n,), dtype=">u8", buffer=padded, offset=0, strides=(1,))

    def _aligned(self, fs: np.ndarray, flen: np.ndarray) -> np.ndarray:
        """The (<= 8) bytes of each field as a right-aligned integer (first character most significant)."""
        w = self.words[np.minimum(fs, self.n - 1) if self.n else fs].astype(np.uint64)
        shift = (np.uint64(64) - np.minimum(flen, 8).astype(np.uint64) * np.uint64(8))
        w = np.where(flen == 0, _U(0), w >> np.minimum(shift, _U(63)))
        return w

    def ints(self, fs: np.ndarray, flen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(max(value, 0) as int64, bad mask)`` of decimal integer fields; empty is 0."""
        first = self.padded[fs]
        signed = first == 45  # '-'
        slow = (flen > 8) | (first == 43)  # long, or '+'
        w = self._aligned(fs, flen)
        d = w - (_U(0x3030303030303030) & _LEN_MASK[np.minimum(flen, 8)])
        d = ((d >> _U(8)) * _U(10) + d) & _U(0x00FF00FF00FF00FF)
        d = ((d >> _U(16)) * _U(100) + d) & _U(0x0000FFFF0000FFFF)
        d = ((d >> _U(32)) * _U(10000) + d) & _U(0x00000000FFFFFFFF)
        values = np.where(signed, 0, d.astype(np.int64))
        # a leading '-' is not checked as a digit
        body = _LEN_MASK[np.minimum(flen, 8) - signed.astype(np.int64).clip(0, None)]
        bad = (_not_in_ranges(w, ((0x30, 0x39),)) & body) != 0
        bad |= signed & (flen == 1)
        if slow.any():
            idx = np.flatnonzero(slow.reshape(-1))
            v, b = _parse_ints(self.arr, fs.reshape(-1)[idx], flen.reshape(-1)[idx])
            values.reshape(-1)[idx] = np.maximum(v, 0)
            bad.reshape(-1)[idx] = b
        return values, bad

    def hex(self, fs: np.ndarray, flen: np.ndarray, mods: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(int(field, 16) % mods, bad mask)`` of hex fields; empty is 0."""
        w = self._aligned(fs, flen)
        nib = (w & _U(0x0F0F0F0F0F0F0F0F)) + ((w >> _U(6)) & _U(0x0101010101010101)) * _U(9)
        nib = ((nib >> _U(4)) | nib) & _U(0x00FF00FF00FF00FF)
        nib = ((nib >> _U(8)) | nib) & _U(0x0000FFFF0000FFFF)
        nib = ((nib >> _U(16)) | nib) & _U(0x00000000FFFFFFFF)
        values = nib.astype(np.int64) % mods
        bad = (_not_in_ranges(w, ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66))) & _LEN_MASK[np.minimum(flen, 8)]) != 0
        slow = flen > 8
        if slow.any():
            idx = np.flatnonzero(slow.reshape(-1))
            v, b = _parse_hex(self.arr, fs.reshape(-1)[idx], flen.reshape(-1)[idx], mods.reshape(-1)[idx])
            values.reshape(-1)[idx] = v
            bad.reshape(-1)[idx] = b
        return values, bad


def _gather(arr: np.ndarray, fs: np.ndarray, flen: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Characters of fields as ``(..., width)`` uint8 (0 past a field's end) and the in-field mask."""
    j = np.arange(width, dtype=np.int64)
    inside = j < flen[..., None]
    chars = arr[np.minimum(fs[..., None] + j, max(arr.size - 1, 0))]
    chars[~inside] = 0
    return chars, inside


def _parse_ints(arr, fs, flen) -> tuple[np.ndarray, np.ndarray]:
    """General path: decimal integers with an optional sign; empty is 0. Returns ``(int64 values, bad mask)``."""
    width = int(min(max(int(flen.max(initial=0)), 1), _MAX_INT_DIGITS + 1))
    chars, inside = _gather(arr, fs, np.minimum(flen, width), width)
    signed = (chars[..., 0] == 45) | (chars[..., 0] == 43)  # '-' or '+'
    digits = chars.astype(np.int64) - 48
    is_digit = (digits >= 0) & (digits <= 9)
    ok_char = is_digit | ~inside
    ok_char[..., 0] |= signed
    bad = ~ok_char.all(axis=-1) | (signed & (flen == 1)) | (flen - signed > _MAX_INT_DIGITS)
    values = np.zeros(flen.shape, dtype=np.int64)
    for k in range(width):
        take = inside[..., k] & is_digit[..., k]
        values = np.where(take, values * 10 + digits[..., k], values)
    values = np.where(chars[..., 0] == 45, -values, values)
    return values, bad


def _parse_hex(arr, fs, flen, mods) -> tuple[np.ndarray, np.ndarray]:
    """General path: hex values modulo ``mods`` (same shape); empty is 0. Returns ``(int64 values, bad mask)``."""
    width = int(min(max(int(flen.max(initial=0)), 1), _MAX_HEX_DIGITS))
    chars, inside = _gather(arr, fs, np.minimum(flen, width), width)
    nibbles = _HEX[chars].astype(np.int64)
    bad = ((nibbles < 0) & inside).any(axis=-1) | (flen > _MAX_HEX_DIGITS)
    nibbles = np.maximum(nibbles, 0)
    values = np.zeros(flen.shape, dtype=np.int64)
    for k in range(width):
        values = np.where(inside[..., k], (values * 16 + nibbles[..., k]) % mods, values)
    return values, bad
