"""The block frame: round trip, and every way a reader rejects bytes, each with its own test."""

from __future__ import annotations

import struct

import pytest

from planekv.kvstore import FormatMismatch
from planekv.tiering import (
    HEADER_BYTES,
    BadBlockKey,
    BadMagic,
    BlockCorrupt,
    BlockKey,
    BlockKeyMismatch,
    ChecksumMismatch,
    FrameTruncated,
    UnknownFrameVersion,
    decode_frame,
    decode_header,
    encode_frame,
    iter_frames,
    verify_frame,
)

FID = "0123456789abcdef"
KEY = BlockKey(FID, "seq-1", "k", 3, 1, 0, 16, 2, 8)


def payload(n: int = 10_000) -> bytes:
    return bytes((i * 7) % 251 for i in range(n))


def test_round_trip_is_4k_aligned_and_returns_the_payload():
    for n in (0, 1, 4096, 10_000, 1 << 20):
        frame = encode_frame(KEY, payload(n))
        assert len(frame) % 4096 == 0 and len(frame) == HEADER_BYTES + -(-n // 4096) * 4096
        hdr, body = decode_frame(frame, KEY)
        assert hdr.key == KEY and hdr.payload_bytes == n and bytes(body) == payload(n)


def test_key_string_round_trip_and_geometry_in_the_key():
    assert str(KEY) == f"{FID}:seq-1:k:3:1:0-16:2-8"
    assert BlockKey.parse(str(KEY)) == KEY
    assert KEY.n_pages == 16 and KEY.n_planes == 6


@pytest.mark.parametrize("text", [
    "nothex0123456789:seq:k:0:0:0-1:0-1",   # format id not hex
    f"{FID}:seq:x:0:0:0-1:0-1",              # kind
    f"{FID}:seq:k:0:0:5-5:0-1",              # empty page range
    f"{FID}:seq:k:0:0:0-1:3-9",              # plane past W = 8
    f"{FID}:se/q:k:0:0:0-1:0-1",             # sequence id charset
    f"{FID}:seq:k:70000:0:0-1:0-1",          # layer out of range
])
def test_bad_keys_are_rejected_with_a_message(text):
    with pytest.raises(BadBlockKey, match=r"."):
        BlockKey.parse(text)


def test_wrong_magic_is_rejected():
    frame = bytearray(encode_frame(KEY, payload()))
    frame[:8] = b"NOTAKVBK"
    with pytest.raises(BadMagic):
        verify_frame(frame, KEY)


def test_unknown_version_is_rejected():
    frame = bytearray(encode_frame(KEY, payload()))
    struct.pack_into("<H", frame, 8, 99)
    with pytest.raises(UnknownFrameVersion, match="version 99"):
        verify_frame(frame, KEY)


def test_wrong_format_is_rejected():
    frame = encode_frame(KEY, payload())
    other = BlockKey("fedcba9876543210", *[getattr(KEY, f) for f in (
        "sequence_id", "kind", "layer", "kv_head", "page_start", "page_end", "plane_start", "plane_end")])
    with pytest.raises(FormatMismatch, match="fedcba9876543210"):
        verify_frame(frame, other)


def test_wrong_key_is_rejected():
    frame = encode_frame(KEY, payload())
    for other in (BlockKey(FID, "seq-1", "v", 3, 1, 0, 16, 2, 8), BlockKey(FID, "seq-1", "k", 3, 1, 0, 16, 3, 8),
                  BlockKey(FID, "seq-2", "k", 3, 1, 0, 16, 2, 8)):
        with pytest.raises(BlockKeyMismatch):
            verify_frame(frame, other)


def test_truncation_is_rejected():
    frame = encode_frame(KEY, payload())
    for cut in (100, HEADER_BYTES - 1, HEADER_BYTES + 10, len(frame) - 1):
        with pytest.raises(FrameTruncated):
            verify_frame(frame[:cut], KEY)


def test_bad_checksum_is_rejected():
    frame = bytearray(encode_frame(KEY, payload()))
    frame[HEADER_BYTES + 1234] ^= 0x10  # one payload bit
    with pytest.raises(ChecksumMismatch):
        verify_frame(frame, KEY)


def test_header_corruption_is_caught_by_the_checksum():
    frame = bytearray(encode_frame(KEY, payload()))
    frame[36] ^= 1  # layer 3 -> 2: still a valid key, so only the checksum can tell
    with pytest.raises(ChecksumMismatch):
        verify_frame(frame)


def test_trailing_bytes_are_rejected():
    with pytest.raises(BlockCorrupt, match="trailing"):
        verify_frame(encode_frame(KEY, payload()) + bytes(4096), KEY)


def test_header_only_parse_and_batch_split():
    keys = [BlockKey(FID, "seq-1", "v", layer, 0, 0, 8, 4, 8) for layer in range(3)]
    blob = b"".join(encode_frame(k, payload(5000 + i)) for i, k in enumerate(keys))
    assert decode_header(blob).key == keys[0]
    got = [(h.key, bytes(p)) for h, p in iter_frames(blob)]
    assert got == [(k, payload(5000 + i)) for i, k in enumerate(keys)]
    with pytest.raises(FrameTruncated):
        list(iter_frames(blob[:-4096]))
