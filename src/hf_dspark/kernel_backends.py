"""The choice between a Triton kernel and its PyTorch expression, shared by every fused pass (the training loss's
`training/triton_head_loss.py`, block verification's `generation/triton_spare_mass.py`).

"torch" always runs PyTorch; "triton" runs the kernel or raises an error that names the fix; "auto" runs the kernel
where triton imports and the kernel takes the inputs, else PyTorch (the callers also keep PyTorch once a kernel has
failed). Kernel modules import triton, so they are imported only here, when a kernel may run.
"""

from __future__ import annotations

import importlib

KERNEL_BACKENDS = ("auto", "triton", "torch")


def choose_kernel_backend(
    what: str, backend: str, kernel_module: str, inputs: tuple, prefer_torch: bool = False
) -> str:
    """"triton" or "torch". `what` names the pass in errors; `kernel_module` (absolute) defines
    `unsupported_reason(*inputs) -> str | None`; `prefer_torch`: "auto" runs PyTorch without asking the kernel."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"{what} backend must be one of {', '.join(KERNEL_BACKENDS)}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and prefer_torch):
        return "torch"
    try:
        module = importlib.import_module(kernel_module)
    except Exception as err:  # noqa: BLE001 - a broken triton install must not stop "auto"
        if backend == "auto":
            return "torch"
        raise ValueError(
            f"{what} backend 'triton' needs a working triton install ({type(err).__name__}: {err}): "
            "`pip install triton`, or use backend 'torch'"
        ) from err
    reason = module.unsupported_reason(*inputs)
    if reason is None:
        return "triton"
    if backend == "auto":
        return "torch"
    raise ValueError(f"{what} backend 'triton' cannot run here: {reason}. Use backend 'torch' or 'auto'")


__all__ = ["KERNEL_BACKENDS", "choose_kernel_backend"]
