"""Planner settings: every secret may come from a file its RFORK_<NAME>_FILE variable names."""

from __future__ import annotations

import pytest

from planner import PlannerSettings
from planner.settings import SECRET_FIELDS, SettingsError


@pytest.mark.parametrize("field", SECRET_FIELDS)
def test_a_secret_comes_from_its_file_variable(field, tmp_path, monkeypatch):
    secret = tmp_path / field
    secret.write_text(f"  from-file-{field}\n")
    monkeypatch.delenv(f"RFORK_{field.upper()}", raising=False)
    monkeypatch.setenv(f"RFORK_{field.upper()}_FILE", str(secret))
    assert getattr(PlannerSettings(), field) == f"from-file-{field}"
    monkeypatch.setenv(f"RFORK_{field.upper()}", "from-variable")  # both forms: ambiguous, refused
    with pytest.raises(SettingsError, match=f"both \\$RFORK_{field.upper()} and"):
        PlannerSettings()


def test_an_unreadable_or_empty_secret_file_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("RFORK_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("RFORK_ADMIN_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(SettingsError, match="RFORK_ADMIN_TOKEN_FILE"):
        PlannerSettings()
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("RFORK_ADMIN_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(SettingsError, match="is empty"):
        PlannerSettings()
