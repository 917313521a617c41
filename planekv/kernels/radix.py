"""Radix selection of the count-th largest key, shared by the Key allocation, the Value allocation and Key
refinement.

Keys are the bit patterns of non-negative float32 gains (31 magnitude bits), so their integer order is their
float order. A selection runs NPASS passes of RBITS bits: each pass adds to a histogram of the digit of the
keys that match the digits chosen so far, and the group's last program to arrive (:func:`_arrive`) picks the
digit that holds the count-th key and stores it with the keys still to take. ``_prep`` selects within one
program (:func:`_kth_largest`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _load_scalar

# Radix select over the 31 magnitude bits of a non-negative float32, RBITS bits per pass (the last
# pass takes what is left). tl.histogram costs O(keys x bins), so small digits and more passes win.
RBITS = tl.constexpr(4)


NBINS = tl.constexpr(16)


NPASS = tl.constexpr(8)


# int32 words per group: 8 histograms of 16 bins, then per pass the digits chosen so far and the keys
# still to take among those that match them (written by the selection after each pass), then per
# pass a count of the programs that have added to its histogram (the last one selects: _arrive)
HSTRIDE = tl.constexpr(16 * 8 + 2 * 8 + 8)


SELBASE = tl.constexpr(16 * 8)


CNTBASE = tl.constexpr(16 * 8 + 2 * 8)


HIST_STRIDE = 16 * 8 + 2 * 8 + 8


@triton.jit
def _select_digit(hist_ptr, NB: tl.constexpr, need):
    """Digit D of the need-th largest key given a histogram of that digit (keys that matched the
    prefix so far), and how many keys of digit D are still to be taken. The histogram is read past the
    L1 (other programs of the same launch added to it: :func:`_arrive`)."""
    idx = tl.arange(0, NB)
    h = tl.load(hist_ptr + idx, volatile=True)
    total = tl.sum(h, 0)
    ge = total - tl.cumsum(h, 0) + h  # keys with digit >= idx
    dsel = tl.max(tl.where(ge >= need, idx, -1), 0)
    above = tl.sum(tl.where(idx > dsel, h, 0), 0)
    return dsel, need - above


@triton.jit
def _select_pass(hbase, count, PASS: tl.constexpr):
    """The selection after radix pass PASS for the group whose words start at ``hbase``: the digit of the
    count-th largest key, appended to the digits of earlier passes, and the keys still to take among those
    matching them, stored once (SELBASE + 2 (PASS - 1)) for the next pass and the Value stage to read."""
    if PASS == 1:
        pref = count * 0
        rem = tl.maximum(count, 1)
    else:
        pref = _load_scalar(hbase + SELBASE + 2 * (PASS - 2))
        rem = _load_scalar(hbase + SELBASE + 2 * (PASS - 2) + 1)
    dsel, rem = _select_digit(hbase + (PASS - 1) * NBINS, NBINS, rem)
    pref = (pref << min(RBITS, 31 - RBITS * (PASS - 1))) | dsel
    tl.store(hbase + SELBASE + 2 * (PASS - 1), pref)
    tl.store(hbase + SELBASE + 2 * (PASS - 1) + 1, rem)


@triton.jit
def _arrive(hbase, count, n_prog, PASS: tl.constexpr):
    """A program's arrival after its share of radix pass PASS: the last of the group's ``n_prog`` programs
    to arrive runs the selection (no launch of its own). The barrier
    orders every thread's histogram adds before thread 0's acq_rel increment (the pattern of a
    grid-wide reduction's last block); the last program reads the histogram with volatile loads.
    ``_prep`` zeroes the counters every step."""
    tl.debug_barrier()
    if tl.atomic_add(hbase + CNTBASE + (PASS - 1), 1, sem="acq_rel") == n_prog - 1:
        _select_pass(hbase, count, PASS)


@triton.jit
def _radix_digit(key, PASS: tl.constexpr):
    """Radix pass PASS reads bits [SH, SH + width) of a 31-bit key (4 bits, the last pass what is
    left): (the bits above them, where the prefix chosen by earlier passes sits; the digit)."""
    SH: tl.constexpr = max(31 - RBITS * PASS, 0)
    SH_PREV: tl.constexpr = 31 - RBITS * (PASS - 1)
    WIDTH: tl.constexpr = min(RBITS, 31 - RBITS * (PASS - 1))
    MASK: tl.constexpr = (NBINS - 1) >> (RBITS - WIDTH)
    return key >> SH_PREV, (key >> SH) & MASK


@triton.jit
def _kth_largest(keys, count):
    """The count-th largest of the keys >= 0 (31-bit patterns; negative ones are padding), 1 <= count <=
    their number: NPASS radix passes of RBITS bits, each a histogram of the keys that match the digits
    chosen so far (the masked keys counted in an upper half of bins that is never read: no mask beside
    the values, see :func:`_pass_hist`) and the digit that holds the count-th key."""
    ok = keys >= 0
    pref = count * 0
    rem = tl.maximum(count, 1)
    idx = tl.arange(0, 2 * NBINS)
    for pas in tl.static_range(1, NPASS + 1):
        above, digit = _radix_digit(keys, pas)
        h = tl.histogram(tl.where(ok & (above == pref), digit, NBINS), 2 * NBINS)
        h = tl.where(idx < NBINS, h, 0)
        ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # keys of this digit or a larger one
        dsel = tl.max(tl.where(ge >= rem, idx, -1), 0)
        rem -= tl.sum(tl.where(idx > dsel, h, 0), 0)
        pref = (pref << min(RBITS, 31 - RBITS * (pas - 1))) | dsel
    return pref
