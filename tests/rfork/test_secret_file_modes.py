"""A secret file (`RFORK_*_FILE`) that every user of the machine can read is said, for a token a
loader reads and for the planner's settings; a private one is read without a word."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from planner.settings import PlannerSettings
from rfork.env_secrets import env_secret


def _secret(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / f"token-{mode:o}"
    path.write_text("s3cret\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o604, True), (0o640, False), (0o600, False)])
def test_a_world_readable_token_file_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, warned: bool
) -> None:
    path = _secret(tmp_path, mode)
    with caplog.at_level(logging.WARNING):
        assert env_secret("RFORK_TOKEN", {"RFORK_TOKEN_FILE": str(path)}) == "s3cret"
    said = [r.getMessage() for r in caplog.records if "readable by every user" in r.getMessage()]
    assert bool(said) is warned
    if warned:
        assert str(path) in said[0]
        assert f"mode {mode:o}" in said[0]


def test_a_world_readable_token_file_flag_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from rfork.cli.tokens import read_token

    with caplog.at_level(logging.WARNING):
        assert read_token(_secret(tmp_path, 0o644), env=()) == "s3cret"
    assert "--token-file" in caplog.text
    assert "readable by every user" in caplog.text


def test_a_world_readable_planner_secret_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RFORK_ADMIN_TOKEN_FILE", str(_secret(tmp_path, 0o644)))
    monkeypatch.delenv("RFORK_ADMIN_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING):
        assert PlannerSettings().admin_token == "s3cret"
    assert "RFORK_ADMIN_TOKEN_FILE" in caplog.text
    assert "readable by every user" in caplog.text
