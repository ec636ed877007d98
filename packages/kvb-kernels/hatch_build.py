"""Hatch build hook: package the monorepo's top-level ``kernels/`` sources into kvb-kernels.

The kernel sources live in ``kernels/triton/*.py`` at the repository root (next to ``packages/``), where
CUDA sources will join them; they are imported as ``kvb_kernels.triton.<name>``. The wheel gets each one as
``kvb_kernels/triton/<name>.py``; the sdist carries them under ``kernels/`` at its own root, so a wheel built
from the unpacked sdist finds them there. An editable install copies nothing: ``kvb_kernels.triton`` adds
the checkout's ``kernels/triton/`` to its search path instead (see its ``__init__``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: Kernel source folders, relative to the kernels root, and the import package each one becomes.
KERNEL_PACKAGES = {"triton": "kvb_kernels/triton"}


def kernels_root(project_root: Path) -> Path:
    """``kernels/`` of an unpacked sdist, else the monorepo's top-level one (two levels above the project)."""
    for candidate in (project_root / "kernels", project_root.parent.parent / "kernels"):
        if all((candidate / folder).is_dir() for folder in KERNEL_PACKAGES):
            return candidate
    raise FileNotFoundError(
        f"kernel sources not found: expected kernels/triton/ in {project_root} (sdist) or in "
        f"{project_root.parent.parent} (the repository root); build from a full checkout or the sdist."
    )


class KernelSourcesHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "editable":
            return
        root = kernels_root(Path(self.root))
        for folder, package in KERNEL_PACKAGES.items():
            for source in sorted((root / folder).glob("*.py")):
                target = (
                    f"{package}/{source.name}"
                    if self.target_name == "wheel"
                    else f"kernels/{folder}/{source.name}"
                )
                build_data["force_include"][str(source)] = target
