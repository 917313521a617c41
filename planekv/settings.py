"""One settings model for every component: defaults, then a YAML file, then ``PLANEKV_*`` env vars.

The YAML file is named by ``PLANEKV_CONFIG`` (or passed to :func:`load_settings`). Nested fields
use ``__`` in env vars, e.g. ``PLANEKV_CONTROL__PORT=8081``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Endpoint(BaseModel):
    host: str = "127.0.0.1"
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class StoreService(Endpoint):
    """The store service (planekv.services.store): its endpoint plus the block store's tiers."""

    port: int = 8090
    memory_bytes: int = Field(default=2 << 30, ge=0, description="memory tier capacity (frame bytes)")
    file_bytes: int = Field(default=32 << 30, ge=0, description="file (NVMe) tier capacity; 0 = no file tier")
    spill_dir: Path | None = Field(default=None, description="file tier directory; default data_dir/store-<port>")
    write_through: bool = Field(default=False, description="also write every block to the file tier before acking")
    fsync: bool = Field(default=True, description="fsync file-tier writes (temp file, fsync, rename)")
    max_block_bytes: int = Field(default=64 << 20, ge=8192, description="largest frame a PUT may carry")
    redis_index: bool = Field(default=True, description="publish the block index to Redis (redis_url)")
    store_id: str | None = Field(default=None, description="name in the block index; default host:port")
    require_registered_format: bool = Field(default=True, description="refuse (409) a block whose format is not "
                                                                      "registered at the control plane (needs "
                                                                      "redis_index)")
    reconcile_interval_s: float = Field(default=60.0, gt=0, le=86400,
                                        description="seconds between reconciliations of the block index with "
                                                    "the tiers (one also runs at start)")
    min_free_bytes: int = Field(default=1 << 30, ge=0, description="/readyz fails while the spill directory's disk "
                                                                   "has less free space than this")


class ControlService(Endpoint):
    """The control plane (planekv.services.control)."""

    port: int = 8080
    max_calibration_bytes: int = Field(default=64 << 20, ge=1024, description="largest calibration upload")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PLANEKV_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Field(default=Path("~/.planekv").expanduser(), description="artifacts, blocks, logs")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis of the metadata; may carry a "
                           "password (redis://:PASSWORD@host...), else see redis_password_file; logged redacted")
    redis_password_file: Path | None = Field(default=None, description="a file holding the password Redis "
                                             "requires (its requirepass); read at start, never logged")
    control: ControlService = ControlService()
    store: StoreService = StoreService()
    ray_gcs_port: int = 6380  # Ray's usual 6379 is Redis's
    ray_dashboard_port: int = 8265
    api_token: str | None = Field(default=None, description="bearer token required by the REST APIs")
    allow_no_token: bool = Field(default=False, description="let a REST API without api_token listen on a "
                                                            "non-loopback address (it warns instead of refusing)")
    device: str = "auto"  # "cuda", "cpu" or "auto"
    log_level: str = "INFO"


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Defaults < YAML file (``path`` or $PLANEKV_CONFIG) < env vars < keyword overrides."""
    path = path or os.environ.get("PLANEKV_CONFIG")
    file_values: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"settings file {p} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"settings file {p} must hold a mapping")
        file_values = loaded
    env = Settings()  # env vars and defaults
    merged = {**file_values, **env.model_dump(exclude_defaults=True), **overrides}
    return Settings(**merged)
