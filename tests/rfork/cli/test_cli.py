"""The `rfork` entry point as a user meets it: a real subprocess, its exit status and output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rfork import __version__


def rfork(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rfork", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_version_matches_package_metadata() -> None:
    out = rfork("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"rfork {__version__}"
    assert __version__ != "0.0.0+unknown", "the package must be installed (pip install -e .)"


@pytest.mark.parametrize(
    "path",
    [
        (),
        ("planner",),
        ("planner", "serve"),
        ("planner", "migrate"),
        ("seed",),
        ("load",),
        ("demo",),
        ("bench",),
        ("bench", "transport"),
        ("bench", "cold-start"),
        ("bench", "planner"),
        ("bench", "gpu"),
        ("bench", "moe"),
    ],
)
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    out = rfork(*path, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: rfork" in out.stdout


def test_unknown_command_is_a_one_line_error_with_nonzero_status() -> None:
    out = rfork("no-such-command")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
    assert "Traceback" not in out.stderr



def test_demo_allows_read_only_regions_on_unenforcing_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rfork demo` (and `bench`) talk only to processes they start, so they set the allowance."""
    import os

    from rfork.cli import main

    monkeypatch.delenv("RFORK_ALLOW_UNENFORCED_ACCESS", raising=False)
    assert main(["demo", "--size-gib", "0"]) == 1  # refused at once, before any process starts
    assert os.environ.get("RFORK_ALLOW_UNENFORCED_ACCESS") == "1"


def test_token_flags_are_gone_from_the_cli():
    from rfork.cli import main

    for cmd in (["load"], ["seed"]):  # argv is readable by every user of the host (ps, /proc)
        with pytest.raises(SystemExit) as exc:
            main([*cmd, "--token", "sekrit"])
        assert exc.value.code == 2


def test_help_lists_the_checkout_commands_without_importing_the_harness() -> None:
    probe = (
        "import contextlib, io, sys\n"
        "from rfork.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench'))\n"
        "print(all(w in out.getvalue() for w in ('demo', 'bench', 'simulate')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


@pytest.mark.parametrize(
    "argv", [["bench", "transport"], ["-v", "demo"], ["simulate", "scale-out", "--help"]]
)
def test_checkout_commands_from_a_wheel_say_where_they_run_in_one_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rfork.cli import checkout_commands, main

    monkeypatch.setattr(checkout_commands, "checkout_root", lambda: None)  # a wheel install: no bench/
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "runs from a source checkout" in err
    assert "scripts/dev.sh setup" in err
