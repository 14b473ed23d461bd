"""The model as the hooks see it on this host (rfork.integrations.hook.local_model), for both frameworks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rfork.integrations.hook.local_model import identity_model_and_revision, local_checkpoint
from rfork.integrations.hook.settings import HookSettings
from rfork.weights.synthetic import write_synthetic_checkpoint


def test_local_checkpoint_reads_safetensors_and_is_none_for_anything_else(tmp_path: Path):
    model = write_synthetic_checkpoint(tmp_path / "m", size_bytes=256 << 10)
    info = local_checkpoint(str(model))
    assert info is not None
    assert info.tensors
    assert local_checkpoint(str(tmp_path / "missing")) is None  # a hub name, not a directory
    (tmp_path / "empty").mkdir()
    assert local_checkpoint(str(tmp_path / "empty")) is None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)  # a header length past the file's end
    assert local_checkpoint(str(bad)) is None
    (bad / "pytorch_model.bin").write_bytes(b"not safetensors")
    assert local_checkpoint(str(bad)) is None


def test_the_identity_name_and_revision_prefer_the_settings_then_the_model_config():
    hf = SimpleNamespace(_name_or_path="/models/org/Llama-3-8B")
    config = SimpleNamespace(hf_config=hf, revision=None)
    assert identity_model_and_revision(HookSettings(), config, "/x/y") == ("Llama-3-8B", "main")
    named = HookSettings(model="llama3", revision="r1")
    assert identity_model_and_revision(named, config, "/x/y") == ("llama3", "r1")
    pinned = SimpleNamespace(hf_config=None, revision="abc123")
    assert identity_model_and_revision(named, pinned, "/x/y") == ("llama3", "abc123")
    assert identity_model_and_revision(HookSettings(), pinned, "/srv/tiny/") == ("tiny", "abc123")
