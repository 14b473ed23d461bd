"""One instance on an emulated host: `python -m bench.fleet.instance [--fetch URL --into DIR] -- ARGS`.

It imports what `rfork load` / `rfork seed` import, writes `--ready-file` and waits for one byte on
stdin (the harness's start signal), so that Python start-up on shared cores is not counted as load
time; then it runs `rfork ARGS` in this process (the CLI's own code: `rfork.cli.main`).

With `--fetch`, it first downloads every file listed at URL/index.json (name, bytes, sha256) into
DIR over HTTP, checking each file's sha256: what a host does today when its weights come from
shared storage or a model hub (download to local disk, then load from there). The JSON events file
records the times of each step for the timeline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def fetch_checkpoint(url: str, into: Path, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Download URL/index.json's files into `into`, checking sizes and sha256; returns figures."""
    into.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with urllib.request.urlopen(f"{url}/index.json", timeout=30) as resp:  # noqa: S310 - the harness's storage host
        index = json.loads(resp.read())
    total = 0
    for item in index["files"]:
        name = str(item["name"])
        if "/" in name or name.startswith("."):
            raise ValueError(f"storage listed an unsafe file name {name!r}")
        digest = hashlib.sha256()
        got = 0
        with (
            urllib.request.urlopen(f"{url}/{name}", timeout=timeout_s) as resp,
            (into / name).open("wb") as out,
        ):  # noqa: S310
            while True:
                chunk = resp.read(1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
                out.write(chunk)
                got += len(chunk)
        if got != int(item["bytes"]) or digest.hexdigest() != item["sha256"]:
            raise ValueError(
                f"{name}: got {got} bytes, sha256 {digest.hexdigest()[:16]}; storage lists "
                f"{item['bytes']} bytes, {str(item['sha256'])[:16]}"
            )
        total += got
    return {"fetch_started": t0, "fetch_done": time.time(), "fetched_bytes": total, "fetch_verified": True}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.time()
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.fleet.instance")
    parser.add_argument("--events", type=Path, required=True, help="write the step times here (JSON)")
    parser.add_argument("--fetch", default=None, help="storage URL to download the checkpoint from first")
    parser.add_argument("--into", type=Path, default=None, help="local directory for --fetch")
    parser.add_argument("--no-wait", action="store_true", help="start at once (no start signal)")
    args = parser.parse_args(argv[:split])
    rfork_args = argv[split + 1 :]

    # what `rfork load` imports, before the start signal (interpreter and library start-up)
    import torch  # noqa: F401

    import planner.contract  # noqa: F401
    import rfork.cli
    import rfork.cli.load  # noqa: F401
    import rfork.loader  # noqa: F401

    events: dict[str, Any] = {"process_started": started, "imported": time.time()}
    args.events.write_text(json.dumps(events))
    if not args.no_wait:
        sys.stdin.buffer.read(1)  # the harness's start signal (EOF also starts: the harness is gone)
    events["go"] = time.time()
    args.events.write_text(json.dumps(events))
    if args.fetch:
        if args.into is None:
            raise SystemExit("--fetch needs --into")
        events.update(fetch_checkpoint(args.fetch, args.into))
        args.events.write_text(json.dumps(events))
    return rfork.cli.main(rfork_args)


if __name__ == "__main__":
    sys.exit(main())
