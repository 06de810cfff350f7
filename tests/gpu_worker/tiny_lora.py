"""Tiny random LoRA adapters for the tiny image pipeline, built offline with peft.

An adapter is a peft `LoraConfig` on the tiny UNet's attention projections with random, non-zero
A and B matrices (peft would start B at zero, which changes nothing), saved with diffusers'
`StableDiffusionPipeline.save_lora_weights` in the layout `kiln worker --lora-dir` reads:
`<dir>/<pipeline>/<name>/pytorch_lora_weights.safetensors`. `fuse_by_hand` applies one to a copy
of the UNet's weights without diffusers, as the reference the served adapter must match.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import load_file

from kiln.gpu_worker.pipelines.lora_folders import ADAPTER_WEIGHTS

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
RANK = 4
ALPHA = 8  # alpha/r = 2: the reference must apply the ratio, not assume 1
STRENGTH = 0.2  # entries of A and B: about 50 levels of 255 at scale 1, far from saturating


def build_tiny_lora(unet: torch.nn.Module, folder: Path, seed: int) -> Path:
    """Save a random LoRA for `unet` (left untouched) into `folder`; returns the weights file."""
    model = copy.deepcopy(unet)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
    inject_adapter_in_model(config, model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                noise = torch.randn(parameter.shape, generator=generator) * STRENGTH
                parameter.copy_(noise)
    layers = get_peft_model_state_dict(model)
    metadata = {"r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS}
    StableDiffusionPipeline.save_lora_weights(
        folder, unet_lora_layers=layers, unet_lora_adapter_metadata=metadata
    )
    return folder / ADAPTER_WEIGHTS


def fuse_by_hand(unet: torch.nn.Module, weights: Path, scale: float) -> None:
    """W += scale * (alpha / r) * B @ A for every adapted projection of `unet`, in place."""
    tensors = load_file(str(weights))
    modules = dict(unet.named_modules())
    with torch.no_grad():
        for key, down in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            up = tensors[key.replace(".lora_A.", ".lora_B.")]
            path = key.removeprefix("unet.").removesuffix(".lora_A.weight")
            layer = modules[path]
            assert isinstance(layer, torch.nn.Linear)
            delta = (up.double() @ down.double()) * scale * ALPHA / RANK
            layer.weight.add_(delta.to(layer.weight.device, layer.weight.dtype))
