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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PLANEKV_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Field(default=Path("~/.planekv").expanduser(), description="artifacts, blocks, logs")
    redis_url: str = "redis://127.0.0.1:6379/0"
    control: Endpoint = Endpoint(port=8080)
    store: Endpoint = Endpoint(port=8090)
    ray_gcs_port: int = 6380  # Ray's usual 6379 is Redis's
    ray_dashboard_port: int = 8265
    api_token: str | None = Field(default=None, description="bearer token required by the REST APIs")
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
