"""rfork.weights.adapters: a PEFT LoRA directory as verified tensors and back, and the names and
identities adapters get (a request's model name becomes a directory name: it must stay one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from rfork.weights.adapters import (
    CONFIG_TENSOR,
    AdapterError,
    adapter_identity,
    check_adapter_name,
    read_adapter,
    write_adapter,
)
from rfork.weights.rank_weights import RankWeights

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def _adapter(directory: Path, config: dict | None = None) -> Path:
    directory.mkdir(parents=True)
    save_file(
        {"base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 16).to(torch.bfloat16)},
        str(directory / "adapter_model.safetensors"),
    )
    (directory / "adapter_config.json").write_text(json.dumps(config or CONFIG))
    return directory


def test_an_adapter_round_trips_through_flat_weights_with_its_config(tmp_path):
    src = _adapter(tmp_path / "a")
    tensors = read_adapter(src)
    assert tensors[CONFIG_TENSOR].dtype == torch.uint8
    served = RankWeights.from_state_dict(tensors)  # what a seed of it serves: one flat region
    out = write_adapter(served.tensors, tmp_path / "b")
    assert (out / "adapter_config.json").read_bytes() == (src / "adapter_config.json").read_bytes()
    again = read_adapter(out)
    assert again.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(again[name], t), name


def test_a_config_that_is_not_lora_or_missing_files_are_refused(tmp_path):
    with pytest.raises(AdapterError, match="peft_type"):
        read_adapter(_adapter(tmp_path / "p", {"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(AdapterError, match="adapter_config.json and adapter_model.safetensors"):
        read_adapter(tmp_path)
    bad = {"x": torch.frombuffer(bytearray(b"not json"), dtype=torch.uint8)}
    with pytest.raises(AdapterError, match="lack "):
        write_adapter(bad, tmp_path / "w")
    with pytest.raises(AdapterError, match="not JSON"):
        write_adapter({CONFIG_TENSOR: bad["x"]}, tmp_path / "w")


def test_the_identity_binds_the_adapter_to_its_base():
    one = adapter_identity(base="llama-8b", name="support-bot")
    assert one == adapter_identity(base="llama-8b", name="support-bot")
    assert one != adapter_identity(base="llama-70b", name="support-bot")
    assert one != adapter_identity(base="llama-8b", name="support-bot", revision="v2")
    assert one.framework == "peft-lora"


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "../x", "a\\b", ".hidden", "a..b", "x" * 129, "a b"])
def test_names_that_are_not_one_safe_directory_name_are_refused(name):
    with pytest.raises(AdapterError):
        check_adapter_name(name)


@given(st.text(max_size=140))
def test_an_accepted_name_is_one_directory_inside_the_storage(name):
    try:
        check_adapter_name(name)
    except AdapterError:
        return
    root = Path("/storage")
    assert (root / name).parent == root
    assert (root / name).resolve().parent == root.resolve()
