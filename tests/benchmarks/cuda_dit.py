"""DiT pipelines of realistic size with random weights, for the CUDA benchmarks.

- `sd3_medium`: SD3-medium's MMDiT (24 joint blocks, 24 heads × 64, ~2B parameters) and SD3's
  VAE (16 latent channels); the two CLIP text encoders are tiny and T5 is left out (SD3 pads the
  prompt embedding to the joint dimension).
- `flux_dev`: FLUX.1-dev's transformer (19 double + 38 single blocks, 24 heads × 128, guidance
  embedding, ~12B parameters) and Flux's VAE; a tiny CLIP (768 wide, for the pooled projection)
  and a one-layer T5 4096 wide (the joint dimension), at Flux's 512 prompt tokens.

So the measurement is the DiT and the VAE, what a GPU spends its time on; nothing is downloaded.
Loaded as `python:tests.benchmarks.cuda_dit:sd3_medium` (or `:flux_dev`) on each rank; the
`recorded_*` factories wrap them as `tests/benchmarks/bench_pipelines.Recorded` (every forward's
start and end appended to `KILN_BENCH_FORWARDS`), for bench_gpu_e2e.py. Models are built in the
device's dtype (bf16 on CUDA): a float32 Flux would take 48 GB per process while it is built.
`KILN_BENCH_SMOKE=1` shrinks every model so the scripts can be checked on a CPU first.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
)

from kiln.gpu_worker.pipelines import Pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline, default_dtype
from kiln.gpu_worker.pipelines.tiny_tokenizer import (
    END_TOKEN,
    MAX_LENGTH,
    START_TOKEN,
    write_tiny_vocab,
)
from tests.benchmarks.bench_pipelines import THREADS_ENV, Recorded

SMOKE_ENV = "KILN_BENCH_SMOKE"
POOLED_DIM = 2048  # SD3-medium: CLIP-L (768) + CLIP-G (1280) pooled projections
FLUX_POOLED_DIM = 768  # FLUX.1: CLIP-L's pooled output
FLUX_TEXT_DIM = 4096  # FLUX.1: T5-XXL's width, the joint attention dimension


def smoke() -> bool:
    """Whether `KILN_BENCH_SMOKE=1` asks for the shrunk models (a CPU check of the scripts)."""
    return os.environ.get(SMOKE_ENV) == "1"


@contextmanager
def built_in(dtype: torch.dtype) -> Iterator[None]:
    """New parameters in `dtype` while the body runs (random init there, no float32 copy)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _tokenizer() -> CLIPTokenizer:
    with tempfile.TemporaryDirectory() as folder:
        vocab_path, merges_path = write_tiny_vocab(Path(folder))
        return CLIPTokenizer(
            vocab=str(vocab_path), merges=str(merges_path), model_max_length=MAX_LENGTH
        )


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


def _clip_config(vocab: dict[str, int], hidden_size: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=128,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=MAX_LENGTH,
        bos_token_id=vocab[START_TOKEN],
        eos_token_id=vocab[END_TOKEN],
        pad_token_id=vocab[END_TOKEN],
    )


def _vae(shift_factor: float, scaling_factor: float) -> AutoencoderKL:
    # SD3's and Flux's VAE share this shape; only their latent scaling differs.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(32, 32, 32, 32) if smoke() else (128, 256, 512, 512),
        layers_per_block=1 if smoke() else 2,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
        sample_size=1024,
    )


def _transformer() -> SD3Transformer2DModel:
    small = smoke()
    return SD3Transformer2DModel(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=1 if small else 24,
        attention_head_dim=64,
        num_attention_heads=2 if small else 24,
        joint_attention_dim=4096,
        caption_projection_dim=128 if small else 1536,
        pooled_projection_dim=POOLED_DIM,
        out_channels=16,
        pos_embed_max_size=192,
    )


def sd3_medium(device: torch.device) -> DiffusersPipeline:
    """Build the pipeline directly on `device` (random init there is seconds, not minutes)."""
    tokenizer = _tokenizer()
    vocab = tokenizer.get_vocab()
    dtype = default_dtype(device)
    torch.manual_seed(0)
    with torch.device(device), built_in(dtype):
        pipe: Any = StableDiffusion3Pipeline(
            transformer=_transformer(),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae(shift_factor=0.0609, scaling_factor=1.5305),
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


def _flux_transformer() -> FluxTransformer2DModel:
    small = smoke()
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=1 if small else 19,
        num_single_layers=1 if small else 38,
        attention_head_dim=16 if small else 128,
        num_attention_heads=2 if small else 24,
        joint_attention_dim=64 if small else FLUX_TEXT_DIM,
        pooled_projection_dim=64 if small else FLUX_POOLED_DIM,
        guidance_embeds=True,  # FLUX.1-dev: guidance distilled into an embedding, no CFG rows
        axes_dims_rope=(4, 6, 6) if small else (16, 56, 56),  # sums to attention_head_dim
    )


def _t5(vocab: dict[str, int], width: int) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(vocab),
        d_model=width,
        d_kv=64,
        d_ff=256,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=vocab[END_TOKEN],
    )
    return T5EncoderModel(config)


def flux_dev(device: torch.device) -> DiffusersPipeline:
    """A FLUX.1-dev-size pipeline built directly on `device`, in its dtype."""
    tokenizer = _tokenizer()
    vocab = tokenizer.get_vocab()
    dtype = default_dtype(device)
    small = smoke()
    torch.manual_seed(0)
    with torch.device(device), built_in(dtype):
        pipe: Any = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(
                shift=3.0,  # FLUX.1-dev's scheduler: the shift follows the image's length
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            ),
            vae=_vae(shift_factor=0.1159, scaling_factor=0.3611),
            text_encoder=CLIPTextModel(_clip_config(vocab, 64 if small else FLUX_POOLED_DIM)),
            tokenizer=tokenizer,
            text_encoder_2=_t5(vocab, 64 if small else FLUX_TEXT_DIM),
            tokenizer_2=tokenizer,  # the hand-made BPE serves both encoders
            transformer=_flux_transformer(),
        )
    pipe.to(device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return DiffusersPipeline(pipe, device, "flux-dev")


def _pinned_threads(device: torch.device) -> None:
    # As bench_pipelines.tiny: every CPU process of a comparison computes with the same count.
    threads = os.environ.get(THREADS_ENV)
    if threads and device.type == "cpu":
        torch.set_num_threads(int(threads))


def recorded_sd3_medium(device: torch.device) -> Pipeline:
    """`sd3_medium`, its forwards recorded (`KILN_BENCH_FORWARDS`), CPU threads pinned."""
    _pinned_threads(device)
    return Recorded(sd3_medium(device))


def recorded_flux_dev(device: torch.device) -> Pipeline:
    """`flux_dev`, its forwards recorded (`KILN_BENCH_FORWARDS`), CPU threads pinned."""
    _pinned_threads(device)
    return Recorded(flux_dev(device))
