"""The block frame (DESIGN section 5): a self-describing, checksummed, 4 KiB aligned container of
one block of cold planes.

Layout (little-endian), one 4096-byte header then the payload, zero-padded to a 4 KiB multiple::

    off  size  field
      0     8  magic            b"PLNKVBLK"
      8     2  frame version    1
     10     2  header bytes     4096
     12     4  flags            0 (reserved)
     16    16  format_id        16 ASCII hex digits (FormatSpec.format_id)
     32     1  kind             b"k" or b"v"
     33     1  plane_start      first plane held (0..7)
     34     1  plane_end        one past the last plane held (1..8)
     35     1  sequence length  n (1..128)
     36     4  layer
     40     4  kv_head
     44     4  page_start       first page held
     48     4  page_end         one past the last page held
     52     8  payload bytes
     60     8  checksum         xxh3-64 over the header (this field zeroed) and the payload
     68   128  sequence id      n UTF-8 bytes, zero-padded
    196  3900  zero

The key (format, sequence, K or V, layer, KV head, page range, plane range) is inside the frame, so
a block can never be read as another block or under another layout. The frame is the unit of
storage and of transfer: the store keeps and serves frames byte for byte.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from ..kvstore.errors import FormatMismatch
from .errors import (
    BadBlockKey,
    BadMagic,
    BlockCorrupt,
    BlockKeyMismatch,
    ChecksumMismatch,
    FrameTruncated,
    UnknownFrameVersion,
)

MAGIC = b"PLNKVBLK"
FRAME_VERSION = 1
HEADER_BYTES = 4096
ALIGN = 4096
MAX_PLANES = 8  # W <= 8 (FormatSpec.width)
MAX_SEQUENCE_BYTES = 128

_FIXED = struct.Struct("<8sHHI16sc3B4IQQ128s")  # everything up to and including the sequence id
_CHECKSUM_OFFSET = 60
assert _FIXED.size == 196
_ZERO_CHECKSUM = bytes(8)
_HEADER_PAD = bytes(HEADER_BYTES - _FIXED.size)

FORMAT_ID_RE = re.compile(r"^[0-9a-f]{16}$")
SEQUENCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
# The string form of a key: format:sequence:kind:layer:head:p0-p1:b0-b1 (also the store's URL path).
KEY_PATTERN = (r"^[0-9a-f]{16}:[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}:[kv]:[0-9]{1,5}:[0-9]{1,5}"
               r":[0-9]{1,10}-[0-9]{1,10}:[0-9]-[0-9]$")
_KEY_RE = re.compile(KEY_PATTERN)
_U16 = 1 << 16
_U32 = 1 << 32


def aligned(n: int) -> int:
    """``n`` bytes rounded up to the frame alignment (4 KiB)."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, order=True)
class BlockKey:
    """Identity of one block: pages ``[page_start, page_end)`` and planes ``[plane_start, plane_end)``
    of K or V of one sequence, layer and KV head, under one format."""

    format_id: str
    sequence_id: str
    kind: str  # "k" or "v"
    layer: int
    kv_head: int
    page_start: int
    page_end: int
    plane_start: int
    plane_end: int

    def __post_init__(self) -> None:
        if not isinstance(self.format_id, str) or not FORMAT_ID_RE.match(self.format_id):
            raise BadBlockKey(f"format_id must be 16 lowercase hex digits (FormatSpec.format_id), "
                              f"got {self.format_id!r}")
        if not isinstance(self.sequence_id, str) or not SEQUENCE_ID_RE.match(self.sequence_id):
            raise BadBlockKey(f"sequence_id must be 1-128 of [A-Za-z0-9_.-] starting with a letter or digit, "
                              f"got {self.sequence_id!r}")
        if self.kind not in ("k", "v"):
            raise BadBlockKey(f"kind must be 'k' or 'v', got {self.kind!r}")
        for name, hi in (("layer", _U16), ("kv_head", _U16)):
            val = getattr(self, name)
            if not isinstance(val, int) or not 0 <= val < hi:
                raise BadBlockKey(f"{name} must be an integer in [0, {hi}), got {val!r}")
        if not (isinstance(self.page_start, int) and isinstance(self.page_end, int)
                and 0 <= self.page_start < self.page_end < _U32):
            raise BadBlockKey(f"page range must satisfy 0 <= page_start < page_end < 2^32, got "
                              f"[{self.page_start}, {self.page_end})")
        if not (isinstance(self.plane_start, int) and isinstance(self.plane_end, int)
                and 0 <= self.plane_start < self.plane_end <= MAX_PLANES):
            raise BadBlockKey(f"plane range must satisfy 0 <= plane_start < plane_end <= {MAX_PLANES}, got "
                              f"[{self.plane_start}, {self.plane_end})")

    def __str__(self) -> str:
        return (f"{self.format_id}:{self.sequence_id}:{self.kind}:{self.layer}:{self.kv_head}"
                f":{self.page_start}-{self.page_end}:{self.plane_start}-{self.plane_end}")

    @classmethod
    def parse(cls, text: str) -> BlockKey:
        """Inverse of ``str(key)``; raises BadBlockKey with what is wrong."""
        if not isinstance(text, str) or not _KEY_RE.match(text):
            raise BadBlockKey(
                f"block key {text!r} is not of the form format_id:sequence_id:k|v:layer:kv_head:"
                "page_start-page_end:plane_start-plane_end (e.g. 0123456789abcdef:seq-1:k:0:1:0-16:2-8)")
        fid, seq, kind, layer, head, pages, planes = text.split(":")
        p0, p1 = pages.split("-")
        b0, b1 = planes.split("-")
        return cls(fid, seq, kind, int(layer), int(head), int(p0), int(p1), int(b0), int(b1))

    @property
    def n_pages(self) -> int:
        return self.page_end - self.page_start

    @property
    def n_planes(self) -> int:
        return self.plane_end - self.plane_start


@dataclass(frozen=True)
class FrameHeader:
    """The parsed header of a frame; ``frame_bytes`` = header + payload padded to 4 KiB."""

    key: BlockKey
    version: int
    payload_bytes: int
    checksum: int

    @property
    def frame_bytes(self) -> int:
        return HEADER_BYTES + aligned(self.payload_bytes)


def _pack_header(key: BlockKey, payload_bytes: int, checksum: int) -> bytes:
    seq = key.sequence_id.encode()
    fixed = _FIXED.pack(MAGIC, FRAME_VERSION, HEADER_BYTES, 0, key.format_id.encode(), key.kind.encode(),
                        key.plane_start, key.plane_end, len(seq), key.layer, key.kv_head, key.page_start,
                        key.page_end, payload_bytes, checksum, seq)
    return fixed + _HEADER_PAD


def _checksum(header: bytes | memoryview, payload: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(header[:_CHECKSUM_OFFSET])
    h.update(_ZERO_CHECKSUM)
    h.update(header[_CHECKSUM_OFFSET + 8:HEADER_BYTES])
    h.update(payload)
    return h.intdigest()


def frame_header(key: BlockKey, payload: bytes | bytearray | memoryview) -> bytes:
    """The 4096-byte header of ``payload`` framed under ``key``, checksum included. A frame is this header, the
    payload and zero padding to 4 KiB (:func:`encode_frame`), so a buffer laid out that way is framed in place."""
    payload = memoryview(payload).cast("B")
    n = payload.nbytes
    return _pack_header(key, n, _checksum(_pack_header(key, n, 0), payload))


def encode_frame(key: BlockKey, payload: bytes | bytearray | memoryview) -> bytes:
    """Frame ``payload`` (any bytes) under ``key``: header, payload, zero padding to 4 KiB."""
    payload = memoryview(payload).cast("B")
    n = payload.nbytes
    return b"".join((frame_header(key, payload), payload, bytes(aligned(n) - n)))


def decode_header(buf: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and sanity-check the header (magic, version, fields); checks nothing past the header."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_BYTES:
        if mv.nbytes >= 8 and bytes(mv[:8]) != MAGIC:
            raise BadMagic("not a PlaneKV block frame (bad magic)")
        raise FrameTruncated(f"frame truncated: {mv.nbytes} bytes, shorter than the {HEADER_BYTES}-byte header")
    (magic, version, header_bytes, _flags, fid, kind, b0, b1, seq_len, layer, head, p0, p1, n, ck,
     seq) = _FIXED.unpack_from(mv)
    if magic != MAGIC:
        raise BadMagic(f"not a PlaneKV block frame (magic {magic!r}, expected {MAGIC!r})")
    if version != FRAME_VERSION:
        raise UnknownFrameVersion(f"frame version {version} is unknown; this build reads version {FRAME_VERSION}")
    if header_bytes != HEADER_BYTES or not 1 <= seq_len <= MAX_SEQUENCE_BYTES:
        raise BlockCorrupt(f"malformed frame header (header size {header_bytes}, sequence length {seq_len})")
    try:
        key = BlockKey(fid.decode("ascii"), seq[:seq_len].decode("utf-8"), kind.decode("ascii"),
                       layer, head, p0, p1, b0, b1)
    except (UnicodeDecodeError, BadBlockKey) as exc:
        raise BlockCorrupt(f"malformed frame header: {exc}") from None
    return FrameHeader(key=key, version=version, payload_bytes=n, checksum=ck)


def verify_frame(buf: bytes | bytearray | memoryview, expect_key: BlockKey | None = None) -> FrameHeader:
    """Check a whole frame and return its header.

    Raises, in this order: FrameTruncated / BadMagic / UnknownFrameVersion / BlockCorrupt (header),
    FrameTruncated (fewer bytes than the header promises) or BlockCorrupt (trailing bytes),
    ChecksumMismatch, BlockCorrupt (non-zero padding after the payload), then, for an intact frame,
    FormatMismatch (other format than ``expect_key``'s) and BlockKeyMismatch (same format, other block).
    """
    mv = memoryview(buf).cast("B")
    hdr = decode_header(mv)
    if mv.nbytes < HEADER_BYTES + hdr.payload_bytes:
        raise FrameTruncated(f"frame truncated: {mv.nbytes} bytes, the header promises "
                             f"{HEADER_BYTES + hdr.payload_bytes} (+ padding to {hdr.frame_bytes})")
    if mv.nbytes != hdr.frame_bytes:
        if mv.nbytes < hdr.frame_bytes:
            raise FrameTruncated(f"frame truncated: {mv.nbytes} bytes, expected {hdr.frame_bytes} "
                                 "(payload padded to 4 KiB)")
        raise BlockCorrupt(f"frame has {mv.nbytes - hdr.frame_bytes} trailing bytes after its "
                           f"{hdr.frame_bytes}-byte frame")
    ck = _checksum(mv[:HEADER_BYTES], mv[HEADER_BYTES:HEADER_BYTES + hdr.payload_bytes])
    if ck != hdr.checksum:
        raise ChecksumMismatch(f"checksum mismatch for block {hdr.key}: stored {hdr.checksum:016x}, "
                               f"computed {ck:016x}; the bytes were corrupted")
    if bytes(mv[HEADER_BYTES + hdr.payload_bytes:]).strip(b"\0"):  # the padding is not under the checksum
        raise BlockCorrupt(f"block {hdr.key}: the padding after its payload is not zero; the bytes were corrupted")
    if expect_key is not None:
        if hdr.key.format_id != expect_key.format_id:
            raise FormatMismatch(f"block {hdr.key} has format {hdr.key.format_id}, but format "
                                 f"{expect_key.format_id} was asked for; read it with the FormatSpec "
                                 "it was written under")
        if hdr.key != expect_key:
            raise BlockKeyMismatch(f"frame holds block {hdr.key}, not {expect_key}")
    return hdr


def decode_frame(buf: bytes | bytearray | memoryview, expect_key: BlockKey | None = None
                 ) -> tuple[FrameHeader, memoryview]:
    """Verify a frame (see :func:`verify_frame`) and return its header and a view of the payload."""
    hdr = verify_frame(buf, expect_key)
    mv = memoryview(buf).cast("B")
    return hdr, mv[HEADER_BYTES:HEADER_BYTES + hdr.payload_bytes]


def iter_frames(buf: bytes | bytearray | memoryview) -> Iterator[tuple[FrameHeader, memoryview]]:
    """Split a concatenation of frames (a batch GET body), verifying each."""
    mv = memoryview(buf).cast("B")
    off = 0
    while off < mv.nbytes:
        hdr = decode_header(mv[off:])
        end = off + hdr.frame_bytes
        if end > mv.nbytes:
            raise FrameTruncated(f"frame of {hdr.key} truncated: {mv.nbytes - off} of {hdr.frame_bytes} bytes")
        yield decode_frame(mv[off:end])
        off = end
