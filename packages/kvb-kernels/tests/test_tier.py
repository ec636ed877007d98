from __future__ import annotations

import pytest
import torch

from kvb_kernels import flash_attention_available, get_flash_attn_tier
from kvb_kernels.backend import triton_installed


@pytest.mark.skipif(torch.cuda.is_available(), reason="tier on a GPU machine depends on the GPU")
def test_cpu_tiers(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert get_flash_attn_tier() == "vanilla"
    assert not flash_attention_available()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    expected = "kvb_triton" if triton_installed() else "vanilla"
    assert get_flash_attn_tier() == expected
    assert flash_attention_available() == triton_installed()


@pytest.mark.gpu
def test_gpu_tier():
    assert get_flash_attn_tier() == ("kvb_triton" if triton_installed() else "torch_flash")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        ("ON", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("", False),
        # Triton's own reading decides: " 1" made this package expect the interpreter Triton did not run
        # ("0 active drivers"); "y" the other way round (triton.knobs; older Tritons: the usual spellings).
        (" 1", None),
        ("y", None),
    ],
)
def test_interpreter_flag_is_read_like_triton_reads_it(monkeypatch, value, expected):
    """Triton takes true/on/yes as well as 1; reading only "1" made this package assume compiled kernels (GPU
    tuning tables, bf16 served) while Triton interpreted them."""
    from kvb_kernels.backend import interpreter_enabled

    monkeypatch.setenv("TRITON_INTERPRET", value)
    if expected is None:
        knobs = pytest.importorskip("triton.knobs")
        expected = bool(knobs.runtime.interpret)
    assert interpreter_enabled() is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        ("1", True),
        ("true", True),
        ("ON", True),
        ("0", False),
        ("off", False),
        ("False", False),
    ],
)
def test_autotune_switch(monkeypatch, value, expected):
    """Fixed tiles unless tuning is asked for (1/true/on/yes): tuning costs seconds per new shape."""
    from kvb_kernels.backend import autotune_enabled

    if value is None:
        monkeypatch.delenv("KVB_KERNELS_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("KVB_KERNELS_AUTOTUNE", value)
    assert autotune_enabled() is expected


@pytest.mark.skipif(not triton_installed(), reason="Triton is not installed")
@pytest.mark.parametrize("decode", [True, False])
def test_untuned_handle_holds_one_tile(monkeypatch, decode):
    """KVB_KERNELS_AUTOTUNE=0 leaves the autotuner one config, so it compiles and times nothing else; with
    tuning on, the compiled tables offer several (the interpreter always one)."""
    from kvb_kernels.triton.tuning import tuned

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert len(tuned("dense", decode, False, False).configs) == 1
    assert len(tuned("dense", decode, False, True).configs) > 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert len(tuned("paged", decode, True, True).configs) == 1


def test_importing_the_triton_kernels_without_triton_names_the_extra(monkeypatch):
    # Without the extra a direct import said only "No module named 'triton'".
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)
    for name in [m for m in sys.modules if m == "kvb_kernels.triton" or m.startswith("kvb_kernels.triton.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r'pip install "kvb-kernels\[triton\]"'):
        importlib.import_module("kvb_kernels.triton")
