"""Serve the planner REST API (migrates the database first, unless --no-migrate)."""

from __future__ import annotations

import argparse

from rfork.errors import ConfigurationError

DESCRIPTION = """Serve the planner REST API (migrates the database first), printing its address once bound.

Settings also come from the environment (docs/operations.md): $RFORK_DB_URL, the tokens
$RFORK_ADMIN_TOKEN, $RFORK_REGISTER_TOKEN, $RFORK_ANCHOR_TOKEN, $RFORK_LOAD_TOKEN, $RFORK_READER_TOKEN,
$RFORK_INSTANCE_TOKEN (load + register in one token: what an SGLang/vLLM server started with
`rfork sglang|vllm` needs, unless it is given a load and a register token) (each also as a file:
$RFORK_ADMIN_TOKEN_FILE, ...), $RFORK_CONTROL_SECRET(_FILE),
$RFORK_SELECTION_POLICY, $RFORK_RACK_HOLD, $RFORK_HEARTBEAT_TTL_S, $RFORK_LEASE_TTL_S,
$RFORK_MAX_CANDIDATES and the rest of planner/settings.py (RFORK_<FIELD>)."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: --db, --host, --port, --insecure, --no-migrate, --policy, --workers."""
    # imported here: `rfork --help` builds every parser (start-up time); planner.selection costs the
    # standard library only, and its registry is the one list of policy names
    from planner.selection import POLICY_NAMES

    parser.add_argument(
        "--db", default=None, help="SQLAlchemy URL (default: RFORK_DB_URL or sqlite:///rfork-planner.db)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8470, help="port (default 8470; 0 picks a free one, printed once bound)"
    )
    parser.add_argument(
        "--insecure", action="store_true", help="run without bearer-token auth (logs a warning)"
    )
    parser.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not migrate at start, only check the schema is current; for fleets where a Job or an init "
        "container runs `rfork planner migrate` (default: RFORK_NO_MIGRATE)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=None,
        help="source selection policy (default: RFORK_SELECTION_POLICY or load_aware)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port (default 1; assignment stays atomic across them)",
    )


def run(args: argparse.Namespace) -> int:
    """Migrate (or check the schema, --no-migrate), bind, print the real address, then serve until
    interrupted."""
    import logging
    import os
    import tempfile

    import pydantic
    import sqlalchemy.exc

    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from planner import PlannerSettings, SettingsError, check_schema, migrate
    from planner.app import InsecureRefused, create_app
    from rfork.cli.logs import say
    from rfork.cli.serving import address, bind, database_problem, serve

    overrides: dict[str, object] = {}
    if args.db:
        overrides["db_url"] = args.db
    if args.insecure:
        overrides["insecure"] = True
    if args.policy:
        overrides["selection_policy"] = args.policy
    if args.no_migrate:
        overrides["no_migrate"] = True
    try:
        settings = PlannerSettings(**overrides)  # type: ignore[arg-type]
        app = create_app(settings)  # refuses early when no token is configured and not --insecure
    except (SettingsError, InsecureRefused, pydantic.ValidationError) as exc:
        raise ConfigurationError(" ".join(str(exc).split()), setting="planner_settings") from exc
    try:
        sock = bind(args.host, args.port)  # a taken port is said before a migration runs
        if settings.no_migrate:
            check_schema(settings.db_url)
        else:
            migrate(settings.db_url)  # under a lock: any number of planners may start at once
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise database_problem(exc, settings.db_url) from exc
    logging.getLogger("planner").setLevel(logging.INFO)
    url = address(sock)
    db = settings.db_url.split("@")[-1]
    say(f"planner listening on {url} (db {db}, policy {settings.selection_policy})", url=url)
    who = "no token needed: --insecure" if settings.insecure else "paste a token with the reader role"
    say(f"fleet page: {url}/ui ({who}); API docs: {url}/docs")
    with tempfile.TemporaryDirectory(prefix="rfork-planner-") as private:  # mode 0700
        if args.workers > 1:  # each worker builds its app from the environment (RFORK_*), as `serve` does
            if args.db:  # the URL carries the database password: a private file, never the environment
                path = os.path.join(private, "db-url")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(settings.db_url)
                os.environ.pop("RFORK_DB_URL", None)
                os.environ["RFORK_DB_URL_FILE"] = path
            # else the workers read $RFORK_DB_URL or $RFORK_DB_URL_FILE as this process did
            os.environ["RFORK_SELECTION_POLICY"] = settings.selection_policy
            if settings.insecure:
                os.environ["RFORK_INSECURE"] = "1"
        stopped_by = serve(app, sock=sock, workers=args.workers)
    if stopped_by is not None:
        say(f"planner stopped by {stopped_by}: the requests in flight were answered", signal=stopped_by)
    return 0
