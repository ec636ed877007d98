"""Which flash-attention path this process can use, best first."""

from __future__ import annotations

from typing import Literal

import torch

from kvb_kernels.backend import interpreter_enabled, triton_installed

#: ``"kvb_triton"``: the kvb-kernels Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``);
#: ``"kvb_cuda"``: a compiled CUDA C++ kernel (no such kernel ships in this release, so it is never returned);
#: ``"torch_flash"``: no Triton, but torch SDPA's flash backend works on this GPU;
#: ``"vanilla"``: none of these (CPU without the interpreter): every call takes transformers' SDPA path.
FlashAttnTier = Literal["kvb_triton", "kvb_cuda", "torch_flash", "vanilla"]

# SDPA's flash backend needs sm80+ (Ampere or newer).
_FLASH_MIN_CAPABILITY = (8, 0)


def get_flash_attn_tier() -> FlashAttnTier:
    """The best attention tier available here (see :data:`FlashAttnTier`)."""
    cuda = torch.cuda.is_available()
    if triton_installed() and (cuda or interpreter_enabled()):
        return "kvb_triton"
    if (
        cuda
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability() >= _FLASH_MIN_CAPABILITY
    ):
        return "torch_flash"
    return "vanilla"


def flash_attention_available() -> bool:
    """True when a kvb kernel (not just torch's SDPA) can serve attention in this process."""
    return get_flash_attn_tier() in ("kvb_triton", "kvb_cuda")
