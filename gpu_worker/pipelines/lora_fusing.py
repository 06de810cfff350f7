"""Fusing an adapter set into the weights, and putting the base weights back exactly.

`fuse_lora` adds scale * B @ A into each adapted layer's weight; `unfuse_lora` subtracts it again.
In bfloat16 or float16 the two roundings do not cancel: every fuse and unfuse cycle would move the
base model a little further (up to 6 levels of 255 after one cycle on the tiny pipeline in bf16).
So the base weights of the adapted layers are copied aside before fusing and copied back after
unfusing: the base model stays bit-exact for as long as the node runs, at the cost of one copy of
the adapted layers (the attention projections, a fraction of the model) while a set is fused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class FusedWeights:
    """An adapter set fused into a pipeline's weights, with the base weights it replaced."""

    def __init__(self, pipe: Any, components: Sequence[str], names: Sequence[str]) -> None:
        self._pipe = pipe
        self._components = list(components)
        self._saved = [(p, p.detach().clone()) for p in _adapted_base_parameters(pipe, components)]
        # set_adapters gave each adapter its scale; fuse_lora folds them in at those scales.
        pipe.fuse_lora(components=self._components, lora_scale=1.0, adapter_names=list(names))

    def unfuse(self) -> None:
        """Take the set out again (PEFT's layers unmerged) and restore the exact base weights."""
        self._pipe.unfuse_lora(components=self._components)
        with torch.no_grad():
            for parameter, saved in self._saved:
                parameter.copy_(saved)
        self._saved = []


def _adapted_base_parameters(pipe: Any, components: Sequence[str]) -> list[torch.Tensor]:
    """The weight (and bias) of every layer an adapter wraps, in the named components."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # loaded with diffusers' LoRA support

    found: list[torch.Tensor] = []
    for component in components:
        module = getattr(pipe, component, None)
        if not isinstance(module, torch.nn.Module):
            continue
        for layer in module.modules():
            if isinstance(layer, BaseTunerLayer):
                base = layer.get_base_layer()
                for name in ("weight", "bias"):
                    parameter = getattr(base, name, None)
                    if isinstance(parameter, torch.Tensor):
                        found.append(parameter)
    return found
