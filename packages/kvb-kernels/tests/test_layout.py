"""The kernel sources live in the repository's top-level ``kernels/``; they import as ``kvb_kernels.triton.*``.

From the wheel (the build hook copies them in) and from an editable checkout (the package's search path
reaches ``kernels/triton/``) alike. Found without importing them, so this runs without Triton too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

KERNEL_MODULES = ("common", "dense", "paged", "kivi", "tuning")


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernel_module_is_importable(name: str) -> None:
    spec = importlib.util.find_spec(f"kvb_kernels.triton.{name}")
    assert spec is not None and spec.origin is not None
    origin = Path(spec.origin)
    assert origin.name == f"{name}.py" and origin.is_file()
    # A wheel holds them inside the package; a source checkout serves them from kernels/triton/.
    assert origin.parent.parts[-2:] in (("kvb_kernels", "triton"), ("kernels", "triton"))
