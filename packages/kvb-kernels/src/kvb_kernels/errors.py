"""The exceptions kvb-kernels raises. Every one derives from :class:`KernelError`.

User mistakes also subclass ``ValueError``/``TypeError`` so callers that only know the builtins still catch
them; each message says what to change. A missing optional dependency raises :class:`KernelUnavailableError`,
an ``ImportError`` naming the extra to install.
"""

from __future__ import annotations


class KernelError(Exception):
    """Base class of every error raised by kvb-kernels."""


class ShapeError(KernelError, ValueError):
    """Tensor shapes or sizes do not fit the kernel's layout contract (the message names the expected shape)."""


class DTypeError(KernelError, TypeError):
    """A tensor has a dtype the kernel does not accept (the message lists the accepted ones)."""


class DeviceError(KernelError, ValueError):
    """Tensors live on a device the kernel cannot run on, or on different devices."""


class KernelUnavailableError(KernelError, ImportError):
    """An optional backend (Triton, a CUDA toolkit) is missing; the message says what to install."""


class GradientError(KernelError, RuntimeError):
    """An input requires grad: the kernels are forward-only (no backward), so their output would silently
    carry no gradient; run them under ``torch.no_grad()`` / ``torch.inference_mode()``."""
