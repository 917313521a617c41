"""PlaneWorker: one model with PlaneKV caches, serving generation and teacher-forced scoring (a Ray actor's body).

The class has no Ray in it: ``planekv.orchestration.worker_host`` wraps it as a Ray actor (``num_gpus=1`` on a GPU
node), tests and single-process users call it directly. The model (any local HF causal LM; SmolLM2 by default) and
its calibration load in a background thread, so the worker answers :meth:`ping` at once; requests wait for the
load (bounded).

Every generation keeps its sequences' codes in a PlaneKV cache; with a placement policy (given, or the control
plane's active version of the policy named ``policy``, looked up between requests) the cache is tiered: the
policy's hot planes stay on the worker's device, sealed pages' refinement planes go to host memory, prefetch brings
back what decode steps ask for (docs/TIERING.md). :meth:`stats` and :meth:`metrics` (Prometheus text) report
requests, tokens, bits read, caps and bytes per tier.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..tiering import failpoints

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0
POLICY_TTL_S = 1.0  # how long a looked-up active policy version is used before asking again
LIVE_POLICY_TIMEOUT_S = 1.0  # a decode step's question to the control plane waits at most this long


@dataclass
class WorkerStats:
    requests: dict[str, int] = field(default_factory=dict)
    sequences: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    bits_read: float = 0.0
    dense_bits: float = 0.0
    capped_bits: float = 0.0
    wanted_bits: float = 0.0
    seconds: float = 0.0
    tier_bytes: dict[str, int] = field(default_factory=dict)  # of the last request's cache
    policy_version: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = {k: dict(v) if isinstance(v, dict) else v for k, v in vars(self).items()}  # a snapshot
        d["steps_per_second"] = self.decode_steps / self.seconds if self.seconds else 0.0
        d["cap_rate"] = self.capped_bits / self.wanted_bits if self.wanted_bits else 0.0
        d["bits_per_scalar"] = 16.0 * self.bits_read / self.dense_bits if self.dense_bits else 0.0
        return d


class PlaneWorker:
    """A model and its PlaneKV caches. ``model``: a .gguf path, an HF directory, or None for SmolLM2;
    ``calibration``: a calibration artifact (.pt), or None to calibrate on ``calib_tokens`` tokens at load;
    ``placement``: a PlacementPolicy document (dict) for tiered caches, or ``policy`` (a control-plane policy
    name) to follow its active version at ``control_url``; neither: all planes on the device."""

    def __init__(self, model: str | None = None, calibration: str | None = None, calib_tokens: int = 1024,
                 device: str = "auto", reader: str = "reference", placement: dict | None = None,
                 policy: str | None = None, control_url: str | None = None, api_token: str | None = None,
                 promotion_mib: float = 64.0, max_batch: int = 8, name: str = "worker") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.name = name
        self.max_batch = max_batch
        self.reader = reader
        self.promotion_mib = promotion_mib
        self.policy_name = policy
        self.control_url = control_url
        self.api_token = api_token
        self._placement_doc = placement
        self._policy_checked = 0.0
        self._placement: Any = None
        self.stats_ = WorkerStats()
        self._lock = threading.Lock()  # one request at a time (a Ray actor runs one anyway)
        self._ready = threading.Event()
        self._error: str | None = None
        self.setup: Any = None
        self._load_args = (model, calibration, calib_tokens, device)
        threading.Thread(target=self._load, name=f"{name}-load", daemon=True).start()

    # ---- state ----

    def _load(self) -> None:
        model, calibration, calib_tokens, device = self._load_args
        try:
            from ..evaluation.common import setup
            from ..models.hf import use_planekv_attention

            t0 = time.perf_counter()
            s = setup(model, calibration, device, calib_tokens=calib_tokens, calib_window=min(2048, calib_tokens))
            use_planekv_attention(s.lm.model)
            self.setup = s
            log.info("%s: %s ready on %s in %.1f s", self.name, s.lm.model_id, s.device, time.perf_counter() - t0)
        except Exception as exc:  # reported by ping() and every request
            log.exception("%s: loading failed", self.name)
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._ready.set()

    def ping(self) -> dict[str, Any]:
        """State without waiting: loading, ready or failed (with the error)."""
        state = "failed" if self._error else "ready" if self._ready.is_set() else "loading"
        out: dict[str, Any] = {"name": self.name, "state": state}
        if self._error:
            out["error"] = self._error
        if self.setup is not None:
            out.update(model=self.setup.lm.model_id, device=str(self.setup.device),
                       format_id=self.setup.codec.format_id)
        return out

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_S) -> dict[str, Any]:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name}: the model did not load in {timeout:.0f} s")
        if self._error:
            raise RuntimeError(f"{self.name}: the model failed to load: {self._error}")
        return self.ping()

    # ---- placement ----

    def placement(self) -> Any:
        """The placement policy for the next request: the given document if any, else the control plane's active
        version of ``policy`` (asked again after POLICY_TTL_S); None without either (all planes on the device)."""
        from ..tiering import PlacementPolicy

        if self._placement_doc is not None:  # a given document wins over the control plane
            if self._placement is None:
                self._placement = PlacementPolicy.model_validate(self._placement_doc)
            return self._placement
        if self.policy_name and self.control_url and time.monotonic() - self._policy_checked > POLICY_TTL_S:
            from ..services.clients import ControlClient, ServiceError

            try:
                with ControlClient(self.control_url, self.api_token, timeout_s=5, retries=1) as control:
                    active = control.active_policy(self.policy_name)
            except ServiceError as exc:
                if exc.status:  # the control plane answered an error
                    raise RuntimeError(f"{self.name}: the control plane answered {exc.status} for policy "
                                       f"{self.policy_name!r}: {exc.detail[:200]}") from exc
                log.warning("%s: control plane unreachable (%s); keeping policy version %d", self.name, exc,
                            self.stats_.policy_version)  # it is away: keep the policy last seen
                self._policy_checked = time.monotonic()
                return self._placement
            if active is not None:
                self._placement, self.stats_.policy_version = active.policy, active.version
            else:  # no such policy (any more): every plane on the device
                self._placement, self.stats_.policy_version = None, 0
            self._policy_checked = time.monotonic()
        return self._placement

    def _live_policy_source(self) -> Any:
        """While following a control-plane policy, a source that a generation's cache asks before every decode step
        (``planekv.models.hf.Tiering.policy_source``), so a version activated mid-generation is read by the next
        step; None with a given placement document or no policy."""
        if self._placement_doc is not None or not (self.policy_name and self.control_url):
            return None
        from .policy_source import ControlPolicySource

        return ControlPolicySource(self.control_url, self.policy_name, self.api_token, timeout_s=LIVE_POLICY_TIMEOUT_S)

    def set_placement(self, placement: dict | None) -> None:
        """Use this PlacementPolicy document from the next request on (None: follow ``policy`` or none). A
        document that is not a valid policy raises (pydantic's ValidationError, a ValueError) and changes nothing."""
        from ..tiering import PlacementPolicy

        policy = None if placement is None else PlacementPolicy.model_validate(placement)
        self._placement_doc, self._placement, self._policy_checked = placement, policy, 0.0

    # ---- requests ----

    def generate(self, prompts: list[str], max_new_tokens: int = 32, rate: float = 4.0,
                 system: str = "readkv-flexible", chat: bool = True) -> list[dict[str, Any]]:
        """Greedy generation for the prompts through PlaneKV caches (tiered under a placement policy), up to
        ``max_batch`` prompts decoding together in one cache (left-padded; pads are never stored or read). Per
        prompt its text and token counts; bits read per scalar, caps and bytes per tier are those of its batch."""
        if not prompts or max_new_tokens < 1:
            raise ValueError("give at least one prompt and max_new_tokens >= 1")
        self.wait_ready()
        with self._lock:
            out: list[dict[str, Any]] = []
            for a in range(0, len(prompts), self.max_batch):
                out += self._generate_batch(prompts[a: a + self.max_batch], max_new_tokens, rate, system, chat)
            return out

    def _prompt_ids(self, prompt: str, chat: bool) -> torch.Tensor:
        """The prompt's token ids [N] (in the model's chat template when it has one and ``chat``)."""
        tok = self.setup.lm.tokenizer
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt")
            ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        else:
            ids = tok(prompt, return_tensors="pt").input_ids
        return ids[0]

    def _generate_batch(self, prompts: list[str], max_new: int, rate: float, system: str,
                        chat: bool) -> list[dict[str, Any]]:
        from ..evaluation.common import SystemRow, build_system, default_k_share
        from ..models.hf import Tiering, make_cache

        s = self.setup
        tok, model = s.lm.tokenizer, s.lm.model
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        each = [self._prompt_ids(p, chat) for p in prompts]
        n = max(int(x.numel()) for x in each)
        ids = torch.full((len(each), n), pad, dtype=torch.long)  # [B, N], left-padded
        mask = torch.zeros_like(ids)  # [B, N]: 1 for prompt tokens
        for b, x in enumerate(each):
            ids[b, n - x.numel():], mask[b, n - x.numel():] = x, 1
        row = SystemRow(system, rate, default_k_share(rate) if system == "readkv-flexible" else None)
        kv = build_system(row, s.codec)
        placement = self.placement() if system.startswith("readkv") else None
        live = self._live_policy_source() if placement is not None else None
        tiering = None if placement is None else Tiering(
            hot=placement.hot_planes.k, max_tokens=n + max_new + 1,
            promotion_bytes=int(self.promotion_mib * (1 << 20)), placement=placement, policy_source=live,
            policy_version=self.stats_.policy_version)
        cache = make_cache(model, kv, reader=self.reader, tiering=tiering)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids.to(s.device), attention_mask=mask.to(s.device), past_key_values=cache,
                                 max_new_tokens=max_new, do_sample=False, pad_token_id=pad,
                                 stopping_criteria=[_EachStep(self._decode_step)])
        dt = time.perf_counter() - t0
        if live is not None:
            live.close()
            if cache.policy_version != self.stats_.policy_version:  # a version applied between decode steps
                self._placement, self.stats_.policy_version = cache.pages.placement, cache.policy_version
                self._policy_checked = time.monotonic()
        new = out[:, n:].cpu()  # [B, steps + 1]; a finished sequence is filled with pad tokens
        lengths = [_until_eos(new[b], tok.eos_token_id) for b in range(len(each))]
        st = self.stats_
        st.requests["generate"] = st.requests.get("generate", 0) + 1
        st.sequences += len(each)
        st.tokens_generated += sum(lengths)
        steps = max(0, int(new.shape[1]) - 1)  # the first token comes from the dense prefill
        self._count_decode(cache, steps, dt, tiered=tiering is not None)
        if tiering is None:
            st.tier_bytes = {}
        return [{"text": tok.decode(new[b, :m], skip_special_tokens=True), "prompt_tokens": int(x.numel()),
                 "new_tokens": m, "batch_size": len(each), "bits_per_scalar": cache.tally.bits_per_scalar,
                 "cap_rate": cache.tier_tally.cap_rate if tiering is not None else None,
                 "tier_bytes": dict(st.tier_bytes), "seconds": dt,
                 "hot_planes": None if placement is None else cache.pages.placement.hot_planes.k,
                 "policy_version": cache.policy_version if tiering is not None else 0}
                for b, (x, m) in enumerate(zip(each, lengths, strict=True))]

    def score(self, text: str | list[int], window: int = 512, rate: float = 4.0, system: str = "readkv-flexible",
              max_tokens: int | None = None) -> dict[str, Any]:
        """Teacher-forced negative log-likelihood of ``text`` (a string, or its token ids) in windows of
        ``window`` tokens, every position reading the compressed cache of the tokens before it (DESIGN
        section 7)."""
        from ..evaluation.common import SystemRow, build_system, default_k_share
        from ..evaluation.perplexity import window_nll
        from ..models.hf import teacher_forced

        if window < 2:
            raise ValueError("window must be >= 2 tokens")
        self.wait_ready()
        with self._lock:
            s = self.setup
            ids = torch.tensor(text if isinstance(text, list) else
                               s.lm.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
            ids = ids if max_tokens is None else ids[:max_tokens]
            if ids.numel() < 2:
                raise ValueError("score needs a text of at least 2 tokens")
            row = SystemRow(system, rate, default_k_share(rate) if system == "readkv-flexible" else None)
            kv = build_system(row, s.codec)
            nll = n = 0.0
            t0 = time.perf_counter()
            with teacher_forced(kv) as tally:
                for a in range(0, max(1, ids.numel() - 1), window):
                    chunk = ids[a: a + window + 1].to(s.device)
                    if chunk.numel() < 2:
                        break
                    w_nll, w_n = window_nll(s.lm.model, chunk)
                    nll += w_nll
                    n += w_n
            st = self.stats_
            st.requests["score"] = st.requests.get("score", 0) + 1
            st.bits_read += tally.k_bits + tally.v_bits
            st.dense_bits += tally.dense_bits
            return {"nll": nll, "tokens": int(n), "ppl": float(torch.exp(torch.tensor(nll / max(n, 1)))),
                    "bits_per_scalar": tally.bits_per_scalar, "seconds": time.perf_counter() - t0}

    def passkey(self, context: int = 2048, rates: tuple[float, ...] = (4.0, 2.0), seed: int = 0,
                system: str = "readkv-flexible", with_dense: bool = True) -> dict[str, Any]:
        """One passkey trial (planekv.evaluation.passkey: a five-digit key hidden in ``context`` tokens of filler):
        one dense prefill, then a greedy answer read from a PlaneKV cache at each rate under the placement policy
        in force (tiered when there is one); per rate the answer, whether it is the key, bits read per scalar,
        caps and bytes per tier; and dense attention's answer (``with_dense``)."""
        from ..evaluation import passkey as pk
        from ..evaluation.common import SystemRow, build_system, default_k_share
        from ..evaluation.texts import FILLER_TEXT, tokenize_text
        from ..models.hf import Tiering, make_cache

        if context < 256 or not rates:
            raise ValueError("passkey needs a context of at least 256 tokens and at least one rate")
        self.wait_ready()
        with self._lock:
            s = self.setup
            tok, model = s.lm.tokenizer, s.lm.model
            filler = tokenize_text(tok, FILLER_TEXT)
            trial = pk.make_trials(context, 1, seed, filler.numel())[0]
            ids = pk.build_prompt(tok, filler, trial)
            t0 = time.perf_counter()
            first, keys, values = pk.dense_prefill(model, ids)
            prefill_s = time.perf_counter() - t0
            placement = self.placement()
            rows = [SystemRow("dense", 16.0)] * with_dense + [SystemRow(system, r, default_k_share(r)
                                                           if system == "readkv-flexible" else None) for r in rates]
            out = []
            for row in rows:
                kv = build_system(row, s.codec)
                tiering = None if placement is None or row.name == "dense" else Tiering(
                    hot=placement.hot_planes.k, max_tokens=context + pk.MAX_NEW_TOKENS + 1,
                    promotion_bytes=int(self.promotion_mib * (1 << 20)), placement=placement)
                cache = make_cache(model, kv, reader=self.reader, tiering=tiering)
                cache.prefill_from(keys, values)
                t1 = time.perf_counter()
                text = pk.greedy_decode(model, cache, first, tok)
                dt = time.perf_counter() - t1
                answer = pk.parse_answer(text)
                tb = cache.pages.bytes() if tiering is not None else None
                steps = len(tok(text, add_special_tokens=False)["input_ids"]) - 1  # the first came from the prefill
                self._count_decode(cache, steps=max(0, steps), seconds=dt, tiered=tiering is not None)
                out.append({"system": row.name, "rate": row.rate, "answer": answer, "hit": answer == trial.key,
                            "bits_per_scalar": 16.0 if row.name == "dense" else cache.tally.bits_per_scalar,
                            "cap_rate": cache.tier_tally.cap_rate if tiering is not None else None,
                            "tier_bytes": None if tb is None else _tier_bytes(tb),
                            "decode_seconds": dt})
            self.stats_.requests["passkey"] = self.stats_.requests.get("passkey", 0) + 1
            return {"context": context, "key": trial.key, "depth": trial.depth, "prefill_seconds": prefill_s,
                    "policy_version": self.stats_.policy_version,
                    "hot_planes": None if placement is None else placement.hot_planes.model_dump(),
                    "rows": out}

    def _decode_step(self, tokens: int) -> None:
        """Called by :meth:`generate` after each token of a batch (``tokens``: generated so far, the prefill's
        first one included): the failpoint ``worker.decode_step`` (planekv.tiering.failpoints; armed in the
        worker's process by ``PLANEKV_FAILPOINTS``, e.g. ``worker.decode_step=kill@3`` SIGKILLs it at the third
        token). A test hook: unarmed it does nothing."""
        failpoints.hit("worker.decode_step")

    def _count_decode(self, cache: Any, steps: int, seconds: float, tiered: bool) -> None:
        st = self.stats_
        st.decode_steps += steps
        st.bits_read += cache.tally.k_bits + cache.tally.v_bits
        st.dense_bits += cache.tally.dense_bits
        if tiered:
            st.capped_bits += cache.tier_tally.capped_bits
            st.wanted_bits += cache.tier_tally.wanted_bits
            tb = cache.pages.bytes()
            st.tier_bytes = _tier_bytes(tb)
        st.seconds += seconds

    # ---- reporting ----

    def stats(self) -> dict[str, Any]:
        return {**self.ping(), **self.stats_.as_dict()}

    def metrics(self) -> str:
        """The worker's counters in Prometheus' text format."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

        reg = CollectorRegistry()
        st = self.stats_.as_dict()
        labels = {"worker": self.name}
        state = Gauge("planekv_worker_ready", "1 when the model is loaded, 0 while loading, -1 if it failed",
                      ["worker"], registry=reg)
        p = self.ping()["state"]
        state.labels(**labels).set({"ready": 1, "loading": 0, "failed": -1}[p])
        req = Counter("planekv_worker_requests", "requests served", ["worker", "kind"], registry=reg)
        for kind, n in st["requests"].items():
            req.labels(kind=kind, **labels).inc(n)
        for name, key, doc in (("tokens_generated", "tokens_generated", "tokens generated"),
                               ("decode_steps", "decode_steps", "decode steps (every layer read once)"),
                               ("bits_read", "bits_read", "logical bits read by decode steps"),
                               ("capped_bits", "capped_bits", "bits asked for past the resident planes")):
            Counter(f"planekv_worker_{name}", doc, ["worker"], registry=reg).labels(**labels).inc(st[key])
        Gauge("planekv_worker_steps_per_second", "decode steps per second over all requests", ["worker"],
              registry=reg).labels(**labels).set(st["steps_per_second"])
        tier = Gauge("planekv_worker_tier_bytes", "bytes per tier of the last request's cache", ["worker", "tier"],
                     registry=reg)
        for t, b in st["tier_bytes"].items():
            tier.labels(tier=t, **labels).set(b)
        Gauge("planekv_worker_policy_version", "active placement policy version in use", ["worker"],
              registry=reg).labels(**labels).set(st["policy_version"])
        return generate_latest(reg).decode()


class _EachStep:
    """A stopping criterion of ``model.generate`` that never stops it: it calls ``fn(tokens so far)`` after each
    token."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.tokens = fn, 0

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
        self.tokens += 1
        self.fn(self.tokens)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _until_eos(new: torch.Tensor, eos: int | None) -> int:
    """How many of the new tokens [S] a sequence generated: up to and including its first EOS (the rest pads)."""
    hits = (new == eos).nonzero() if eos is not None else new[:0]
    return int(hits[0, 0]) + 1 if hits.numel() else int(new.numel())


def _tier_bytes(tb: Any) -> dict[str, int]:
    """A cache's TierBytes as a JSON dict."""
    return {"hot": tb.hot, "open": tb.open, "promotion": tb.promotion, "host": tb.host, "nvme": tb.nvme,
            "remote": tb.remote}
