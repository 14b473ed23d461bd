"""The provider registry: which names exist, what an unknown one says, and that the engine uses it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from backends import BackendUnavailable, TransferEngine, provider_available
from backends.providers import registry


def test_the_registry_lists_the_providers_and_auto_chooses_among_them() -> None:
    assert set(registry.PROVIDERS) == {"tcp", "shm", "efa", "verbs"}
    assert set(registry.AUTO_ORDER) <= set(registry.PROVIDERS)
    for name, row in registry.PROVIDERS.items():
        assert row.name == name
        module = importlib.import_module(row.module)
        assert callable(module.open_domains), row
        assert callable(module.provider_available), row
    assert registry.choose("auto", "127.0.0.1").name in registry.AUTO_ORDER
    assert registry.choose("shm", None) is registry.PROVIDERS["shm"]


def test_an_unknown_name_is_one_error_naming_the_known_ones() -> None:
    known = r"\['efa', 'shm', 'tcp', 'verbs'\] or 'auto'"
    with pytest.raises(BackendUnavailable, match=rf"unknown provider 'ib'; choose from {known}"):
        registry.lookup("ib")
    with pytest.raises(BackendUnavailable, match=rf"unknown provider 'ib'; choose from {known}"):
        TransferEngine("ib")
    assert not provider_available("ib")
    assert not provider_available("auto")  # a choice among providers, not one


def test_the_table_needs_no_native_library() -> None:
    code = (
        "import sys\nfrom backends.providers import registry\n"
        "assert registry.PROVIDERS['tcp'].hint == 'tcp;ofi_rxm'\n"
        "try:\n    registry.lookup('ib')\nexcept Exception as exc:\n    print(type(exc).__name__)\n"
        "print('backends.providers._native' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["BackendUnavailable", "False"]
