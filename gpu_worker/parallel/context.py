"""Context parallel: diffusers' sequence parallelism, and switching it off and on per forward.

diffusers' `ContextParallelConfig` (Ulysses or ring attention) works for models that ship a
context-parallel plan (`_cp_plan`: Wan, LTX, Flux, QwenImage, ...). diffusers 0.42's
`enable_parallelism` computes `rank % torch.accelerator.device_count()`, which divides by zero
on a CPU-only build, so on CPU the same steps are done here with diffusers' own pieces
(`ParallelConfig.setup`, `apply_context_parallel`). On CPU only Ulysses runs: ring attention
needs an attention backend that returns the log-sum-exp, and torch's native CPU attention does
not. The CUDA path uses the public `enable_parallelism`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kiln.gpu_worker.parallel.spec import ContextKind


class ContextSwitch:
    """Turns a model's context parallelism off and on between forwards.

    diffusers enables it as hooks on submodules plus a `_parallel_config` on the attention
    processors. Removing the hooks would also reset the model's `forward`, which Kiln's wrapper
    replaced, so the hooks stay registered and their pre/post steps are swapped for pass-through
    ones while it is off (diffusers 0.42 internals: `ModelHook.fn_ref`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from diffusers.hooks.context_parallel import (
            ContextParallelGatherHook,
            ContextParallelSplitHook,
        )

        hook_types = (ContextParallelGatherHook, ContextParallelSplitHook)
        self._refs: list[tuple[Any, Any, Any]] = []
        self._configs: list[tuple[Any, Any]] = []
        for module in model.modules():
            registry: Any = getattr(module, "_diffusers_hook", None)
            hooks = registry.hooks.values() if registry is not None else ()
            for hook in (h for h in hooks if isinstance(h, hook_types)):
                self._refs.append((hook.fn_ref, hook.fn_ref.pre_forward, hook.fn_ref.post_forward))
            for owner in (module, getattr(module, "processor", None)):
                config = getattr(owner, "_parallel_config", None)
                if config is not None:
                    self._configs.append((owner, config))
        self.on = True

    def set(self, on: bool) -> None:
        """Context parallel for the next forwards (`on`), or a plain forward on every rank."""
        if on == self.on:
            return
        for ref, pre, post in self._refs:
            ref.pre_forward, ref.post_forward = (pre, post) if on else (_pass_inputs, _pass_output)
        for owner, config in self._configs:
            owner._parallel_config = config if on else None
        self.on = on


def _pass_inputs(_module: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def _pass_output(_module: Any, output: Any) -> Any:
    return output


def enable_context_parallel(denoiser: torch.nn.Module, kind: ContextKind) -> None:
    """Split the model's attention sequence across the default group; ValueError if it can't."""
    from diffusers import ContextParallelConfig

    # Configuration errors first, before any collective: they must show even with one rank.
    name = type(denoiser).__name__
    if getattr(denoiser, "_cp_plan", None) is None:
        raise ValueError(f"{name} has no context-parallel plan in diffusers; use mode 'batch'")
    device = next(denoiser.parameters()).device
    if kind == "ring" and device.type == "cpu":
        raise ValueError(
            "ring attention does not run on CPU (native CPU attention returns no log-sum-exp); "
            "use context_kind 'ulysses' on CPU ranks"
        )
    world = dist.get_world_size()
    if world == 1:
        return  # one rank: the whole sequence is local
    heads = getattr(getattr(denoiser, "config", None), "num_attention_heads", None)
    if kind == "ulysses" and heads is not None and heads % world:
        raise ValueError(f"Ulysses needs attention heads ({heads}) divisible by ranks ({world})")
    if kind == "ring":
        config = ContextParallelConfig(ring_degree=world)
    else:
        config = ContextParallelConfig(ulysses_degree=world)
    if device.type == "cpu":
        _enable_cpu_context_parallel(denoiser, config, device)
    else:
        denoiser.enable_parallelism(config=config)  # type: ignore[operator]


def _enable_cpu_context_parallel(
    denoiser: torch.nn.Module, config: Any, device: torch.device
) -> None:
    # What `ModelMixin.enable_parallelism` does, minus its accelerator-only device lookup.
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    model: Any = denoiser  # diffusers' ModelMixin attributes are untyped
    mesh = init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
    parallel_config = ParallelConfig(context_parallel_config=config)
    parallel_config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    model._parallel_config = parallel_config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = parallel_config
    apply_context_parallel(model, config, model._cp_plan)
