"""Tiny diffusers pipelines with random weights, built from small configs, saved once to a cache.

`tiny` is a Stable-Diffusion-style text-to-image pipeline (UNet2DConditionModel, AutoencoderKL,
CLIPTextModel, CLIPTokenizer); `tiny-video` is a Wan 2.1-style text-to-video pipeline
(WanTransformer3DModel, AutoencoderKLWan, UMT5EncoderModel, the same hand-made tokenizer);
`tiny-dit` is a Flux-style text-to-image DiT (FluxTransformer2DModel, CLIP and T5 encoders), the
tiny pipeline whose denoiser takes diffusers' block cache (the speed modes). All are saved with
`save_pretrained` and served through `DiffusersPipeline.load`, so the real loading code runs.
Weights come from a fixed torch seed: every build writes the same tensors. No network.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kiln.gpu_worker.pipelines.cache_folder import cache_folder_is_complete, seal_cache_folder
from kiln.gpu_worker.pipelines.tiny_tokenizer import (
    END_TOKEN,
    MAX_LENGTH,
    START_TOKEN,
    write_tiny_vocab,
)
from kiln.gpu_worker.quiet import quiet_progress_bars

# torch, diffusers and transformers are imported by the builders below, so that finding a pipeline
# built (a node preparing its group, `prepare_pipeline`) imports none of them.
if TYPE_CHECKING:
    from diffusers import FluxPipeline, StableDiffusionPipeline, WanPipeline
    from transformers import CLIPTextConfig, CLIPTokenizer, UMT5Config

# Bump when a config below changes, so caches built from the old one are not reused.
TINY_VERSION = 1
WEIGHTS_SEED = 0
TEXT_DIM = 32


def _tiny_tokenizer(workdir: Path) -> CLIPTokenizer:
    from transformers import CLIPTokenizer

    vocab_path, merges_path = write_tiny_vocab(workdir / "vocab-source")
    return CLIPTokenizer(
        vocab=str(vocab_path), merges=str(merges_path), model_max_length=MAX_LENGTH
    )


def build_tiny_image(workdir: Path) -> StableDiffusionPipeline:
    """An SD-style pipeline: 64x64 pixels -> 8x8 latents, a two-level UNet, 2-layer CLIP."""
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel

    tokenizer = _tiny_tokenizer(workdir)
    vocab = tokenizer.get_vocab()
    torch.manual_seed(WEIGHTS_SEED)
    unet = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_DIM,
        norm_num_groups=8,
        attention_head_dim=8,
    )
    vae = AutoencoderKL(
        block_out_channels=[8, 8, 8, 8],  # four levels: the usual 8x spatial compression
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=64,
    )
    text_encoder = CLIPTextModel(_clip_config(vocab))
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _clip_config(vocab: dict[str, int]) -> CLIPTextConfig:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=TEXT_DIM,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=MAX_LENGTH,
        bos_token_id=vocab[START_TOKEN],
        eos_token_id=vocab[END_TOKEN],
        pad_token_id=vocab[END_TOKEN],
    )


def build_tiny_video(workdir: Path) -> WanPipeline:
    """A Wan 2.1-style pipeline: 4x temporal / 8x spatial VAE, 2-block transformer, 1-layer UMT5."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5EncoderModel

    tokenizer = _tiny_tokenizer(workdir)
    vocab = tokenizer.get_vocab()
    torch.manual_seed(WEIGHTS_SEED)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    text_encoder = UMT5EncoderModel(_umt5_config(vocab))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
    )


def _t5_shape(vocab: dict[str, int]) -> dict[str, Any]:
    """The tiny T5-family text encoder's shape (UMT5 for the video pipeline, T5 for the DiT)."""
    return {
        "vocab_size": len(vocab),
        "d_model": TEXT_DIM,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 1,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "pad_token_id": vocab[END_TOKEN],
    }


def _umt5_config(vocab: dict[str, int]) -> UMT5Config:
    from transformers import UMT5Config

    return UMT5Config(**_t5_shape(vocab))


# A trained DiT changes little from one step to the next; random weights feed the timestep's
# embedding into every block at full strength, so the first block's output changed by 20-40 %
# per step and no cache threshold in use ever skipped. Scaled by this, its change is 3-7 % per
# step (28 down to 8 steps), like the trained Flux models the thresholds are tuned on.
DIT_TIMESTEP_SCALE = 0.1


def build_tiny_dit(workdir: Path) -> FluxPipeline:
    """A Flux-style DiT: 64x64 pixels -> 4x4 packed latents, 2 double + 4 single blocks."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _tiny_tokenizer(workdir)
    vocab = tokenizer.get_vocab()
    torch.manual_seed(WEIGHTS_SEED)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    # mypy does not see diffusers' models as torch Modules, which they are.
    timestep = cast(torch.nn.Module, transformer).get_submodule(
        "time_text_embed.timestep_embedder.linear_2"
    )
    with torch.no_grad():
        for parameter in timestep.parameters():
            parameter.mul_(DIT_TIMESTEP_SCALE)
    vae = AutoencoderKL(
        block_out_channels=[8, 8, 8, 8],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=16,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=64,
        use_quant_conv=False,  # as Flux's VAE
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    text_encoder = CLIPTextModel(_clip_config(vocab))
    text_encoder_2 = T5EncoderModel(T5Config(**_t5_shape(vocab)))
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,  # the hand-made BPE serves both encoders
        transformer=transformer,
    )


TINY_BUILDERS: dict[str, Callable[[Path], Any]] = {
    "tiny": build_tiny_image,
    "tiny-video": build_tiny_video,
    "tiny-dit": build_tiny_dit,
}


def tiny_folder(kind: str, cache_dir: Path) -> Path:
    """Where the tiny pipeline `kind` lives once saved."""
    return cache_dir / f"{kind}-v{TINY_VERSION}"


def ensure_tiny(kind: str, cache_dir: Path) -> Path:
    """Build and save `kind` under `cache_dir` unless a complete copy is there; return its folder.

    Call it outside any torch.distributed process group (the worker group does, before it spawns
    ranks): transformers writes weight files only on distributed rank 0, so a save on another rank
    is incomplete. Such a save, or one cut short by a crash, is never put in place: each build
    saves to its own temporary folder, is verified, gets its manifest written last, and is renamed
    into place atomically; a racing loser keeps the winner's folder. An incomplete folder found in
    the cache is moved aside and rebuilt.
    """
    if kind not in TINY_BUILDERS:
        raise ValueError(f"unknown tiny pipeline {kind!r}; known: {sorted(TINY_BUILDERS)}")
    final = tiny_folder(kind, cache_dir)
    if cache_folder_is_complete(final):
        return final
    import torch

    quiet_progress_bars()  # the first import of diffusers here: a built one needs none
    cache_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
    try:
        staging = workdir / "pipeline"
        # Fork the RNG so seeding the weights leaves the caller's random state alone.
        with torch.random.fork_rng(devices=[]):
            TINY_BUILDERS[kind](workdir).save_pretrained(staging)
        seal_cache_folder(staging)
        _move_aside_if_broken(final, workdir)
        try:
            os.rename(staging, final)
        except OSError:
            if not cache_folder_is_complete(final):  # not a lost race: something else is there
                raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return final


def _move_aside_if_broken(final: Path, trash: Path) -> None:
    # A folder without a valid manifest is a crashed or rank>0 build: it would shadow the good
    # one forever. Moving it into our temporary folder deletes it with that folder.
    if final.exists() and not cache_folder_is_complete(final):
        with contextlib.suppress(FileNotFoundError):  # another process moved it first
            os.rename(final, trash / "broken")
