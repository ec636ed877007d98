"""The kernel sources live in the repository's top-level ``kernels/``; they import as ``kvb_kernels.triton.*``.

From the wheel (the build hook copies them in) and from an editable checkout (the package's search path
reaches ``kernels/triton/``) alike. Found without importing them, so this runs without Triton too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

KERNEL_MODULES = ("common", "dense", "paged", "kivi", "tuning", "awq_gemm")


def _origin(name: str) -> Path | None:
    """Where ``kvb_kernels.triton.<name>`` is found. With Triton, by the import system; without it the
    subpackage's ``__init__`` refuses to import (it names the missing extra), so by the two places it
    searches: beside it (a wheel) or the checkout's ``kernels/triton/`` (an editable install)."""
    if importlib.util.find_spec("triton") is not None:
        spec = importlib.util.find_spec(f"kvb_kernels.triton.{name}")
        return None if spec is None or spec.origin is None else Path(spec.origin)
    package = importlib.util.find_spec("kvb_kernels")
    assert package is not None and package.origin is not None
    subpackage = Path(package.origin).parent / "triton"
    for folder in (subpackage, subpackage.resolve().parents[4] / "kernels" / "triton"):
        if (folder / f"{name}.py").is_file():
            return folder / f"{name}.py"
    return None


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernel_module_is_importable(name: str) -> None:
    origin = _origin(name)
    assert origin is not None
    assert origin.name == f"{name}.py" and origin.is_file()
    # A wheel holds them inside the package; a source checkout serves them from kernels/triton/.
    assert origin.parent.parts[-2:] in (("kvb_kernels", "triton"), ("kernels", "triton"))
