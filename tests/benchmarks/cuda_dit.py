"""A DiT pipeline of realistic size with random weights, for the CUDA benchmark.

The denoiser is SD3-medium's MMDiT (24 joint blocks, 24 heads × 64, ~2B parameters) and the VAE is
SD3's (16 latent channels); the two CLIP text encoders are tiny and T5 is left out (SD3 pads the
prompt embedding to the joint dimension), so the measurement is the DiT and the VAE — what a GPU
spends its time on. Loaded as `python:tests.benchmarks.cuda_dit:sd3_medium` on each rank.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline, default_dtype
from kiln.gpu_worker.pipelines.tiny_tokenizer import (
    END_TOKEN,
    MAX_LENGTH,
    START_TOKEN,
    write_tiny_vocab,
)

POOLED_DIM = 2048  # SD3-medium: CLIP-L (768) + CLIP-G (1280) pooled projections


def _text_encoder(vocab: dict[str, int], projection_dim: int) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=MAX_LENGTH,
        projection_dim=projection_dim,
        bos_token_id=vocab[START_TOKEN],
        eos_token_id=vocab[END_TOKEN],
        pad_token_id=vocab[END_TOKEN],
    )
    return CLIPTextModelWithProjection(config)


def _vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5305,
        sample_size=1024,
    )


def _transformer() -> SD3Transformer2DModel:
    # KILN_BENCH_SMOKE=1 shrinks the DiT so the script can be checked on a CPU first.
    smoke = os.environ.get("KILN_BENCH_SMOKE") == "1"
    return SD3Transformer2DModel(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=1 if smoke else 24,
        attention_head_dim=64,
        num_attention_heads=2 if smoke else 24,
        joint_attention_dim=4096,
        caption_projection_dim=128 if smoke else 1536,
        pooled_projection_dim=POOLED_DIM,
        out_channels=16,
        pos_embed_max_size=192,
    )


def sd3_medium(device: torch.device) -> DiffusersPipeline:
    """Build the pipeline directly on `device` (random init there is seconds, not minutes)."""
    with tempfile.TemporaryDirectory() as folder:
        vocab_path, merges_path = write_tiny_vocab(Path(folder))
        tokenizer = CLIPTokenizer(
            vocab=str(vocab_path), merges=str(merges_path), model_max_length=MAX_LENGTH
        )
    vocab = tokenizer.get_vocab()
    dtype = default_dtype(device)
    torch.manual_seed(0)
    with torch.device(device):
        pipe: Any = StableDiffusion3Pipeline(
            transformer=_transformer(),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae(),
            text_encoder=_text_encoder(vocab, POOLED_DIM // 2),
            tokenizer=tokenizer,
            text_encoder_2=_text_encoder(vocab, POOLED_DIM // 2),
            tokenizer_2=tokenizer,
            text_encoder_3=None,
            tokenizer_3=None,
        )
    pipe.to(device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return DiffusersPipeline(pipe, device, "sd3-medium")
