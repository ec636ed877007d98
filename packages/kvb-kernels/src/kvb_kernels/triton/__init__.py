"""Triton kernels. Importing this subpackage requires Triton (``pip install "kvb-kernels[triton]"``).

The kernel modules (``common``, ``dense``, ``paged``, ``kivi``, ``tuning``) live in the repository's
top-level ``kernels/triton/``; the wheel build copies them next to this file (``hatch_build.py``).
"""

from pathlib import Path

try:
    import triton  # noqa: F401
except ImportError as exc:  # a direct import without the extra: name it, not just the missing module
    from kvb_kernels.backend import TRITON_EXTRA_HINT

    raise ImportError(f"kvb_kernels.triton needs Triton: {TRITON_EXTRA_HINT}") from exc

# NOTE: an editable install runs from ``src/`` and holds no copies, so the modules are found in the
# checkout's ``kernels/triton/`` (the repository root, five levels up) by extending the package's search path.
_CHECKOUT_KERNELS = Path(__file__).resolve().parents[5] / "kernels" / "triton"
if not Path(__file__).with_name("common.py").exists() and _CHECKOUT_KERNELS.is_dir():
    __path__.append(str(_CHECKOUT_KERNELS))
