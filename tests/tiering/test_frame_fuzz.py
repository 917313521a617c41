"""Hypothesis fuzzer of the block frame parser (issue 32, item 4).

What a user would notice: a reader handed any bytes either gets the exact payload that was framed or a
typed BlockError -- never another exception, never different bytes. Every byte of the header and the
payload is under the checksum; the zero padding after the payload (up to the 4 KiB boundary) is not, and
is checked to be zero instead: a flip anywhere is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planekv.tiering import (
    HEADER_BYTES,
    BlockError,
    BlockKey,
    decode_frame,
    decode_header,
    encode_frame,
    iter_frames,
    verify_frame,
)
from planekv.tiering.frame import MAGIC, MAX_PLANES, aligned

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_seq_first = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_seq_rest = _seq_first + "_.-"


@st.composite
def keys(draw) -> BlockKey:
    fid = draw(st.text("0123456789abcdef", min_size=16, max_size=16))
    seq = draw(st.text(_seq_first, min_size=1, max_size=1)) + draw(st.text(_seq_rest, max_size=127))
    p0 = draw(st.integers(0, (1 << 32) - 2))
    p1 = draw(st.integers(p0 + 1, (1 << 32) - 1))
    b0 = draw(st.integers(0, MAX_PLANES - 1))
    b1 = draw(st.integers(b0 + 1, MAX_PLANES))
    return BlockKey(fid, seq, draw(st.sampled_from("kv")), draw(st.integers(0, 65535)),
                    draw(st.integers(0, 65535)), p0, p1, b0, b1)


payloads = st.binary(max_size=9000)


def _parse_all(buf: bytes, framed: dict[BlockKey, bytes] | None = None) -> None:
    """Run every parser entry point on ``buf``; only BlockError may escape, and any frame returned must hold
    exactly the payload that was framed under its key (when ``framed`` knows the key)."""
    framed = framed or {}
    for fn in (decode_header, verify_frame):
        try:
            fn(buf)
        except BlockError:
            pass
    try:
        hdr, body = decode_frame(buf)
    except BlockError:
        pass
    else:
        if hdr.key in framed:
            assert bytes(body) == framed[hdr.key]
    try:
        for hdr, body in iter_frames(buf):
            if hdr.key in framed:
                assert bytes(body) == framed[hdr.key]
    except BlockError:
        pass


@SETTINGS
@given(st.binary(max_size=10_000))
def test_arbitrary_bytes_raise_only_block_errors(buf):
    _parse_all(buf)


@SETTINGS
@given(st.binary(min_size=0, max_size=HEADER_BYTES + 64))
def test_bytes_behind_a_valid_magic_raise_only_block_errors(tail):
    # Random bytes after the magic get past the first check and exercise the field parsing.
    buf = MAGIC + tail
    _parse_all(buf)
    # Also with a plausible version / header size, so the key fields are parsed from random bytes.
    buf2 = bytearray(MAGIC + b"\x01\x00\x00\x10" + tail)
    _parse_all(bytes(buf2))


@SETTINGS
@given(keys(), payloads)
def test_round_trip(key, payload):
    frame = encode_frame(key, payload)
    assert len(frame) == HEADER_BYTES + aligned(len(payload))
    hdr, body = decode_frame(frame, key)
    assert hdr.key == key and hdr.payload_bytes == len(payload) and bytes(body) == payload
    assert decode_header(frame).key == key
    [(h2, b2)] = list(iter_frames(frame))
    assert h2.key == key and bytes(b2) == payload


@SETTINGS
@given(keys(), payloads, st.data())
def test_any_single_byte_flip_is_refused(key, payload, data):
    frame = encode_frame(key, payload)
    covered_end = HEADER_BYTES + len(payload)
    pos = data.draw(st.integers(0, len(frame) - 1), label="pos")
    xor = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(frame)
    bad[pos] ^= xor
    bad = bytes(bad)
    assert covered_end <= len(frame)  # header and payload under the checksum, the padding checked zero
    with pytest.raises(BlockError):
        decode_frame(bad)
    with pytest.raises(BlockError):
        verify_frame(bad)
    with pytest.raises(BlockError):
        list(iter_frames(bad))
    _parse_all(bad, {key: payload})


@SETTINGS
@given(keys(), payloads, st.data())
def test_truncation_is_refused(key, payload, data):
    frame = encode_frame(key, payload)
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    short = frame[:cut]
    with pytest.raises(BlockError):
        decode_frame(short)
    if cut == 0:
        assert list(iter_frames(short)) == []  # an empty batch body holds no frames
    else:
        with pytest.raises(BlockError):
            list(iter_frames(short))


@SETTINGS
@given(keys(), payloads, st.binary(min_size=1, max_size=5000))
def test_appended_bytes_are_refused(key, payload, extra):
    frame = encode_frame(key, payload)
    with pytest.raises(BlockError):
        decode_frame(frame + extra)
    # a batch body with garbage after the last frame: the good frame may come out, then BlockError
    got = []
    with pytest.raises(BlockError):
        for hdr, body in iter_frames(frame + extra):
            got.append((hdr.key, bytes(body)))
    assert all(k == key and b == payload for k, b in got[:1])


@SETTINGS
@given(st.lists(st.tuples(keys(), payloads), min_size=1, max_size=4, unique_by=lambda kp: kp[0]),
       st.data())
def test_batch_with_a_flip_never_yields_wrong_bytes(items, data):
    framed = dict(items)
    body = b"".join(encode_frame(k, p) for k, p in items)
    assert [(h.key, bytes(b)) for h, b in iter_frames(body)] == list(items)
    pos = data.draw(st.integers(0, len(body) - 1), label="pos")
    bad = bytearray(body)
    bad[pos] ^= data.draw(st.integers(1, 255), label="xor")
    try:
        for hdr, b in iter_frames(bytes(bad)):
            assert bytes(b) == framed[hdr.key]
    except BlockError:
        pass


def test_every_byte_of_a_frame_is_covered():
    """Exhaustive: flip each byte of a small frame in turn: every header byte (0..4095), payload byte and
    padding byte is refused."""
    key = BlockKey("0123456789abcdef", "seq-exhaustive", "v", 7, 3, 10, 12, 0, 8)
    payload = bytes((i * 31 + 7) % 256 for i in range(100))
    frame = encode_frame(key, payload)
    uncovered = []
    for pos in range(len(frame)):
        bad = bytearray(frame)
        bad[pos] ^= 0x5A
        try:
            _, body = decode_frame(bytes(bad))
        except BlockError:
            continue
        assert bytes(body) == payload  # never other bytes
        uncovered.append(pos)
    assert uncovered == []
