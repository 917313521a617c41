"""ReadPolicy: how one decode step spends its read budget (DESIGN sections 1.7-1.8 and 5).

Budgets are per KV head and per step, in plane increments:
``B_K`` channel-plane increments (each costs T bits) and ``B_V`` token-plane increments (each costs
d bits), so ``R = (T B_K + d B_V) / (2 T d)`` bits are read per stored scalar on average. A rate R
with a K share ``phi`` gives ``B_K = round(2 d R phi)`` (independent of T) and
``B_V = floor((2 T d R - T B_K) / d)``. A pooled reader spends ``n_kv_heads`` times these budgets
across the KV heads of a layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from .errors import BudgetError

Reader = Literal["flexible", "constrained"]

# PlaneKV's flexible reader: ReadKV's flexible reader plus the third read stage, Key refinement, at
# this share of B_K (chosen on the dev text at R = 2; EVALUATION.md "Fourth round", docs/DECISIONS.md)
PLANEKV_KEY_REFINE = 0.3


@dataclass(frozen=True)
class ReadPolicy:
    """Recorded with every result. Give either ``rate`` (R) or both ``budget_k`` and ``budget_v``."""

    width: int = 8
    rate: float | None = 4.0
    budget_k: int | None = None
    budget_v: int | None = None
    k_share: float = 0.5  # fraction of the bits spent on Keys (flexible: chosen on the dev text)
    reader: Reader = "flexible"
    min_depth_k: int = 0
    min_depth_v: int = 0
    v_packet: int = 1  # Value depths grow in steps of this many planes after the minimum
    pool_heads: bool = True  # budget pooled across the KV heads of a layer
    tier_aware: bool = False
    deadline_ms: float | None = None
    # Named deviation from DESIGN 1.6 (default off): weight token importance by the KV head's total
    # Value variance sum_c sigma_{V,c}^2, the factor the expected output error carries, so a pooled
    # budget favours heads whose Values vary more. No effect on per-head budgets.
    value_head_weight: bool = False
    # Named deviation from DESIGN 1.5 (default off; reference reader only): a Key read at depth t is
    # the conditional mean of its node, so the logit error given the codes has variance
    # V_i = scale^2 sum_c (q~_c sigma_{K,c})^2 Var(Z | node(t_c, code_{i,c})), larger for tokens in
    # the wide tail nodes. Adding V_i / 2 to logit i makes exp(logit) the conditional expectation
    # E[exp(true logit) | codes] (second-order, Gaussian approximation of the error). Depth-0
    # channels add the same V to every token and are skipped (the softmax ignores it).
    key_variance_correction: bool = False
    # Named deviation from DESIGN 1.5 (default 0; reference reader only): the Keys of the first
    # ``sink_keys`` tokens a row reads (the attention sinks) are read at full depth W in every
    # channel instead of the allocated channel depths. The extra Key bits are counted, and taken
    # from the Value budget (rounded up to whole Value planes), so R stays the budget.
    sink_keys: int = 0
    # Named deviation from the budget rule (default off): a row that reads a single token gets
    # softmax weight 1 for it whatever its Key, so the Key read carries no information; with this
    # option such a row reads no Key planes beyond the minimum depth and spends the rest of its
    # 2 d R bits on the Value (rate policies only; budgets(1, d) changes, no other T does).
    single_token_values: bool = False
    # Named extension beyond the paper's two stages (default 0; the reference reader, and the Triton
    # reader's FMA stages at token granularity, key_refine_block = 1): a third read
    # stage, Key refinement. The channel stage spends (1 - key_refine) of B_K; the rest (in bits,
    # key_refine * B_K * T per KV head) reads the remaining planes (depth W in every channel) of the
    # tokens with the largest stage-1 importance sum_h p_{h,i}^2 per bit, in blocks of
    # ``key_refine_block`` positions (1: single tokens; a page size: whole pages, so the physical read
    # is the logical one). Their logits are recomputed, then the softmax. Refinement bits are counted
    # as Key bits, so R stays the budget.
    key_refine: float = 0.0
    key_refine_block: int = 1

    def __post_init__(self) -> None:
        given = (self.budget_k is not None, self.budget_v is not None)
        if self.rate is None and given != (True, True):
            raise BudgetError("give a rate R, or both budget_k and budget_v")
        if self.rate is not None and any(given):
            raise BudgetError("give a rate R or (budget_k, budget_v), not both")
        if self.rate is not None and not 0 <= self.rate <= self.width:
            raise BudgetError(f"rate R must be in [0, W={self.width}] bits per scalar, got {self.rate}")
        for name in ("budget_k", "budget_v"):
            val = getattr(self, name)
            if val is not None and val < 0:
                raise BudgetError(f"{name} must be >= 0, got {val}")
        if not 0.0 <= self.k_share <= 1.0:
            raise BudgetError(f"k_share must be in [0, 1], got {self.k_share}")
        if self.reader not in ("flexible", "constrained"):
            raise ValueError(f"reader must be 'flexible' or 'constrained', got {self.reader!r}")
        for name in ("min_depth_k", "min_depth_v"):
            if not 0 <= getattr(self, name) <= self.width:
                raise BudgetError(f"{name} must be in 0..W={self.width}")
        if self.sink_keys < 0:
            raise BudgetError(f"sink_keys must be >= 0, got {self.sink_keys}")
        if not 0.0 <= self.key_refine < 1.0:
            raise BudgetError(f"key_refine must be in [0, 1), got {self.key_refine}")
        if self.key_refine and (self.key_variance_correction or self.sink_keys):
            raise ValueError("key_refine does not combine with key_variance_correction or sink_keys")
        if self.key_refine_block < 1:
            raise BudgetError(f"key_refine_block must be >= 1, got {self.key_refine_block}")
        if self.v_packet < 1:
            raise BudgetError(f"v_packet must be >= 1, got {self.v_packet}")

    @classmethod
    def flexible(cls, rate: float = 4.0, k_share: float = 0.5, width: int = 8, **kw: Any) -> ReadPolicy:
        """The flexible reader: pooled across KV heads, depth 0 allowed, tuned K/V split."""
        return cls(width=width, rate=rate, k_share=k_share, reader="flexible", pool_heads=True,
                   min_depth_k=0, min_depth_v=0, v_packet=1, **kw)

    @classmethod
    def constrained(cls, rate: float = 4.0, width: int = 8, **kw: Any) -> ReadPolicy:
        """The paper's speed configuration: equal split, per head, minimum depth 1, V packets of 2."""
        return cls(width=width, rate=rate, k_share=0.5, reader="constrained", pool_heads=False,
                   min_depth_k=1, min_depth_v=1, v_packet=2, **kw)

    def budgets(self, n_tokens: int, head_dim: int) -> tuple[int, int]:
        """(B_K, B_V) per KV head for a step that reads ``n_tokens`` tokens of dim ``head_dim``.

        Clamped to what is stored (d*W and T*W); raises BudgetError below the minimum depths.
        """
        t, d, w = n_tokens, head_dim, self.width
        bk = self.key_budget(d)
        if self.single_token_values and t == 1 and self.rate is not None:
            bk = min(bk, self.min_depth_k * d)  # the Key of the only token cannot change its weight
        if self.rate is None:
            bv = int(self.budget_v)  # type: ignore[arg-type]
        else:
            bv = int(math.floor((2 * t * d * self.rate - t * bk) / d + 1e-9))
        bv = min(bv, t * w)
        if bk < self.min_depth_k * d:
            raise BudgetError(
                f"Key budget {bk} is below the minimum depth {self.min_depth_k} x {d} channels")
        if bv < self.min_depth_v * t:
            raise BudgetError(
                f"Value budget {bv} is below the minimum depth {self.min_depth_v} x {t} tokens")
        return bk, bv

    def key_budget(self, head_dim: int) -> int:
        """B_K per KV head (independent of T), clamped to d * W."""
        if self.rate is None:
            bk = int(self.budget_k)  # type: ignore[arg-type]
        else:
            bk = int(round(2 * head_dim * self.rate * self.k_share))
        return min(bk, head_dim * self.width)

    def reference_only_options(self) -> list[str]:
        """Named options set here that only the torch reference reader implements (the kernels
        do not; a caller that dispatches to them refuses such a policy)."""
        out = ["key_variance_correction"] if self.key_variance_correction else []
        out += ["sink_keys"] if self.sink_keys else []
        # Key refinement at token granularity is in the kernels (FMA stages); in blocks it is not
        out += ["key_refine_block"] if self.key_refine and self.key_refine_block > 1 else []
        return out + (["single_token_values"] if self.single_token_values else [])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``ReadKV(8,4) flexible``."""
        if self.rate is not None:
            r = f"{self.rate:g}"
        else:
            r = f"BK={self.budget_k},BV={self.budget_v}"
        out = f"ReadKV({self.width},{r}) {self.reader}"
        if self.key_refine:
            out += f" + Key refinement {self.key_refine:g}"
            out += f" (blocks of {self.key_refine_block})" if self.key_refine_block > 1 else ""
        return out
