"""Count the calls that make the host wait for the device, on CPU where there is nothing to wait for.

On CUDA a host synchronization stalls the Python thread until the GPU has finished everything queued, so the
GPU then idles while the host launches the next work. CPU tensors never wait, but the calls that would are the
same: reading a value (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `.numpy()`) and operators whose output size
depends on the data (`nonzero`, boolean indexing, `masked_select`, `unique`). `HostSyncs` counts them per label of
`where()`, which the caller points at the code it is in (a phase, a training step).
"""

from __future__ import annotations

import collections

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that read a value back (`.cpu()` and `.to()` are left out: on CPU tensors they cannot be told
# from a no-op, and the code under test copies to the host only with non_blocking=True).
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}
# Operators whose output shape depends on the data (boolean indexing runs `nonzero` inside `index`).
DATA_SHAPED = {"nonzero", "masked_select", "_local_scalar_dense", "is_nonzero", "unique", "_unique2", "unique_dim"}


class HostSyncs:
    """`with HostSyncs(where) as syncs:` counts synchronizing calls into `syncs.counts[where()]`; `where()` returning
    None counts nothing. A `.item()` reaches both the method and its `_local_scalar_dense`: it counts once."""

    def __init__(self, where=lambda: "all"):
        self.where = where
        self.counts: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()  # (label, call name) -> count
        self._inside_read = 0
        outer = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name not in READS:
                    return func(*args, **(kwargs or {}))
                outer._count(name)
                outer._inside_read += 1
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    outer._inside_read -= 1

        class Operators(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not outer._inside_read and func.__name__.split(".")[0] in DATA_SHAPED:
                    outer._count(func.__name__.split(".")[0])
                return func(*args, **(kwargs or {}))

        self._modes = (Functions(), Operators())

    def _count(self, name: str) -> None:
        label = self.where()
        if label is not None:
            self.counts[label] += 1
            self.calls[(label, name)] += 1

    def __enter__(self) -> "HostSyncs":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
