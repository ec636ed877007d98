"""matplotlib for the benchmarks' plots, when it is installed.

A benchmark's results are its table and JSON; the plot is optional (``pip install matplotlib``). Without it
a run ended in a traceback after writing its results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot(path: Path) -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (saying ``path`` is not drawn) without it."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
