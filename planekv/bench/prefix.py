"""`planekv bench prefix`: time to first token of a prompt whose prefix is reused from a prefix index, against a
fresh prefill of the same prompt (issue 33, item 5; docs/TIERING.md, "Prefix reuse").

The prompt is ``prefix_tokens`` tokens of a shipped text followed by ``suffix_tokens`` more (the new part of a
request that shares the prefix). Three rows, timed in the same run, repetitions interleaved (each repetition runs
every mode once, so drifting load on a shared machine falls on all of them alike); wall time with
``torch.cuda.synchronize`` on CUDA, from the call to the first generated token (the greedy argmax of the last
position's logits, on the host); median of ``reps`` after one warm-up repetition not counted:

- ``fresh-dense``: the default serving path, ``make_cache(dense_prefill=True)`` and one forward of the whole prompt
  (it attends densely and writes every token's codes);
- ``fresh-compressed``: ``dense_prefill=False``, the read mode prefix reuse needs (every position reads compressed
  K/V: with the reference reader and an untiered cache the prompt is stored whole in each layer and read as causal
  rows, ``PlaneKVHFCache.row_reads``; with the Triton reader or a tiered cache written and read token by token;
  slow at large N either way, so skipped above ``max_compressed_tokens``, the reason in the row);
- ``reuse``: the prefix's pages already in a :class:`~planekv.tiering.PrefixIndex` (built before the timing, not
  timed), then :func:`planekv.models.hf.prefill_with_reuse` of the whole prompt (``publish=False``: the pages are
  there already; publishing the suffix's whole pages comes after the first token). ``load_ms``: loading the pages
  alone (:func:`~planekv.models.hf.reuse_prefix` into another empty cache), timed in the same repetitions.

The index is built by a compressed prefill of the prefix alone (``index_from="compressed"``), as a first request
would leave it; then the reused prompt's first token must equal the fresh compressed prefill's
(``same_as_compressed``). Where the compressed prefill is too slow (above ``max_compressed_tokens``;
``index_from="auto"``) the pages are a stand-in: a dense prefill's codes of the prefix published under the page
keys of the compressed cache (``index_from="dense-codes"``). Loading them costs what loading a compressed prefill's
pages costs (the same number of pages, bytes and layers), so the TTFT is the one reuse gives, but the codes (and so
the first token) are not a compressed prefill's: ``same_as_compressed`` is then left empty. ``same_as_dense`` (a
dense prefill reads the prompt exactly, the others compressed) is reported, and may differ.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..evaluation.texts import TEST_TEXTS, tokenize_text
from ..kvstore import Codec, ReadPolicy
from ..kvstore.reference import ReadKV
from ..models import hf
from ..tiering import PrefixIndex
from ..tiering.prefix import page_nbytes, publish_pages
from .output import column_table

MODES = ("fresh-dense", "fresh-compressed", "reuse")
INDEX_FROM = ("auto", "compressed", "dense-codes")
DEFAULT_TEXT = TEST_TEXTS[0]


@dataclass(frozen=True)
class PrefixConfig:
    """What one run measures: a prompt of ``prefix_tokens`` + ``suffix_tokens`` tokens of ``text``; ``reps`` timed
    repetitions after one warm-up; the compressed prefill skipped above ``max_compressed_tokens`` prompt tokens;
    ``tiered_hot`` (None: no tiering) makes every cache a tiered one with that many hot planes; ``reader`` reads
    the compressed K/V ("reference", "triton", or "auto": triton on CUDA, else reference); ``index_from`` builds
    the index by a compressed prefill of the prefix, by a dense prefill's codes (a stand-in, see the module), or
    ("auto") the first where the compressed prefill runs."""

    prefix_tokens: int
    suffix_tokens: int = 16
    reps: int = 3
    max_compressed_tokens: int = 2048
    tiered_hot: int | None = None
    reader: str = "auto"
    index_from: str = "auto"
    text: str = DEFAULT_TEXT

    def __post_init__(self) -> None:
        if self.prefix_tokens < 1 or self.suffix_tokens < 1:
            raise ValueError(f"prefix and suffix need >= 1 token each, got {self.prefix_tokens}, "
                             f"{self.suffix_tokens}")
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")
        if self.index_from not in INDEX_FROM:
            raise ValueError(f"index_from must be one of {INDEX_FROM}, got {self.index_from!r}")
        if self.tiered_hot is not None and not 0 <= self.tiered_hot <= 8:
            raise ValueError(f"tiered_hot must be in 0..8, got {self.tiered_hot}")

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens

    @property
    def compressed_runs(self) -> bool:
        return self.prompt_tokens <= self.max_compressed_tokens


@dataclass
class PrefixRow:
    mode: str  # fresh-dense, fresh-compressed, reuse
    prefix_tokens: int
    suffix_tokens: int
    ttft_ms: float | None = None  # median over the timed repetitions
    reused: int | None = None  # tokens loaded from the index
    run: int | None = None  # token positions the model ran
    load_ms: float | None = None  # reuse: loading the pages alone (median)
    x_dense: float | None = None  # ttft / fresh-dense's
    x_compressed: float | None = None  # ttft / fresh-compressed's
    first_token: int | None = None
    same_as_compressed: bool | None = None  # first token equal to fresh-compressed's (reuse: it must be)
    same_as_dense: bool | None = None  # first token equal to fresh-dense's (may differ: another read mode)
    logit_diff: float | None = None  # reuse: max |last-position logits - fresh-compressed's|
    index_from: str | None = None  # reuse: how the index was built (compressed, dense-codes)
    skipped: str | None = None
    times_ms: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


COLUMNS = ("mode", "prefix_tokens", "suffix_tokens", "ttft_ms", "reused", "run", "load_ms", "x_dense",
           "x_compressed", "first_token", "same_as_compressed", "same_as_dense", "logit_diff", "index_from",
           "skipped")


def prompt_ids(tokenizer: Any, n_tokens: int, text: str = DEFAULT_TEXT) -> torch.Tensor:
    """The first ``n_tokens`` token ids of ``text`` (a shipped text's name or a file), [1, n_tokens]."""
    ids = tokenize_text(tokenizer, text, n_tokens)
    if ids.numel() < n_tokens:
        raise ValueError(f"text {text!r} has {ids.numel()} tokens, the prompt needs {n_tokens}")
    return ids[None].clone()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(dev: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync(dev)
    t0 = time.perf_counter()
    out = fn()
    _sync(dev)
    return out, 1e3 * (time.perf_counter() - t0)


class _Run:
    """The model, the system and the caches of one benchmark run."""

    def __init__(self, model: Any, codec: Codec, policy: ReadPolicy, cfg: PrefixConfig) -> None:
        self.model, self.cfg = model, cfg
        self.dev = next(model.parameters()).device
        self.system = ReadKV(codec, policy)
        self.reader = cfg.reader
        if self.reader == "auto":
            self.reader = "triton" if self.dev.type == "cuda" else "reference"
        spec = codec.spec
        self.tiering = None
        if cfg.tiered_hot is not None:
            max_tokens = -(-(cfg.prompt_tokens + 1) // spec.page_size) * spec.page_size
            self.tiering = hf.Tiering(hot=cfg.tiered_hot, max_tokens=max_tokens)
        self.index_bytes = (cfg.prompt_tokens // spec.page_size + 1) * page_nbytes(spec)

    def cache(self, dense: bool) -> hf.PlaneKVHFCache:
        return hf.make_cache(self.model, self.system, reader=self.reader, tiering=self.tiering,
                             dense_prefill=dense)

    def fresh(self, ids: torch.Tensor, dense: bool) -> tuple[torch.Tensor, float, int]:
        """(last-position logits [vocab] on the host, ms to the first token, the first token)."""
        cache = self.cache(dense)
        ids = ids.to(self.dev)

        def go() -> tuple[torch.Tensor, int]:
            with torch.no_grad():
                out = self.model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            last = out.logits[0, -1]
            return last, int(last.argmax())

        (last, tok), ms = _timed(self.dev, go)
        return last.float().cpu(), ms, tok

    def reuse(self, ids: torch.Tensor, index: PrefixIndex) -> tuple[torch.Tensor, float, int, int]:
        """(last-position logits, ms to the first token, the first token, tokens reused)."""
        cache = self.cache(dense=False)
        ids = ids.to(self.dev)

        def go() -> tuple[torch.Tensor, int, int]:
            logits, n = hf.prefill_with_reuse(self.model, cache, ids, index, publish=False)
            last = logits[0, -1]
            return last, int(last.argmax()), n

        (last, tok, n), ms = _timed(self.dev, go)
        return last.float().cpu(), ms, tok, n

    def load_only(self, ids: torch.Tensor, index: PrefixIndex) -> float:
        cache = self.cache(dense=False)
        _, ms = _timed(self.dev, lambda: hf.reuse_prefix(cache, index, ids))
        return ms

    def build_index(self, prefix: torch.Tensor, how: str) -> tuple[PrefixIndex, int]:
        """An index holding the whole pages of ``prefix`` [1, n] under the compressed cache's page keys; (index,
        pages added)."""
        index = PrefixIndex(capacity_bytes=max(1 << 30, self.index_bytes))
        cache = self.cache(dense=how == "dense-codes")
        with torch.no_grad():
            self.model(prefix.to(self.dev), past_key_values=cache, use_cache=True, logits_to_keep=1)
        if how == "compressed":
            added = hf.publish_prefix(cache, index, prefix)
        else:  # a stand-in: a dense prefill's codes under the keys a compressed prefill's pages have
            keys = hf.prefix_keys(self.cache(dense=False), prefix[0].cpu())
            assert cache.pages is not None
            added = publish_pages(index, cache.pages, 0, keys)
        return index, added


def run_prefix(model: Any, tokenizer: Any, codec: Codec, policy: ReadPolicy, cfg: PrefixConfig,
               progress: Callable[[str], None] | None = None) -> list[PrefixRow]:
    """The three rows (:data:`MODES`) for ``model`` under ``codec`` and ``policy``; see the module."""
    say = progress or (lambda s: None)
    run = _Run(model, codec, policy, cfg)
    ids = prompt_ids(tokenizer, cfg.prompt_tokens, cfg.text)
    prefix = ids[:, :cfg.prefix_tokens]
    how = cfg.index_from
    if how == "auto":
        how = "compressed" if cfg.compressed_runs else "dense-codes"
    say(f"index: {how} prefill of the {cfg.prefix_tokens}-token prefix (not timed)")
    t0 = time.perf_counter()
    index, added = run.build_index(prefix, how)
    say(f"index: {added} pages in {time.perf_counter() - t0:.1f} s")

    times: dict[str, list[float]] = {m: [] for m in MODES}
    load: list[float] = []
    last: dict[str, tuple[torch.Tensor, int]] = {}
    reused = 0
    for rep in range(cfg.reps + 1):  # rep 0: the warm-up, not counted
        tag = "warm-up" if rep == 0 else f"rep {rep}/{cfg.reps}"
        logits, ms, tok = run.fresh(ids, dense=True)
        last["fresh-dense"] = (logits, tok)
        say(f"{tag}: fresh-dense {ms:.1f} ms")
        ms_d = ms
        if cfg.compressed_runs:
            logits, ms_c, tok = run.fresh(ids, dense=False)
            last["fresh-compressed"] = (logits, tok)
            say(f"{tag}: fresh-compressed {ms_c:.1f} ms")
        logits, ms_r, tok, reused = run.reuse(ids, index)
        last["reuse"] = (logits, tok)
        ms_l = run.load_only(ids, index)
        say(f"{tag}: reuse {ms_r:.1f} ms ({reused} tokens loaded; load alone {ms_l:.1f} ms)")
        if rep:
            times["fresh-dense"].append(ms_d)
            if cfg.compressed_runs:
                times["fresh-compressed"].append(ms_c)
            times["reuse"].append(ms_r)
            load.append(ms_l)
    return _rows(cfg, times, load, last, reused, how)


def _rows(cfg: PrefixConfig, times: dict[str, list[float]], load: list[float],
          last: dict[str, tuple[torch.Tensor, int]], reused: int, how: str) -> list[PrefixRow]:
    med = {m: statistics.median(t) for m, t in times.items() if t}
    base = dict(prefix_tokens=cfg.prefix_tokens, suffix_tokens=cfg.suffix_tokens)
    dense_tok = last["fresh-dense"][1]
    comp = last.get("fresh-compressed")
    rows = [PrefixRow("fresh-dense", **base, ttft_ms=med["fresh-dense"], reused=0, run=cfg.prompt_tokens,
                      first_token=dense_tok, times_ms=times["fresh-dense"])]
    if comp is None:
        rows.append(PrefixRow("fresh-compressed", **base,
                              skipped=f"{cfg.prompt_tokens} prompt tokens > --max-compressed-tokens "
                                      f"{cfg.max_compressed_tokens} (every position reads compressed K/V: too slow)"))
    else:
        rows.append(PrefixRow("fresh-compressed", **base, ttft_ms=med["fresh-compressed"], reused=0,
                              run=cfg.prompt_tokens, first_token=comp[1], same_as_dense=comp[1] == dense_tok,
                              times_ms=times["fresh-compressed"]))
    logits, tok = last["reuse"]
    comparable = comp is not None and how == "compressed"
    rows.append(PrefixRow("reuse", **base, ttft_ms=med["reuse"], reused=reused, run=cfg.prompt_tokens - reused,
                          load_ms=statistics.median(load), first_token=tok,
                          same_as_compressed=tok == comp[1] if comparable else None,
                          same_as_dense=tok == dense_tok,
                          logit_diff=float((logits - comp[0]).abs().max()) if comparable else None,
                          index_from=how, times_ms=times["reuse"]))
    for row in rows:
        if row.ttft_ms is None:
            continue
        row.x_dense = row.ttft_ms / med["fresh-dense"]
        if "fresh-compressed" in med:
            row.x_compressed = row.ttft_ms / med["fresh-compressed"]
    return rows


def format_table(rows: list[PrefixRow]) -> str:
    def cell(v: Any, col: str) -> str:
        if col == "logit_diff":
            return f"{v:.2g}"
        if col in ("x_dense", "x_compressed"):
            return f"{v:.3f}"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    return column_table(rows, COLUMNS, cell)
