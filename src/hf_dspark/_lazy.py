"""Lazy package attributes: a package maps public names to the submodule that defines them and imports that
submodule on first access. Keeps `import hf_dspark` (and importing one light submodule, e.g.
`hf_dspark.data.prompts`) from loading datasets, pyarrow, Trainer or matplotlib."""

from __future__ import annotations

import importlib


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
