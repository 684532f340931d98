"""Lazy package attributes: a package maps public names to the submodule that defines them and imports that
submodule on first access. Keeps `import hf_dspark` (and importing one light submodule, e.g.
`hf_dspark.data.prompts`) from loading datasets, pyarrow, Trainer or matplotlib."""

from __future__ import annotations

import importlib
import warnings


def lazy_attributes(package: str, exports: dict[str, str], namespace: dict):
    """(__getattr__, __dir__) for `package`; exports maps name -> module (absolute, or relative to `package`)."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def moved_module(old: str, new: str):
    """(__getattr__, __dir__) for a module whose contents moved to `new`: every name still resolves from the old
    path, with a FutureWarning naming the new one."""

    def __getattr__(name: str):
        value = getattr(importlib.import_module(new), name, _MISSING)
        if value is _MISSING or name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old} moved to {new}: import {name} from {new} (the old path will be removed in a future release)",
            FutureWarning,
            stacklevel=2,
        )
        return value

    def __dir__():
        module = importlib.import_module(new)
        return sorted(getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]))

    return __getattr__, __dir__


_MISSING = object()
