"""Find the consumers' released code (vLLM, SGLang, speculators, DeepSpec) for the export checks.

A consumer is found, without importing it, either installed in the running environment or as an unpacked
package folder under $HF_DSPARK_CONSUMER_SRC (scripts/check_exports.sh unpacks the released wheels and the
DeepSpec checkout there). Tests that need one skip with the reason when it is absent; with
HF_DSPARK_REQUIRE_CONSUMERS=1 (set by the script) they fail instead, so a check run cannot pass by skipping.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

SOURCE_ENV = "HF_DSPARK_CONSUMER_SRC"
# The releases the export formats were checked against.
VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23", "speculators": "0.9.0", "deepspec": "deepseek-ai/DeepSpec"}


def _unavailable(package: str, what: str):
    reason = (
        f"{package} {VERSIONS[package]} ({what}) not found: run scripts/check_exports.sh, or set {SOURCE_ENV} to a "
        f"folder holding the unpacked {package} package"
    )
    if os.environ.get("HF_DSPARK_REQUIRE_CONSUMERS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def package_root(package: str) -> Path | None:
    root = os.environ.get(SOURCE_ENV)
    if root and (Path(root) / package / "__init__.py").is_file():
        return Path(root) / package
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def consumer_file(package: str, relative: str) -> Path:
    """A file of the consumer's released code (skips the test when the consumer is absent)."""
    root = package_root(package)
    path = root / relative if root is not None else None
    if path is None or not path.is_file():
        _unavailable(package, relative)
    return path


def run_module_file(package: str, relative: str):
    """Execute one self-contained module of a consumer (no imports of the rest of the package) and return it."""
    path = consumer_file(package, relative)
    spec = importlib.util.spec_from_file_location(f"_consumer_{package}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_consumer(package: str, module: str):
    """Import a consumer module for real (its dependencies must be installed; skips otherwise)."""
    root = package_root(package)
    if root is None:
        _unavailable(package, module)
    if str(root.parent) not in sys.path:
        sys.path.append(str(root.parent))
    try:
        return importlib.import_module(module)
    except ImportError as err:
        _unavailable(package, f"{module}: {err}")


def assert_source_says(package: str, relative: str, *snippets: str) -> None:
    """The consumer's file still contains the statements an encoded loader rule relies on."""
    text = consumer_file(package, relative).read_text(encoding="utf-8")
    for snippet in snippets:
        assert snippet in text, f"{package} {relative} no longer contains {snippet!r}: re-check the rule"
