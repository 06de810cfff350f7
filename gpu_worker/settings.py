"""Settings of the gpu_worker package: one pydantic-settings class, env prefix `KILN_`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kiln.common.env_lists import comma_or_json_list

TorchDtypeName = Literal["auto", "float32", "bfloat16", "float16"]
SleepMode = Literal["offload", "drop"]
RankStart = Literal["forkserver", "spawn"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


# torch.compile's portable artifacts, in the compile cache folder: the ranks write and load the
# file (pipelines/compile.py); the node moves it to and from the object store (compile_store.py).
ARTIFACTS_FILE = "mega-cache.bin"


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
    rank_start: RankStart = Field(
        default="forkserver",
        description="How rank processes start: forkserver = forked from a server that has "
        "already imported torch and Kiln's rank code; spawn = a fresh interpreter each.",
    )

    # Sleep and wake (gpu_worker/sleep.py, gpu_worker/ranks/sleep.py).
    idle_sleep_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds without work after which the ranks release their pipelines' "
        "memory until the next job; unset = never.",
    )
    sleep_mode: SleepMode = Field(
        default="offload",
        description="offload: pipeline modules to host memory (frees device memory only); "
        "drop: delete the pipelines and reload them from disk on wake.",
    )
    # torch.compile and warm-up (gpu_worker/pipelines/compile.py, gpu_worker/warmup.py).
    compile: bool = Field(
        default=False, description="Wrap each pipeline's denoiser in torch.compile."
    )
    compile_mode: CompileMode = Field(default="default", description="torch.compile's mode.")
    compile_cache_dir: Path | None = Field(
        default=None,
        description="Inductor and torch.compiler caches kept across restarts; "
        "unset = <KILN_MODEL_CACHE>/compile.",
    )
    warmup: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Shapes WxHxSTEPS[xFRAMES] each pipeline runs before the node takes jobs "
        "(comma-separated); empty = one tiny request.",
    )
    # Per-request LoRA adapters (gpu_worker/pipelines/lora.py).
    lora_dir: Path | None = Field(
        default=None,
        description="Adapters jobs may name: <dir>/<pipeline>/<name>/"
        "pytorch_lora_weights.safetensors; unset = none (kiln worker --lora-dir).",
    )
    lora_cache_count: int = Field(
        default=8, ge=1, description="Adapters each rank keeps loaded per pipeline, at most."
    )
    lora_cache_mb: float = Field(
        default=2048.0,
        gt=0,
        description="Adapter file megabytes each rank keeps loaded per pipeline, at most; "
        "the least recently used adapters are unloaded first.",
    )
    lora_fuse_after: int | None = Field(
        default=None,
        ge=1,
        description="Fuse an adapter set into the weights once this many batches in a row used "
        "it (no per-step adapter cost while it stays hot); unset = never fuse.",
    )

    preview_vae: Path | None = Field(
        default=None,
        description="Folder of a diffusers AutoencoderTiny (TAESD, TAESDXL, TAESD3, TAEF1) that "
        "decodes job previews for the pipelines whose latent channels it takes; unset = a "
        "latent→RGB map fitted to each pipeline's own VAE at start.",
    )

    lora_prefix: str | None = Field(
        default=None,
        description="Folder of the object store (under the storage URL's prefix) holding "
        "adapters as <folder>/<pipeline>/<name>/pytorch_lora_weights.safetensors, fetched on "
        "first use; unset = none.",
    )
    lora_list_interval_s: float = Field(
        default=30.0,
        ge=0,
        description="How often the heartbeat lists the store's adapters again (one LIST per "
        "served pipeline); 0 = at every heartbeat.",
    )

    @field_validator("lora_prefix")
    @classmethod
    def _plain_folder(cls, value: str | None) -> str | None:
        # the node checks the folder against the store's key rules (tasks/node/adapters.py)
        return value.strip("/") or None if value is not None else None

    @field_validator("model_cache", "compile_cache_dir", "lora_dir", "preview_vae")
    @classmethod
    def _expand_cache(cls, value: Path | None) -> Path | None:
        # `~` must be expanded here: the ranks get an absolute path and never see the shell.
        return None if value is None else value.expanduser().resolve()

    @field_validator("warmup", mode="before")
    @classmethod
    def _split_shapes(cls, value: object) -> object:
        # Env values are a comma list (KILN_WARMUP=512x512x25,64x64x2) or a JSON array.
        return comma_or_json_list(value)

    @field_validator("warmup")
    @classmethod
    def _check_shapes(cls, value: list[str]) -> list[str]:
        from kiln.gpu_worker.warmup import parse_warmup_shape  # plain parsing, no torch

        for text in value:
            parse_warmup_shape(text)
        return value

    def compile_cache(self) -> Path:
        """Where the compile caches live: the setting, else a folder of the model cache."""
        return self.compile_cache_dir or self.model_cache / "compile"
