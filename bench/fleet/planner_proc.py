"""`rfork planner serve` on the planner host, with the planner's decisions logged (`planner.decisions`).

`python -m bench.fleet.planner_proc ARGS` = `rfork planner serve ARGS` with that logger at DEBUG: every
lease and every 429 (its position, the live leases and rate it was computed from) goes to the log,
with times, for the harness's timeline.
"""

from __future__ import annotations

import logging
import sys

import rfork.cli


def main() -> int:
    logging.getLogger("planner.decisions").setLevel(logging.DEBUG)
    return rfork.cli.main(["planner", "serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
