"""Settings of the gpu_worker package: one pydantic-settings class, env prefix `KILN_`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

TorchDtypeName = Literal["auto", "float32", "bfloat16", "float16"]


class GpuWorkerSettings(BaseSettings):
    """Everything gpu_worker reads from the environment; built once at the entry point."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore", protected_namespaces=())

    model_cache: Path = Field(
        default=Path("~/.cache/kiln/models"),
        description="Where the tiny pipelines are saved once and loaded from (KILN_MODEL_CACHE).",
    )
    torch_dtype: TorchDtypeName = Field(
        default="auto",
        description="Weights dtype; auto = bfloat16 (else float16) on CUDA, float32 on CPU.",
    )
    ready_timeout_s: float = Field(
        default=300.0,
        description="How long a rank may take to start and load before it has failed.",
    )
    shutdown_grace_s: float = Field(
        default=10.0, description="Shutdown ladder: time between asking ranks to exit and SIGTERM."
    )
    cpu_threads_per_rank: int | None = Field(
        default=None,
        description="torch threads per CPU rank; None = the cores shared among the ranks.",
    )

    @field_validator("model_cache")
    @classmethod
    def _expand_cache(cls, value: Path) -> Path:
        # `~` must be expanded here: the ranks get an absolute path and never see the shell.
        return value.expanduser().resolve()
