"""The control plane's request and response bodies (pydantic), and the id patterns they check."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, model_validator

from ...kvstore import CODEBOOKS, FormatSpec
from ...kvstore.format import LAYOUT_VERSION, V_RUNS
from ...tiering.placement import PlacementPolicy
from ..request_body import RequestBody

ID16 = r"^[0-9a-f]{16}$"  # a format or calibration id: 16 hex digits
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"  # a placement policy's name
SEQ = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"  # a sequence id
STORE = r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,199}$"  # a store id (default host:port)

# ---- formats


class FormatSpecBody(RequestBody):
    """A FormatSpec (planekv.kvstore.FormatSpec), validated by the same rules."""

    model_id: str = Field(min_length=1, max_length=256)
    n_layers: int = Field(ge=1, le=65536)
    n_q_heads: int = Field(ge=1, le=65536)
    n_kv_heads: int = Field(ge=1, le=65536)
    head_dim: int = Field(ge=8, le=65536)
    calibration_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    model_revision: str = Field(default="unknown", max_length=256)
    position: Literal["rope-before-cache", "none"] = "rope-before-cache"
    rope_theta: int | float = Field(default=10000.0, gt=0, le=1e12, allow_inf_nan=False)
    seed_k: int = Field(default=FormatSpec.seed_k, ge=0, lt=1 << 63)
    seed_v: int = Field(default=FormatSpec.seed_v, ge=0, lt=1 << 63)
    codebook: Literal[CODEBOOKS] = "gaussian-lloyd-tree"  # every codebook FormatSpec knows
    width: int = Field(default=8, ge=1, le=8)
    page_size: Literal[64, 128] = 64
    layout_version: int = Field(default=LAYOUT_VERSION, ge=1, le=LAYOUT_VERSION)
    # An int, not Literal[1, 2, 4, 8]: pydantic takes true for the literal 1 even in strict mode.
    v_run: int = Field(default=1, json_schema_extra={"enum": list(V_RUNS)})

    @model_validator(mode="after")
    def _spec(self) -> FormatSpecBody:
        self.spec()  # FormatSpec's own checks (GQA multiple, head_dim multiple of 8, ...)
        return self

    def spec(self) -> FormatSpec:
        return FormatSpec.from_dict(self.model_dump())


class FormatEntry(BaseModel):
    format_id: str
    spec: dict[str, Any]
    created_at: float


class FormatList(BaseModel):
    formats: list[FormatEntry]


# ---- calibrations


class CalibrationMeta(BaseModel):
    calibration_id: str
    version: int = Field(description="registration order on this control plane (1, 2, ...)")
    artifact_version: int = Field(description="version of the artifact format (planekv.kvstore.calibration)")
    sha256: str
    bytes: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    seed_k: int
    seed_v: int
    source: Literal["upload", "computed"]
    meta: dict[str, Any]
    created_at: float


class CalibrationList(BaseModel):
    calibrations: list[CalibrationMeta]


Stat3 = Annotated[list[Annotated[list[Annotated[list[Annotated[float, Field(allow_inf_nan=False)]],
                                                Field(min_length=1, max_length=4096)]],
                                 Field(min_length=1, max_length=1024)]], Field(min_length=1, max_length=1024)]
Sample4 = Annotated[list[Annotated[list[Annotated[list[Annotated[list[Annotated[float, Field(allow_inf_nan=False)]],
                                                                 Field(min_length=1, max_length=4096)]],
                                                  Field(min_length=2, max_length=65536)]],
                                   Field(min_length=1, max_length=1024)]], Field(min_length=1, max_length=1024)]


class CalibrationStats(RequestBody):
    """Per layer, KV head and channel: mean and scale of transformed K (after RoPE) and V."""

    mu_k: Stat3
    sigma_k: Stat3
    mu_v: Stat3
    sigma_v: Stat3


class CalibrationSamples(RequestBody):
    """K (after RoPE) and V samples, untransformed: [layers][kv_heads][tokens][head_dim]."""

    k: Sample4
    v: Sample4


class CalibrationCompute(RequestBody):
    """Compute a calibration from statistics or from samples (exactly one of the two)."""

    seed_k: int = Field(default=FormatSpec.seed_k, ge=0, lt=1 << 63)
    seed_v: int = Field(default=FormatSpec.seed_v, ge=0, lt=1 << 63)
    meta: dict[str, Any] = Field(default_factory=dict)
    statistics: CalibrationStats | None = None
    samples: CalibrationSamples | None = None

    @model_validator(mode="after")
    def _one(self) -> CalibrationCompute:
        if (self.statistics is None) == (self.samples is None):
            raise ValueError("give exactly one of 'statistics' and 'samples'")
        return self


# ---- placement policies


def _strict_policy(value: Any) -> Any:
    """A policy document in a request, validated strictly (nested models included); PlacementPolicy
    itself stays lax for its Python callers."""
    return PlacementPolicy.model_validate(value, strict=True) if isinstance(value, dict) else value


StrictPolicy = Annotated[PlacementPolicy, BeforeValidator(_strict_policy)]


class PolicyCreate(RequestBody):
    name: str = Field(pattern=NAME)
    policy: StrictPolicy
    comment: str = Field(default="", max_length=1000)


class PolicyUpdate(RequestBody):
    policy: StrictPolicy
    comment: str = Field(default="", max_length=1000)
    activate: bool = False


class PolicyActivate(RequestBody):
    version: int = Field(ge=1)


class PolicyVersion(BaseModel):
    name: str
    version: int
    active: bool
    policy: PlacementPolicy
    comment: str
    sha256: str
    created_at: float


class PolicySummary(BaseModel):
    name: str
    active_version: int
    latest_version: int
    created_at: float
    active: PolicyVersion


class PolicyList(BaseModel):
    policies: list[PolicySummary]


class PolicyVersions(BaseModel):
    name: str
    versions: list[PolicyVersion]


class PolicyEvent(BaseModel):
    action: Literal["created", "updated", "activated", "rolled_back"]
    version: int
    previous: int | None = None
    at: float


class PolicyHistory(BaseModel):
    name: str
    events: list[PolicyEvent]


# ---- caches


class HotPlanesBody(RequestBody):
    k: int = Field(ge=0, le=8)
    v: int = Field(ge=0, le=8)


class CacheRegister(RequestBody):
    format_id: str = Field(pattern=ID16)
    n_tokens: int | None = Field(default=None, ge=0, le=1 << 40)
    policy: str | None = Field(default=None, pattern=NAME, description="placement policy name")
    hot_planes: HotPlanesBody | None = Field(default=None, description="planes [0, h) kept on the GPU")


class TierPlanes(BaseModel):
    blocks: int
    bytes: int
    planes: dict[str, list[str]] = Field(description="plane ranges held, per kind ('k', 'v'), e.g. ['2-8']")
    stores: list[str]


class CacheEntry(BaseModel):
    sequence_id: str
    format_id: str
    created_at: float
    source: str
    n_tokens: int | None = None
    policy: str | None = None
    hot_planes: HotPlanesBody | None = None


class CacheDetail(CacheEntry):
    tiers: dict[str, TierPlanes]


class CacheList(BaseModel):
    caches: list[CacheEntry]
    total: int


# ---- stats and health


class TierTotals(BaseModel):
    blocks: int
    bytes: int


class Stats(BaseModel):
    formats: int
    calibrations: int
    policies: int
    caches: int
    stores: dict[str, dict[str, Any]]
    tiers: dict[str, TierTotals]


# ---- stores


class StoreEntry(BaseModel):
    """A store id the block index knows: its record, its heartbeat and how many entries it has."""

    store_id: str
    record: dict[str, Any] | None = Field(description="what the store published at start (url, capacities, "
                                                        "started_at); null if absent")
    heartbeat_age_s: float | None = Field(description="seconds since its last heartbeat (Redis time); null if "
                                                      "none is recorded")
    index_entries: int = Field(description="block index entries attributed to it")


class StoreList(BaseModel):
    stores: list[StoreEntry]
    heartbeat_interval_s: float
    forget_grace_s: float = Field(description="the default grace period of POST /v1/stores/{store_id}/forget")


class StoreForgotten(BaseModel):
    store_id: str
    index_entries_removed: int
    heartbeat_age_s: float | None = Field(description="seconds since its last heartbeat; null if none was recorded")


class Health(BaseModel):
    status: Literal["ok"]
    redis: str
