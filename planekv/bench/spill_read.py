"""`planekv bench spill`: the spill tier's reads against a plain read loop of the same library over the same files,
in one run (issue 33: kvikio reads at >= 80% of a plain kvikio read loop on the same machine).

N blocks (framed, 4 KiB aligned) are written through a :class:`~planekv.tiering.SpillTier`; then the same list of
(file, offset, length) reads is timed, ``reps`` passes each, alternating which goes first:

- ``tier``: ``SpillTier.read_page`` (its cached handle, its checksum check: part of the tier's cost);
- ``plain``: the library alone, one open per file with all of that file's ranges read before the next file
  (kvikio: ``with kvikio.CuFile(path, "r") as f: f.pread(buf, size, offset).get()``; posix: ``os.preadv`` on an fd
  opened once per file), no checksum, into the same destination buffer.

The tier reads into host memory only (pinned where CUDA is up), so ``plain`` reads into that same buffer: like with
like. With ``--device cuda`` and kvikio, a ``plain-cuda`` row also reads straight into a CUDA tensor (no tier row to
compare with: the tier does not read into GPU memory).

Three workloads (``--modes``): ``page`` (each block's pages of ``--page-kib``, one read each), ``run`` (each
block's pages as one run: ``SpillTier.read_pages``, the host tier's read of a spilled block's pages, against one
plain read of the same bytes) and ``block`` (a second set of blocks whose single page is the whole block). "first"
is the first pass, "warm" the median of the later ones; the files were just written, so even the first pass may be
served from the page cache (dropping it needs root): neither figure is a cold-NVMe figure unless the files outgrow
the host's memory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..tiering import SpillTier
from ..tiering.frame import HEADER_BYTES, BlockKey, encode_frame
from ..tiering.spill_tier import KVIKIO, POSIX, _page_checksum

FORMAT = "0123456789abcdef"
MODES = ("page", "run", "block")
BACKENDS = ("auto", POSIX, KVIKIO)


@dataclass(frozen=True)
class SpillConfig:
    blocks: int = 64
    block_bytes: int = 1 << 20  # payload bytes per block (the frame adds a 4 KiB header)
    page_bytes: int = 16 << 10
    reps: int = 5
    backend: str = "auto"
    device: str = "cpu"  # "cuda": pinned host buffers, and a plain kvikio loop into a CUDA tensor
    modes: tuple[str, ...] = MODES
    max_open_files: int = 64

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")
        if self.page_bytes < 1 or self.block_bytes < 1:
            raise ValueError(f"page and block bytes must be >= 1, got {self.page_bytes} and {self.block_bytes}")
        if self.page_bytes > self.block_bytes:
            raise ValueError(f"a page ({self.page_bytes} bytes) cannot be larger than a block ({self.block_bytes})")
        if self.block_bytes % self.page_bytes:
            raise ValueError(f"the block ({self.block_bytes} bytes) must hold a whole number of pages of "
                             f"{self.page_bytes} bytes")
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be some of {MODES}, got {self.modes!r}")
        if self.max_open_files < 1:
            raise ValueError(f"max_open_files must be >= 1, got {self.max_open_files}")


@dataclass
class SpillRow:
    mode: str  # page | block
    system: str  # tier | plain | plain-cuda
    backend: str  # posix | kvikio
    compat_mode: str | None  # kvikio's compatibility mode (None for posix)
    dest: str  # the destination buffer: "host", "pinned host" or "cuda"
    reads: int  # reads per pass
    read_bytes: int  # bytes per pass (checked against what the list asks for)
    first_gbps: float  # first pass, GB/s (1e9 bytes)
    warm_gbps: float | None  # median of the later passes (None with one rep)
    ratio: float | None  # tier / plain (warm where there is one, else first), on the tier row
    ratio_first: float | None  # tier / plain on the first passes
    checked: bool  # every page read equals what was written (an untimed pass per system)
    note: str = ""


@dataclass(frozen=True)
class _Block:
    key: BlockKey
    path: str
    page_offset: int
    page_bytes: int
    sums: list[int]


def _write_blocks(spill: SpillTier, cfg: SpillConfig, mode: str, seed: int) -> list[_Block]:
    page = cfg.block_bytes if mode == "block" else cfg.page_bytes
    n_pages = cfg.block_bytes // page
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(cfg.blocks):
        key = BlockKey(FORMAT, f"bench-{mode}", "v", b // 65536, b % 65536, 0, n_pages, 4, 8)
        payload = torch.randint(0, 256, (cfg.block_bytes,), dtype=torch.uint8, generator=g).numpy().tobytes()
        frame = encode_frame(key, payload)
        spill.write(key, torch.frombuffer(bytearray(frame), dtype=torch.uint8), HEADER_BYTES, page)
        sums = [_page_checksum(payload[i * page:(i + 1) * page]) for i in range(n_pages)]
        out.append(_Block(key, str(spill.path(key)), HEADER_BYTES, page, sums))
    return out


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _plain_io(backend: str) -> tuple[Callable[[str], Any], Callable[[Any, Any, int, int], int]]:
    """(open a file as a context manager, read ``size`` bytes at ``offset`` into a buffer) of the plain loop."""
    if backend == KVIKIO:
        import kvikio

        def read_kvikio(f: Any, buf: Any, size: int, offset: int) -> int:
            return int(f.pread(buf, size, offset).get())

        return (lambda path: kvikio.CuFile(path, "r")), read_kvikio

    @contextlib.contextmanager
    def open_posix(path: str):
        fd = os.open(path, os.O_RDONLY)
        try:
            yield fd
        finally:
            os.close(fd)

    def read_posix(fd: int, buf: Any, size: int, offset: int) -> int:
        view = memoryview(buf).cast("B")[:size]
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    return open_posix, read_posix


def _run_mode(spill: SpillTier, blocks: list[_Block], cfg: SpillConfig, mode: str,
              progress: Callable[[str], None]) -> list[SpillRow]:
    page = blocks[0].page_bytes
    n_pages = len(blocks[0].sums)
    run = mode == "run"  # a block's pages in one call (the tier) and one read (the plain loop)
    chunk, per_block = (page * n_pages, 1) if run else (page, n_pages)  # bytes and reads per read call
    reads = len(blocks) * per_block
    want = reads * chunk
    cuda = cfg.device == "cuda" and torch.cuda.is_available()
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
    dest = "pinned host" if cuda else "host"
    host_np = host.numpy()  # what the tier's kvikio read passes (its host tensor's numpy view)
    open_file, plain_read = _plain_io(spill.backend)

    def tier_pass(check: bool) -> tuple[float, int, bool]:
        ok, got = True, 0
        t0 = time.perf_counter()
        for b in blocks:
            if run:
                spill.read_pages(b.key, 0, n_pages, out=host)  # raises BlockCorrupt on a mismatch
                got += chunk
                if check:
                    ok &= all(_page_checksum(host_np[i * page:(i + 1) * page]) == b.sums[i] for i in range(n_pages))
                continue
            for i in range(n_pages):
                spill.read_page(b.key, i, out=host)  # raises BlockCorrupt on a mismatch
                got += page
                if check:
                    ok &= _page_checksum(host_np) == b.sums[i]
        return time.perf_counter() - t0, got, ok

    def plain_pass(buf: Any, check: bool, to_host: Callable[[], Any] | None = None) -> tuple[float, int, bool]:
        ok, got = True, 0
        t0 = time.perf_counter()
        for b in blocks:
            with open_file(b.path) as f:
                for i in range(per_block):
                    got += plain_read(f, buf, chunk, b.page_offset + i * chunk)
                    if check:
                        data = memoryview(to_host() if to_host is not None else buf).cast("B")
                        ok &= all(_page_checksum(data[k * page:(k + 1) * page]) == b.sums[i * (chunk // page) + k]
                                  for k in range(chunk // page))
        return time.perf_counter() - t0, got, ok

    systems: dict[str, Callable[[bool], tuple[float, int, bool]]] = {
        "tier": tier_pass, "plain": lambda check: plain_pass(host_np, check)}
    if cuda and spill.backend == KVIKIO:
        dev_buf = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        systems["plain-cuda"] = lambda check: plain_pass(dev_buf, check, lambda: dev_buf.cpu().numpy())
    times: dict[str, list[float]] = {s: [] for s in systems}
    nbytes: dict[str, int] = {}
    for rep in range(cfg.reps):
        order = list(systems) if rep % 2 == 0 else list(reversed(systems))
        for s in order:
            dt, got, _ = systems[s](False)
            times[s].append(dt)
            if nbytes.setdefault(s, got) != got:
                raise RuntimeError(f"{s}: {got} bytes read on pass {rep}, {nbytes[s]} on the first")
        progress(f"{mode} pass {rep + 1}/{cfg.reps}: " + ", ".join(f"{s} {_gbps(nbytes[s], times[s][-1]):.2f} GB/s"
                                                                   for s in systems))
    checked = {s: systems[s](True)[2] for s in systems}  # untimed

    def gbps(s: str) -> tuple[float, float | None]:
        first = _gbps(nbytes[s], times[s][0])
        warm = _gbps(nbytes[s], statistics.median(times[s][1:])) if cfg.reps > 1 else None
        return first, warm

    rows = []
    tf, tw = gbps("tier")
    pf, pw = gbps("plain")
    for s in systems:
        first, warm = gbps(s)
        ratio = ratio_first = None
        note = ""
        if s == "tier":
            ratio_first = tf / pf
            ratio = tw / pw if tw is not None and pw is not None else ratio_first
            note = ("SpillTier.read_pages: a block's pages in one call, checks overlapping the reads" if run else
                    "SpillTier.read_page: cached handle, checksum checked per page")
        elif s == "plain":
            note = (f"one open per file, {'the run in one read' if run else 'all its ranges'}, no checksum; same "
                    "destination buffer as the tier")
        else:
            note = "plain loop into a CUDA tensor: no tier row to compare (the tier reads into host memory)"
        rows.append(SpillRow(mode=mode, system=s, backend=spill.backend, compat_mode=spill.compat_mode,
                             dest="cuda" if s == "plain-cuda" else dest, reads=reads, read_bytes=nbytes[s],
                             first_gbps=first, warm_gbps=warm, ratio=ratio, ratio_first=ratio_first,
                             checked=checked[s], note=note))
        if nbytes[s] != want:
            raise RuntimeError(f"{mode}/{s}: {nbytes[s]} bytes read a pass, the list asks for {want}")
    return rows


def run_spill(cfg: SpillConfig, directory: str | None = None,
              progress: Callable[[str], None] = lambda s: None) -> list[SpillRow]:
    """Write the blocks under ``directory`` (default: a temporary directory, removed afterwards) and time the
    tier's reads and the plain loop's, per mode."""
    tmp = None if directory is not None else tempfile.mkdtemp(prefix="planekv-spill-bench-")
    root = directory if directory is not None else tmp
    frame_bytes = HEADER_BYTES + -(-cfg.block_bytes // 4096) * 4096
    spill = SpillTier(root, capacity_bytes=cfg.blocks * len(cfg.modes) * frame_bytes, backend=cfg.backend,
                      fsync=False, max_open_files=cfg.max_open_files)
    try:
        rows: list[SpillRow] = []
        for n, mode in enumerate(cfg.modes):
            progress(f"writing {cfg.blocks} blocks of {cfg.block_bytes} bytes ({mode} reads) under {spill.dir}")
            blocks = _write_blocks(spill, cfg, mode, seed=n)
            rows += _run_mode(spill, blocks, cfg, mode, progress)
        return rows
    finally:
        spill.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


COLUMNS = ("mode", "system", "backend", "compat_mode", "dest", "reads", "read_bytes", "first_gbps", "warm_gbps",
           "ratio", "ratio_first", "checked", "note")


def format_table(rows: Sequence[SpillRow]) -> str:
    from .output import column_table

    def cell(v: Any, col: str) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if col.startswith("ratio") else f"{v:.2f}"
        return str(v)

    return column_table(rows, COLUMNS, cell)
