"""Speed modes: a request's `speed` mapped onto diffusers' cache hooks, around one forward.

`exact` runs the model as it is. `balanced` and `fast` apply diffusers' First Block Cache
(`FirstBlockCacheConfig`, ParaAttention's dynamic cache) to the denoiser for the forward: each
step runs the first transformer block, and when its residual changed by less than `threshold`
(mean absolute change relative to the last fully computed step) every other block is skipped and
their cached residual reused. Thresholds per mode (`SPEED_THRESHOLDS`):

- `balanced` 0.05: `FirstBlockCacheConfig`'s own default; on the tiny DiT at 28 steps it
  skips about half the block calls, less with fewer steps (a step then changes more).
- `fast` 0.15: about three quarters of the block calls on the tiny DiT at 28 steps, two in three
  at 8; its output stays within 4 of 255 of `exact` there (docs/operations.md, "Speed modes").

A zero threshold never skips (the change must be above it), so it computes exactly what `exact`
does.

Under context parallelism each rank's first block sees only its slice of the sequence, so the change
it measures is its slice's; decided per rank, one rank could skip the other blocks while another
runs them, and the one running waits in the attention's collectives until the group times out (seen
with two gloo ranks: the slices measured 0.152 and 0.162 against a threshold between them). So while
a forward runs context parallel, the ranks add up their slices' absolute changes and magnitudes (one
all-reduce of two numbers per denoiser call, over diffusers' context-parallel mesh) and every rank
decides on the whole sequence's ratio: the decision one rank with the whole sequence makes.
Row-split forwards need no agreement: no collective runs inside the blocks, each rank decides for
its own rows (as a smaller batch would), and the all-gather after the forward is the same for all.
On CUDA, a float32 denoiser also runs its matmuls in TF32 in the two faster modes; both torch flags
are restored after the forward.

A pipeline serves the faster modes only where the hook works: its denoiser is a diffusers
`CacheMixin` model whose transformer blocks diffusers knows, and its `__call__` wraps each
denoiser call in `cache_context` (the hook keeps its state per context: Flux, Wan, CogVideoX,
LTX, Qwen-Image, HunyuanVideo, ...). Others (a UNet, SD3, PixArt) serve `exact` only and refuse
the rest; they never run a faster mode silently as `exact`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kiln.common.request import DEFAULT_SPEED, SPEED_MODES, declared_speed_modes
from kiln.gpu_worker.inputs import declared_input_schema
from kiln.gpu_worker.protocol import SpeedReport

EXACT = DEFAULT_SPEED
FIRST_BLOCK_CACHE = "first_block_cache"
SPEED_THRESHOLDS: Mapping[str, float] = {"balanced": 0.05, "fast": 0.15}
# The FBC hook's name on the first block (diffusers.hooks.first_block_cache).
_HEAD_HOOK = "fbc_leader_block_hook"


def cache_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks First Block Cache hooks, in its order (the first is the head)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    blocks: list[torch.nn.Module] = []
    for name, child in denoiser.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList):
            blocks.extend(child)
    return blocks


def speed_modes(pipe: Any, denoiser: torch.nn.Module | None) -> tuple[str, ...]:
    """The modes this pipeline serves: all of `SPEED_MODES` where the cache hook works."""
    if denoiser is None or not _takes_block_cache(denoiser):
        return (EXACT,)
    try:
        source = inspect.getsource(type(pipe).__call__)
    except (OSError, TypeError):
        return (EXACT,)
    # The hook's state lives in the context the pipeline opens around each denoiser call.
    return SPEED_MODES if "cache_context(" in source else (EXACT,)


def _takes_block_cache(denoiser: torch.nn.Module) -> bool:
    from diffusers.hooks._helpers import TransformerBlockRegistry
    from diffusers.models.cache_utils import CacheMixin

    if not isinstance(denoiser, CacheMixin):
        return False
    blocks = cache_blocks(denoiser)
    if len(blocks) < 2:  # a head and at least one block to skip
        return False
    try:
        for block in blocks:
            TransformerBlockRegistry.get(type(block))
    except ValueError:
        return False
    return True


def speed_refusal(pipeline: str, modes: tuple[str, ...], speed: str) -> str | None:
    """Why a pipeline serving `modes` refuses `speed`; None when it serves it."""
    if speed in modes:
        return None
    return f"speed: {pipeline} supports {', '.join(modes)}, not {speed!r}"


def declared_refusal(name: str, pipeline: object, speed: str) -> str | None:
    """Why `pipeline` refuses `speed` by what its input schema announces (any kind of pipeline).

    A pipeline that announces no modes serves `exact` only: the mode it cannot run is refused,
    never run as `exact`.
    """
    if speed == EXACT:
        return None
    return speed_refusal(name, declared_speed_modes(declared_input_schema(pipeline)), speed)


@dataclass
class BlockCounter:
    """Counts a forward's block calls and those the cache skipped, from the head block's hook."""

    blocks: int
    calls: int = 0
    skipped: int = 0

    def after_head(self, head: torch.nn.Module, _args: Any, _output: Any) -> None:
        """A forward hook on the head block: it ran once per denoiser call."""
        self.calls += self.blocks
        registry: Any = getattr(head, "_diffusers_hook", None)
        hook = registry.get_hook(_HEAD_HOOK) if registry is not None else None
        if hook is not None and not hook.state_manager.get_state().should_compute:
            self.skipped += self.blocks - 1  # every block after the head answered from cache


class SpeedRun:
    """What one forward's speed mode did; `report()` once the forward is over."""

    def __init__(self, mode: str, threshold: float, tf32: bool, counter: BlockCounter | None):
        self.mode = mode
        self._threshold = threshold
        self._tf32 = tf32
        self._counter = counter

    def report(self) -> SpeedReport:
        """The effective configuration and the block calls counted."""
        counter = self._counter
        return SpeedReport(
            mode=self.mode,
            cache=FIRST_BLOCK_CACHE if counter is not None else "none",
            threshold=self._threshold,
            tf32=self._tf32,
            block_calls=counter.calls if counter is not None else 0,
            block_calls_skipped=counter.skipped if counter is not None else 0,
        )


@contextmanager
def applied_speed(
    denoiser: torch.nn.Module | None,
    mode: str,
    device: torch.device,
    thresholds: Mapping[str, float] = SPEED_THRESHOLDS,
) -> Iterator[SpeedRun]:
    """Run the body in `mode`: the cache hook and TF32 on for it, removed and restored after."""
    if mode == EXACT or denoiser is None:
        yield SpeedRun(mode, 0.0, False, None)
        return
    from diffusers.hooks.first_block_cache import FirstBlockCacheConfig

    threshold = thresholds[mode]
    tf32 = device.type == "cuda" and _dtype(denoiser) == torch.float32
    blocks = cache_blocks(denoiser)
    counter = BlockCounter(len(blocks))
    cached: Any = denoiser  # a CacheMixin: speed_modes admitted it
    cached.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    agree_across_context_ranks(denoiser, blocks[0])
    handle = blocks[0].register_forward_hook(counter.after_head)
    try:
        with lower_precision(enabled=tf32):
            yield SpeedRun(mode, threshold, tf32, counter)
    finally:
        handle.remove()
        cached.disable_cache()


def agree_across_context_ranks(denoiser: torch.nn.Module, head: torch.nn.Module) -> None:
    """Make the head hook's skip decision the same on every context-parallel rank (see above)."""
    registry: Any = getattr(head, "_diffusers_hook", None)
    hook = registry.get_hook(_HEAD_HOOK) if registry is not None else None
    if hook is None:
        raise RuntimeError(f"{type(denoiser).__name__}: First Block Cache left no head hook")
    # An instance attribute shadows the hook's own method; the hook goes with `disable_cache`.
    # Never traced, as diffusers' own decision: a host-side branch. Wrapped here, not by a
    # decorator, so importing this module does not load torch's compiler (seconds per rank start).
    decide = torch.compiler.disable(_shared_decision)
    hook._should_compute_remaining_blocks = functools.partial(decide, hook, denoiser)


def _shared_decision(hook: Any, denoiser: torch.nn.Module, residual: torch.Tensor) -> bool:
    group = context_parallel_group(denoiser)
    if group is None:  # the whole sequence is here: diffusers' own decision, unchanged
        return bool(type(hook)._should_compute_remaining_blocks(hook, residual))
    previous = hook.state_manager.get_state().head_block_residual
    if previous is None:  # the first call of a context, on every rank alike
        return True
    # Sums, not means: slices may differ in length, and the ratio of the sums over every slice is
    # the ratio of the whole sequence's means. Float32 sums: a bf16 sum of a slice rounds coarsely.
    sums = torch.stack(
        [
            (residual - previous).abs().sum(dtype=torch.float32),
            previous.abs().sum(dtype=torch.float32),
        ]
    )
    dist.all_reduce(sums, group=group)
    change, magnitude = sums.tolist()
    return bool(change / magnitude > hook.threshold)


def context_parallel_group(denoiser: torch.nn.Module) -> dist.ProcessGroup | None:
    """The ranks this denoiser's next call splits its sequence across; None when it runs whole.

    diffusers keeps the configuration on the model (`_parallel_config`); Kiln's per-forward
    switch (`gpu_worker.parallel.context.ContextSwitch`) clears it while a call splits rows.
    """
    parallel: Any = getattr(denoiser, "_parallel_config", None)
    context = getattr(parallel, "context_parallel_config", None)
    mesh = getattr(context, "_flattened_mesh", None)
    if mesh is None or mesh.size() < 2:
        return None
    group: dist.ProcessGroup = mesh.get_group()
    return group


@contextmanager
def lower_precision(*, enabled: bool) -> Iterator[None]:
    """TF32 for float32 matmuls and convolutions while the body runs; the flags restored after."""
    if not enabled:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def _dtype(module: torch.nn.Module) -> torch.dtype | None:
    parameter = next(module.parameters(), None)
    return parameter.dtype if parameter is not None else None


def speed_report(pipeline: object) -> SpeedReport | None:
    """The last forward's `SpeedReport` of a pipeline that keeps one (`last_speed`); else None."""
    report = getattr(pipeline, "last_speed", None)
    return report if isinstance(report, SpeedReport) else None
