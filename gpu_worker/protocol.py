"""Messages between callers, the coordinator and the ranks: frozen dataclasses only.

The coordinator's public types (`GenerationRequest`, `GenerationResult`, `StepProgress`,
`RunMetrics`) sit here together with the coordinator <-> rank messages, so the whole protocol
reads in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from kiln.common.limits import DeclaredLimits
from kiln.common.previews import DEFAULT_PREVIEW_FORMAT, DEFAULT_PREVIEW_SIDE
from kiln.common.request import InputSchema, InputValue
from kiln.gpu_worker.images import InputImage
from kiln.gpu_worker.inputs import inputs_key
from kiln.gpu_worker.shm import FrameDescriptor


@dataclass(frozen=True, order=True)
class AdapterRef:
    """One LoRA adapter a request applies: its name under the node's adapters, and its scale."""

    name: str
    scale: float = 1.0


@dataclass(frozen=True)
class AdapterState:
    """One pipeline's adapter cache on the ranks after a forward (alike on every rank)."""

    pipeline: str
    loaded: tuple[str, ...] = ()  # least recently used first
    fused: tuple[str, ...] = ()  # folded into the weights now
    loaded_bytes: int = 0


@dataclass(frozen=True)
class PreviewSpec:
    """What previews a request wants: one every `every_steps` steps, longer side ≤ `max_side`."""

    every_steps: int
    max_side: int = DEFAULT_PREVIEW_SIDE
    format: str = DEFAULT_PREVIEW_FORMAT  # encoded by the node, off the ranks

    def due(self, step: int) -> bool:
        """True when step `step` (counted from 1) gets a preview."""
        return step % self.every_steps == 0


@dataclass(frozen=True)
class CheckpointPlan:
    """A request's step checkpoints: the states it may resume from, and when rank 0 takes one.

    `resume`: checkpoint objects (gpu_worker/pipelines/step_checkpoint.py), newest first; the
    ranks resume from the first that is valid for this run and pass over the others with a
    reason. A checkpoint is taken after a step when `every_steps` steps or `every_seconds`
    seconds have passed since the last one (or since the run began); neither: none is taken.
    """

    resume: tuple[bytes, ...] = field(default=(), repr=False)
    every_steps: int | None = None
    every_seconds: float | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One job's compute parameters; everything the ranks need and nothing else."""

    request_id: str
    pipeline: str
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    negative_prompt: str | None = None
    num_frames: int = 1
    # Required, keyword only: the job schema owns the default (the API always sends a value), and
    # a second default here once drifted from it.
    guidance_scale: float = field(kw_only=True)
    num_outputs: int = 1
    # The pipeline's own inputs beyond the fields above (`scheduler`, `strength`, ...), as JSON
    # values, validated against the pipeline's input schema before they get here.
    extra_inputs: Mapping[str, InputValue] = field(default_factory=dict, kw_only=True)
    # LoRA adapters to apply, in order (gpu_worker/pipelines/lora.py); () = the base weights.
    loras: tuple[AdapterRef, ...] = field(default=(), kw_only=True)
    # Image inputs by name, fetched and checked by the node (gpu_worker/images.py); their
    # `extra_inputs` entries hold `sha256:<hex>`, so the batch key tells images apart.
    images: Mapping[str, InputImage] = field(default_factory=dict, kw_only=True)
    # Previews while denoising (gpu_worker/previews.py); None = none. Not in the batch key: rank
    # 0 decodes each request's own rows, whatever else shares the forward.
    preview: PreviewSpec | None = field(default=None, kw_only=True)
    # `exact`, `balanced` or `fast` (kiln.common.request.SPEED_MODES; gpu_worker/speed.py).
    speed: str = field(default="exact", kw_only=True)
    # Step checkpoints (gpu_worker/ranks/checkpoints.py); None = none, as before. A request with
    # a plan runs alone: a checkpoint is one job's state.
    checkpoint: CheckpointPlan | None = field(default=None, kw_only=True)
    # The job's W3C trace context (kiln/common/tracing.py): rank 0's spans of this request are
    # its children. Not in the batch key: requests of many traces share a forward.
    trace: Mapping[str, str] = field(default_factory=dict, kw_only=True)

    def batch_key(
        self,
    ) -> tuple[str, int, int, int, int, float, str, tuple[AdapterRef, ...], str]:
        """Requests with equal keys can share one forward pass (equal extra inputs included)."""
        return (
            self.pipeline,
            self.width,
            self.height,
            self.num_frames,
            self.steps,
            self.guidance_scale,
            inputs_key(self.extra_inputs),
            self.loras,  # one forward runs with one set of adapter weights
            self.speed,  # one forward runs with one cache configuration
        )


@dataclass(frozen=True)
class StepProgress:
    """Where a request is on the ranks: stage is loading|denoising|decoding; step counts from 1.

    What the coordinator's `on_progress` callback receives (the job API's `Progress` is another
    type, which the node derives from this one).
    """

    stage: str
    step: int
    total: int
    # A preview of the request's first output after this step: uint8 (height, width, 3), not
    # encoded yet (the caller encodes it off the group's path). Only with stage `denoising`.
    preview: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SpeedReport:
    """How a forward ran its speed mode: the effective configuration, and the blocks it skipped.

    `cache` is the diffusers hook applied (`none` for `exact`), `threshold` its setting; `tf32`
    whether float32 matmuls ran in TF32 (CUDA only). `block_calls` counts the denoiser's
    transformer block calls the forward would make without a cache, `block_calls_skipped` those
    the cache answered from its previous step instead.
    """

    mode: str
    cache: str = "none"
    threshold: float = 0.0
    tf32: bool = False
    block_calls: int = 0
    block_calls_skipped: int = 0


@dataclass(frozen=True)
class RunMetrics:
    """Measured on the ranks for one request (shared by the requests of one batch)."""

    run_s: float
    peak_memory_mb: float
    steps_run: int
    batch_size: int
    # Time rank 0 spent waking its pipelines before this forward (0.0: the group was awake).
    wake_s: float = 0.0
    speed: SpeedReport | None = None  # from pipelines that report one (DiffusersPipeline)
    # The step a checkpoint resumed the forward from (0: from the start), and why the
    # checkpoints offered before it were passed over.
    resumed_at_step: int = 0
    checkpoint_refusals: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """The outputs of one request: one uint8 array of shape (frames, height, width, 3) each."""

    request_id: str
    outputs: list[np.ndarray] = field(default_factory=list)
    metrics: RunMetrics | None = None


# --- coordinator <-> ranks ---------------------------------------------------------------------
# The coordinator talks to rank 0 only (one command pipe, one result pipe); rank 0 relays each
# batch to the other ranks over a gloo CPU group. Every rank has its own status pipe to the
# process that owns the group, used only for lifecycle: ready, failed to start, fatal fault.


class FailureKind(StrEnum):
    """Why a forward failed on a rank; decides the error type the caller sees."""

    OOM = "oom"
    ERROR = "error"
    COLLECTIVE = "collective"  # a collective broke (peer gone, timeout): the group must go


@dataclass(frozen=True)
class RunBatch:
    """Coordinator -> rank 0 -> all ranks: run these compatible requests in one forward."""

    batch_id: int
    requests: tuple[GenerationRequest, ...]


@dataclass(frozen=True)
class StopVerdict:
    """Coordinator -> rank 0: stop these requests of the batch (answers `StepDone(after_step)`).

    `after_step` is the step whose progress this verdict answers, or -1 when the coordinator
    stops a request on its own (deadline). Rank 0 waits for the verdict of step k-1 before it
    decides at the end of step k, so a request whose `should_stop` turned true when step k was
    reported runs at most k+1 steps.

    `checkpoint_ids` (a subset of `stop_ids`): requests that go back to the queue to resume
    elsewhere (a drain): rank 0 takes a step checkpoint of the step they stop at, whatever the
    cadence of their `CheckpointPlan` (a request without one stops as any other).
    """

    batch_id: int
    after_step: int
    stop_ids: frozenset[str] = frozenset()
    checkpoint_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ShutdownGroup:
    """Coordinator -> rank 0 -> all ranks: leave the loop and exit cleanly."""


@dataclass(frozen=True)
class SleepGroup:
    """Coordinator -> rank 0 -> all ranks: the group is idle; release the pipelines' memory.

    `mode` is `offload` (modules to host memory) or `drop` (pipelines deleted, reloaded from disk).
    There is no wake message: a rank wakes its pipelines when the next `RunBatch` reaches it.
    """

    mode: str


@dataclass(frozen=True)
class WakeGroup:
    """Rank 0 -> the other ranks (relayed, never from the coordinator): a batch came; wake now.

    Sent before rank 0 wakes itself, so every rank reloads at once rather than one after another.
    """


@dataclass(frozen=True)
class MemoryReading:
    """One rank's memory at a moment: process RSS, and the torch allocator's on CUDA (else 0)."""

    rss_mb: float
    allocated_mb: float = 0.0
    reserved_mb: float = 0.0


@dataclass(frozen=True)
class GroupAsleep:
    """Rank 0 -> coordinator: every rank slept; rank 0's memory before and after, and the time."""

    mode: str
    before: MemoryReading
    after: MemoryReading
    sleep_s: float


@dataclass(frozen=True)
class StepDone:
    """Rank 0 -> coordinator: every rank finished denoising step `step` of `total`."""

    batch_id: int
    step: int
    total: int


@dataclass(frozen=True)
class StepPreview:
    """Rank 0 -> coordinator: a preview of one request after `step` (uint8 (H, W, 3) pixels)."""

    batch_id: int
    request_id: str
    step: int
    total: int
    pixels: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class StepCheckpoint:
    """Rank 0 -> coordinator: a request's checkpoint after `steps_done` of `total` steps."""

    batch_id: int
    request_id: str
    steps_done: int
    total: int
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class RequestRejected:
    """Rank 0 -> coordinator: the pipeline refused this request (`UnsupportedRequest`)."""

    batch_id: int
    request_id: str
    message: str


@dataclass(frozen=True)
class RequestOutputs:
    """One request's outputs as shared-memory descriptors (read once, then unlinked)."""

    request_id: str
    frames: tuple[FrameDescriptor, ...]


@dataclass(frozen=True)
class BatchDone:
    """Rank 0 -> coordinator: the forward finished; stopped requests have no outputs."""

    batch_id: int
    outputs: tuple[RequestOutputs, ...]
    stopped: frozenset[str]
    metrics: RunMetrics
    adapters: AdapterState | None = None  # the batch's pipeline's adapter cache, if it has one


@dataclass(frozen=True)
class BatchFailed:
    """Rank 0 -> coordinator: the forward raised on every rank alike; the group is consistent."""

    batch_id: int
    kind: FailureKind
    message: str


@dataclass(frozen=True)
class RankReady:
    """Rank -> group owner: loaded, parallelised, warmed up; its pipelines' limits and inputs."""

    rank: int
    pid: int
    limits: dict[str, DeclaredLimits] = field(default_factory=dict)
    inputs: dict[str, InputSchema] = field(default_factory=dict)  # per pipeline that declares


@dataclass(frozen=True)
class RankFailed:
    """Rank -> group owner: could not start; `message` is the rank's own traceback."""

    rank: int
    message: str


@dataclass(frozen=True)
class RankFault:
    """Rank -> group owner: a forward failed on this rank, or (`fatal`) the rank is exiting."""

    rank: int
    batch_id: int | None
    kind: FailureKind
    message: str
    fatal: bool


@dataclass(frozen=True)
class RankOutcome:
    """Rank -> rank 0 (gathered after each forward): how the forward ended on this rank."""

    rank: int
    status: str  # ok | stopped | failed
    kind: FailureKind | None
    message: str
    steps_run: int
    peak_memory_mb: float
    wake_s: float = 0.0  # time this rank spent waking its pipelines before the forward


CoordinatorCommand = RunBatch | StopVerdict | ShutdownGroup | SleepGroup
LeaderMessage = (
    StepDone
    | StepPreview
    | StepCheckpoint
    | RequestRejected
    | BatchDone
    | BatchFailed
    | GroupAsleep
)
StatusMessage = RankReady | RankFailed | RankFault
