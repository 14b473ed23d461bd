"""Apply the planner's database migrations (Alembic) up to the newest."""

from __future__ import annotations

import argparse

from rfork.cli.logs import say


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: --db, --revision."""
    parser.add_argument(
        "--db", default=None, help="SQLAlchemy URL (default: RFORK_DB_URL or sqlite:///rfork-planner.db)"
    )
    parser.add_argument("--revision", default="head", help="target revision (default: head)")


def run(args: argparse.Namespace) -> int:
    """Migrate and say where to."""
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from planner import PlannerSettings, migrate

    url = args.db or PlannerSettings().db_url
    migrate(url, args.revision)
    say(f"planner database migrated to {args.revision}: {url.split('@')[-1]}")
    return 0
