"""A wrong setting stops the command at once with one line; an outage falls back with one WARNING.

Each test runs the real `rfork` command in a subprocess, as an operator would, against a real planner
(tests/rfork/conftest.py: auth on) or none. No seed is needed: these fail before any pull.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rfork.conftest import LOAD, READER, REGISTER

pytestmark = pytest.mark.slow  # a fresh interpreter per command (torch, the transport): seconds each

# spellings the releases before the one vocabulary accepted too (hidden aliases now), so that these
# tests show the behaviour they check on either side of the change, not an unknown flag
EXIT, INSECURE = ["--then", "exit"], ["--insecure-ok"]


def rfork(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`rfork ARGS` in a fresh interpreter; stdout and stderr apart."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for name, value in list(full.items()):
        if value == "":
            del full[name]  # env={"X": ""} unsets X
    return subprocess.run(
        [sys.executable, "-m", "rfork", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        check=False,
    )


def closed_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_error_line(err: str) -> str:
    """The stderr of a refused command: exactly one line, `rfork: error: ...`, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip() and " is now " not in ln]  # old spellings: warned
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("rfork: error: "), err
    return lines[0]


def test_a_planner_url_without_its_scheme_stops_at_once(small_ckpt: Path) -> None:
    # main: "loaded ... from disk", status 0
    out = rfork("load", "--checkpoint", str(small_ckpt), "--planner", "127.0.0.1:18470", *EXIT, *INSECURE)
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr)
    assert "http://" in line
    assert "--planner" in line
    assert "loaded" not in out.stdout


@pytest.mark.parametrize("provider", ["tpc", "verbs"])
def test_an_unknown_or_absent_provider_stops_at_once(provider: str, small_ckpt: Path) -> None:
    # main: "loaded ... from nccl" (or disk), status 0, no warning
    if provider == "verbs":
        from backends.providers.registry import provider_available

        if provider_available("verbs"):
            pytest.skip("this machine has verbs")
    url = f"http://127.0.0.1:{closed_port()}"
    out = rfork(
        "load",
        "--checkpoint",
        str(small_ckpt),
        "--planner",
        url,
        "--provider",
        provider,
        *EXIT,
        *INSECURE,
    )
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr)
    assert provider in line
    assert "--provider" in line


def test_an_unreachable_planner_falls_back_with_one_warning_and_require_seed_refuses(
    small_ckpt: Path,
) -> None:
    # main: the same WARNING twice; --require-seed did not exist
    url = f"http://127.0.0.1:{closed_port()}"
    args = [
        "load",
        "--checkpoint",
        str(small_ckpt),
        "--planner",
        url,
        *EXIT,
        *INSECURE,
        "--no-progress",
        "--planner-outage-s",
        "1",  # how long it keeps asking (default 30 s): the fallback itself is what is tested here
    ]
    t0 = time.monotonic()
    out = rfork(*args)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 25  # bounded by --planner-outage-s, not the default 30 s
    warnings = [ln for ln in out.stderr.splitlines() if " WARNING " in ln and " is now " not in ln]
    assert len(warnings) == 1, out.stderr
    assert "loading from disk" in warnings[0]
    assert "unreachable" in warnings[0]
    assert "from disk" in out.stdout
    refused = rfork(*args, "--require-seed")
    assert refused.returncode == 1, refused.stderr
    assert "rfork: error: " in refused.stderr
    assert "no seed served it" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert "loaded" not in refused.stdout


def test_a_negative_planner_outage_is_refused_before_anything_starts(small_ckpt: Path) -> None:
    out = rfork("load", "--checkpoint", str(small_ckpt), "--planner-outage-s", "-1", *EXIT, "--no-progress")
    assert out.returncode == 2, out.stderr
    assert "--planner-outage-s must be 0 or more seconds" in one_error_line(out.stderr)


def test_a_refused_token_stops_at_once(planner: str, small_ckpt: Path) -> None:
    # main: "401 unknown token", then "loaded ... from disk", status 0
    out = rfork(
        "load",
        "--checkpoint",
        str(small_ckpt),
        "--planner",
        planner,
        *EXIT,
        env={"RFORK_TOKEN": "wrong"},
    )
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr)
    assert "refused the token" in line
    assert "401" in line
    assert "RFORK_TOKEN" in line
    assert "loaded" not in out.stdout


def test_no_token_for_a_secured_planner_stops_at_once(planner: str, small_ckpt: Path) -> None:
    out = rfork("load", "--checkpoint", str(small_ckpt), "--planner", planner, *EXIT, env={"RFORK_TOKEN": ""})
    assert out.returncode == 2, out.stderr
    assert "no planner token" in one_error_line(out.stderr)


def test_the_token_comes_from_a_file_variable(planner: str, small_ckpt: Path, tmp_path: Path) -> None:
    token = tmp_path / "load-token"
    token.write_text(LOAD + "\n")
    out = rfork(
        "load",
        "--checkpoint",
        str(small_ckpt),
        "--planner",
        planner,
        "--no-serve",
        "--no-progress",
        env={"RFORK_TOKEN": "", "RFORK_TOKEN_FILE": str(token)},
    )
    assert out.returncode == 0, out.stderr
    # it asked the planner, which knew the token and said why nothing is served: no authority anchored it
    assert "is not anchored" in out.stderr, out.stderr


def test_json_logs_are_one_object_per_line_and_global_flags_go_anywhere(small_ckpt: Path) -> None:
    # main: `--log-format` did not exist and -v after the command was refused
    url = f"http://127.0.0.1:{closed_port()}"
    out = rfork(
        "load", "--checkpoint", str(small_ckpt), "--planner", url, "--no-serve", "--insecure",
        "--no-progress", "--log-format", "json", "-v", "--planner-outage-s", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    records = [json.loads(ln) for ln in out.stderr.splitlines()]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any(r["level"] == "DEBUG" for r in records)  # -v, after the command
    (warning,) = [r for r in records if r["level"] == "WARNING"]
    assert "unreachable" in warning["message"]
    (summary,) = [json.loads(ln) for ln in out.stdout.splitlines()]  # stdout's summary too
    assert summary["message"].startswith("loaded ")
    assert (summary["source"], summary["verified"]) == ("disk", False)


def test_a_wire_protocol_the_planner_does_not_speak_is_refused_cleanly(
    planner: str, small_ckpt: Path
) -> None:
    # a loader of a later protocol (faked): one line naming both versions, never a disk load
    code = (
        "import sys; import planner.contract.protocol as p; p.PROTOCOL_VERSION = 3\n"
        "from rfork.cli import main; sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["load", "--checkpoint", str(small_ckpt), "--planner", planner, "--no-serve", "--no-progress"]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr)
    assert "protocol 2" in line
    assert "speaks 3" in line
    assert "loaded" not in out.stdout


def test_fleet_shows_identities_instances_and_live_pulls(planner: str, small_ckpt: Path) -> None:
    # main: `rfork fleet` did not exist
    from planner.contract import PlannerClient
    from rfork.weights.checkpoint import read_checkpoint_info

    ident = read_checkpoint_info(small_ckpt).identity()
    with PlannerClient(planner, token=REGISTER) as reg_client:
        reg = reg_client.register_instance(
            identity=ident,
            labels={"node": "n1", "rack": "r1"},
            ranks=[{"rank": 0, "provider": "tcp", "address": b"x"}],
        )
        seed = reg_client.with_token(reg.token)
        seed.put_manifest(
            reg.id,
            0,
            {
                "rank": 0,
                "checksum_algorithm": "xxh3-128",
                "origin": "disk",
                "regions": [{"index": 0, "nbytes": 2, "descriptor": ""}],
                "tensors": [
                    {
                        "name": "w",
                        "dtype": "uint8",
                        "shape": [2],
                        "nbytes": 2,
                        "region": 0,
                        "offset": 0,
                        "checksum": "0",
                    }
                ],
            },
        )
        seed.set_status(reg.id, "READY")
    with PlannerClient(planner, token=LOAD) as loader:
        lease = loader.request_assignment(identity=ident, rank=0, labels={"node": "n2", "rack": "r1"})
        assert lease is not None
        loader.report_progress(lease.id, bytes_done=1, bytes_total=2)
        out = rfork("fleet", "--planner", planner, env={"RFORK_READER_TOKEN": READER, "RFORK_TOKEN": ""})
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert ident.model in text
        assert reg.id in text
        assert "READY" in text
        assert "n1" in text
        assert "live pulls (1)" in text
        assert "1 B / 2 B" in text
        assert "…" not in text  # not cut to 80 columns outside a terminal
        as_json = rfork("fleet", "--planner", planner, "--json", env={"RFORK_READER_TOKEN": READER})
        assert json.loads(as_json.stdout)["instances"][0]["id"] == reg.id
        loader.report_transfer(lease.id, outcome="success", bytes=2, seconds=0.1)
    refused = rfork("fleet", "--planner", planner, env={"RFORK_READER_TOKEN": "nope", "RFORK_TOKEN": ""})
    assert refused.returncode == 2
    assert "RFORK_READER_TOKEN" in one_error_line(refused.stderr)


def test_anchor_uploads_lists_and_revokes_from_a_checkpoint(planner: str, small_ckpt: Path) -> None:
    # main: one `rfork digest`, then a curl PUT per body; no list, no revoke
    from tests.rfork.conftest import ADMIN

    env = {"RFORK_ADMIN_TOKEN": ADMIN}
    up = rfork(
        "anchor", "upload", "--planner", planner, "--checkpoint", str(small_ckpt), "--no-progress", env=env
    )
    assert up.returncode == 0, up.stderr
    assert "anchored" in up.stdout
    assert "rank 0" in up.stdout
    listed = rfork("anchor", "list", "--planner", planner, "--checkpoint", str(small_ckpt), env=env)
    assert listed.returncode == 0, listed.stderr
    assert "rank 0 blake3" in listed.stdout  # the host default digest
    gone = rfork("anchor", "revoke", "--planner", planner, "--checkpoint", str(small_ckpt), env=env)
    assert gone.returncode == 0, gone.stderr
    after = rfork("anchor", "list", "--planner", planner, "--checkpoint", str(small_ckpt), env=env)
    assert "no anchors" in after.stdout
    not_admin = rfork("anchor", "list", "--planner", planner, env={"RFORK_ADMIN_TOKEN": READER})
    assert not_admin.returncode == 2
    assert "refused the token" in one_error_line(not_admin.stderr)


PLANNER_SECRETS = ("ADMIN", "REGISTER", "ANCHOR", "LOAD", "READER", "INSTANCE")


def test_every_wrong_setting_is_status_2_in_one_line(small_ckpt: Path, tmp_path: Path) -> None:
    """A token file that is missing or empty, both forms of a variable, a planner without tokens, a
    hook launch without its token: status 2 and one line naming what to fix (main: status 1)."""
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)  # (a file others can read adds a warning line of its own)
    missing = str(tmp_path / "missing")
    no_planner_tokens = {f"RFORK_{n}_TOKEN": "" for n in PLANNER_SECRETS}
    no_planner_tokens.update({f"RFORK_{n}_TOKEN_FILE": "" for n in PLANNER_SECRETS})
    db = ["--db", f"sqlite:///{tmp_path / 'planner.db'}", "--port", "0"]
    vllm = ["vllm", "--planner", "http://127.0.0.1:9", "--dry-run"]
    load = ["load", "--checkpoint", str(small_ckpt), "--planner", "http://127.0.0.1:9", "--no-serve"]
    cases: list[tuple[list[str], dict[str, str], str]] = [
        ([*load, "--token-file", missing], {}, "missing"),
        ([*load, "--token-file", str(empty)], {}, "is empty"),
        (load, {"RFORK_TOKEN": "x", "RFORK_TOKEN_FILE": str(empty)}, "both $RFORK_TOKEN and $RFORK_TOKEN_"),
        (load, {"RFORK_TOKEN": "", "RFORK_TOKEN_FILE": missing}, "$RFORK_TOKEN_FILE="),
        (["planner", "serve", *db], no_planner_tokens, "no token configured"),
        (["planner", "serve", *db], {**no_planner_tokens, "RFORK_ADMIN_TOKEN_FILE": missing}, "RFORK_ADMIN"),
        ([*vllm, "--token-file", missing, "--", "m"], {}, "missing"),
    ]
    for args, env, says in cases:
        out = rfork(*args, env={"RFORK_TOKEN": "", "RFORK_REGISTER_TOKEN": "", **env})
        assert out.returncode == 2, (args, env, out.stderr)
        assert says in one_error_line(out.stderr), (args, env, out.stderr)
