"""The Triton-or-PyTorch choice shared by the fused passes (loss, spare mass)."""

from __future__ import annotations

import sys
import types

import pytest

from hf_dspark.kernel_backends import choose_kernel_backend


@pytest.fixture
def fake_kernel(monkeypatch):
    """A kernel module that takes inputs whose first element is "ok"."""
    module = types.ModuleType("fake_kernel")
    module.unsupported_reason = lambda x: None if x == "ok" else f"cannot take {x}"
    monkeypatch.setitem(sys.modules, "fake_kernel", module)
    return "fake_kernel"


def test_the_kernel_runs_where_it_takes_the_inputs(fake_kernel):
    assert choose_kernel_backend("loss", "auto", fake_kernel, ("ok",)) == "triton"
    assert choose_kernel_backend("loss", "triton", fake_kernel, ("ok",)) == "triton"
    assert choose_kernel_backend("loss", "torch", fake_kernel, ("ok",)) == "torch"
    assert choose_kernel_backend("loss", "auto", fake_kernel, ("ok",), prefer_torch=True) == "torch"
    assert choose_kernel_backend("loss", "triton", fake_kernel, ("ok",), prefer_torch=True) == "triton"


def test_auto_falls_back_and_triton_says_why(fake_kernel, monkeypatch):
    assert choose_kernel_backend("spare-mass", "auto", fake_kernel, ("bf16",)) == "torch"
    with pytest.raises(ValueError, match="spare-mass backend 'triton' cannot run here: cannot take bf16. Use backend"):
        choose_kernel_backend("spare-mass", "triton", fake_kernel, ("bf16",))
    monkeypatch.setitem(sys.modules, "broken_kernel", None)  # its import fails, as with a broken triton install
    assert choose_kernel_backend("loss", "auto", "broken_kernel", ("ok",)) == "torch"
    with pytest.raises(ValueError, match="needs a working triton install .*`pip install triton`"):
        choose_kernel_backend("loss", "triton", "broken_kernel", ("ok",))
    with pytest.raises(ValueError, match="loss backend must be one of auto, triton, torch, got 'cuda'"):
        choose_kernel_backend("loss", "cuda", fake_kernel, ("ok",))
