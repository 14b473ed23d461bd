"""Tokens from `$NAME` or the file `$NAME_FILE` names, for the CLI and the framework hooks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rfork.cli.tokens import read_token
from rfork.env_secrets import SecretFileError, env_secret
from rfork.integrations.hook.settings import HookSettings


def test_the_variable_or_its_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("tok\n")
    assert env_secret("RFORK_TOKEN", {}) is None
    assert env_secret("RFORK_TOKEN", {"RFORK_TOKEN": "plain"}) == "plain"
    assert env_secret("RFORK_TOKEN", {"RFORK_TOKEN_FILE": str(path)}) == "tok"
    with pytest.raises(SecretFileError, match="both"):
        env_secret("RFORK_TOKEN", {"RFORK_TOKEN": "plain", "RFORK_TOKEN_FILE": str(path)})
    with pytest.raises(SecretFileError, match="No such file"):
        env_secret("RFORK_TOKEN", {"RFORK_TOKEN_FILE": str(tmp_path / "missing")})
    path.write_text(" \n")
    with pytest.raises(SecretFileError, match="is empty"):
        env_secret("RFORK_TOKEN", {"RFORK_TOKEN_FILE": str(path)})


def test_hook_and_cli_read_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "load"
    path.write_text("load-token")
    assert HookSettings.resolve({}, {"RFORK_TOKEN_FILE": str(path)}).token == "load-token"
    monkeypatch.delenv("RFORK_ANCHOR_TOKEN", raising=False)
    monkeypatch.delenv("RFORK_REGISTER_TOKEN", raising=False)
    monkeypatch.setenv("RFORK_REGISTER_TOKEN_FILE", str(path))
    assert read_token(None, env=("RFORK_ANCHOR_TOKEN", "RFORK_REGISTER_TOKEN")) == "load-token"
