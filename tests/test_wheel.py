"""The wheel as a user gets it: built from a copy of the tracked sources, installed into a clean venv
outside the checkout and run from there. First without torch (a planner-only install: the planner
serves, `rfork load` names the extra), then with torch: a seed and a `rfork load` that pulls over tcp
and verifies every digest. Tokens reach every process as `*_FILE` files, as Kubernetes mounts them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rfork.errors import NEEDS_TORCH
from tests.planner.test_concurrency import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
TOKENS = ("admin", "register", "anchor", "load", "reader")
# run by the installed venv's python: what it imports, and from where
PROBE = """
import importlib.util, json
from pathlib import Path
import backends, planner, rfork
from backends.providers import _native
from planner.db import migrations_dir
print(json.dumps({
    "files": [backends.__file__, planner.__file__, rfork.__file__, str(migrations_dir()), _native.__file__],
    "torch": importlib.util.find_spec("torch") is not None,
    "migrations": importlib.util.find_spec("migrations") is not None,
    "digests": int(_native.lib.rf_hjob_supported()),
    "so": [str(p) for p in Path(_native.__file__).parent.glob("_libfabric*.so")],
}))
"""


def _torch_pin() -> str:
    """The torch that scripts/dev.sh installs (a CPU build lies in pip's find-links here)."""
    match = re.search(r"^TORCH_PIN=(\S+)", (ROOT / "scripts" / "dev.sh").read_text(), re.MULTILINE)
    assert match
    return match.group(1)


def _run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{output}"
    return proc.stdout


def _copy_sources(dest: Path) -> None:
    """The files git tracks or would (no build outputs, venvs or compiled binding: what a clone has)."""
    listing = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(listing, cwd=ROOT, capture_output=True, check=True, timeout=60).stdout.decode()
    for name in filter(None, files.split("\0")):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, target)


def _runpath(library: Path) -> str:
    out = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in out.splitlines() if "RPATH" in line or "RUNPATH" in line)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    def ready() -> bool:
        assert proc.poll() is None, f"exited: {log.read_text()[-3000:]}"
        try:
            return httpx.get(url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 120, lambda: f"/readyz answers 200: {log.read_text()[-3000:]}", every_s=0.2)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_wheel_installs_and_loads_outside_the_checkout(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the tracked files")
    work = tmp_path / "outside"  # pytest's tmp directory: not under the checkout
    work.mkdir()
    assert ROOT not in work.resolve().parents
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(FI_TCP_IFACE="lo", PYTHONDONTWRITEBYTECODE="1")

    # build from a copy of the sources: an isolated build, as `pip wheel` does for a user
    src = tmp_path / "src"
    _copy_sources(src)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
         cwd=work, env=env)
    (wheel,) = dist.glob("rfork-*.whl")
    assert wheel.name.endswith(f"-cp310-abi3-linux_{platform.machine()}.whl"), wheel.name

    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=work, env=env)
    py, rfork = str(venv / "bin" / "python"), str(venv / "bin" / "rfork")
    _run([py, "-m", "pip", "install", "-q", str(wheel)], cwd=work, env=env)

    # where everything comes from: the venv's site-packages only, no torch, the binding without RUNPATH
    (work / "probe.py").write_text(PROBE)
    where = json.loads(_run([py, "probe.py"], cwd=work, env=env))
    site = str(venv / "lib")
    assert all(f.startswith(site) for f in where["files"]), where["files"]
    assert where["files"][3].endswith("planner/migrations")
    assert not where["torch"]
    assert not where["migrations"], "the wheel installs no top-level `migrations` package"
    (binding,) = where["so"]
    assert binding.endswith(".abi3.so")
    assert _runpath(Path(binding)) == "", "the binding carries the build machine's library path"
    if subprocess.run(["pkg-config", "--exists", "libxxhash"]).returncode == 0:
        assert where["digests"] == 1, "built without xxHash although its headers are here"

    # the planner, from the planner-only install, with its tokens and database URL in files
    secrets = work / "secrets"
    secrets.mkdir(mode=0o700)
    for name in TOKENS:
        (secrets / name).write_text(f"{name}-{os.urandom(8).hex()}\n")
    (secrets / "db-url").write_text(f"sqlite:///{work / 'planner.db'}\n")
    for secret in secrets.iterdir():
        secret.chmod(0o600)  # as an operator mounts them: a world-readable one adds a warning line
    planner_env = {**env, "RFORK_DB_URL_FILE": str(secrets / "db-url")}
    planner_env.update({f"RFORK_{name.upper()}_TOKEN_FILE": str(secrets / name) for name in TOKENS})
    _run([rfork, "planner", "migrate"], cwd=work, env=planner_env, timeout=120)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = {name: work / f"{name}.log" for name in ("planner", "seed")}
    procs: list[subprocess.Popen] = []
    try:
        with logs["planner"].open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [rfork, "planner", "serve", "--no-migrate", "--port", str(port)],
                    cwd=work, env=planner_env, stdout=log, stderr=subprocess.STDOUT,
                )
            )
        _wait_ready(url, procs[0], logs["planner"])

        ckpt = work / "ckpt"
        from rfork.weights.synthetic import write_synthetic_checkpoint  # the checkout's: the format is shared

        write_synthetic_checkpoint(ckpt, size_bytes=16 << 20, model_name="wheel-llama")
        load = [rfork, "load", "--checkpoint", str(ckpt), "--planner", url, "--provider", "tcp",
                "--no-serve", "--no-progress", "--json", str(work / "load.json")]
        load_env = {**env, "RFORK_TOKEN_FILE": str(secrets / "load")}
        refused = subprocess.run(load, cwd=work, env=load_env, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1
        assert refused.stderr.strip() == f"rfork: error: {NEEDS_TORCH}"

        # with torch: a seed anchors the identity, then a load pulls it over tcp and verifies it
        _run([py, "-m", "pip", "install", "-q", _torch_pin()], cwd=work, env=env)
        ready = work / "seed-ready.json"
        with logs["seed"].open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [rfork, "seed", "--checkpoint", str(ckpt), "--planner", url, "--provider", "tcp",
                     "--ready-file", str(ready)],
                    cwd=work, env={**env, "RFORK_ANCHOR_TOKEN_FILE": str(secrets / "anchor")},
                    stdout=log, stderr=subprocess.STDOUT,
                )
            )

        def seed_ready() -> bool:
            assert procs[1].poll() is None, f"seed exited: {logs['seed'].read_text()[-3000:]}"
            return ready.exists()

        wait_until(seed_ready, 120, lambda: f"seed READY: {logs['seed'].read_text()[-3000:]}", every_s=0.2)
        out = _run(load, cwd=work, env=load_env, timeout=300)
        result = json.loads((work / "load.json").read_text())
        assert result["source"] == "rfork-tcp", out
        assert result["verified"] is True
        assert result["bytes"] >= 16 << 20
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.parametrize("skip", [None, "1"])
def test_without_libfabric_headers_the_build_fails_unless_told(skip: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RFORK_LIBFABRIC_PREFIX", "RFORK_SKIP_NATIVE")}
    env["PKG_CONFIG_LIBDIR"] = env["PKG_CONFIG_PATH"] = "/nonexistent"  # pkg-config finds no libfabric
    if skip:
        env["RFORK_SKIP_NATIVE"] = skip
    argv = [sys.executable, "setup.py", "--version"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if skip:
        assert proc.returncode == 0, proc.stderr
        assert "RFORK_SKIP_NATIVE set: building without the transport binding" in proc.stderr
    else:
        assert proc.returncode != 0
        assert "libfabric's headers were not found" in proc.stderr
        assert "RFORK_SKIP_NATIVE=1" in proc.stderr
