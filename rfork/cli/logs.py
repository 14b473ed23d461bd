"""Log output and progress bars of the command line, on one stderr console.

Log records and rich progress bars share one `rich.console.Console`: a record printed while a bar
is live goes above the bar instead of through it. `--log-format json` writes one JSON object per
record (time, level, logger, message, and the traceback when there is one) for a fleet's log
pipeline, and the commands' summary lines on stdout (`say`) as such objects too; progress bars are
drawn only where stderr is a terminal.

Imported by `rfork --help` (every command module is), so rich is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

FORMATS = ("text", "json")
_HANDLER_NAME = "rfork-cli"
_console: Any = None
_format = "text"  # of the summary lines on stdout (`say`); set by setup_logging


def console() -> Any:
    """The stderr console that log lines and progress bars share (created on first use)."""
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(stderr=True, highlight=False, soft_wrap=True)
    return _console


def _json_line(created: float, level: str, logger: str, message: str, **more: Any) -> str:
    """One JSON object: time (ISO 8601, UTC), level, logger, message, then `more`."""
    out: dict[str, Any] = {
        "time": dt.datetime.fromtimestamp(created, tz=dt.timezone.utc).isoformat(timespec="milliseconds"),
        "level": level,
        "logger": logger,
        "message": message,
        **more,
    }
    return json.dumps(out, ensure_ascii=False)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601, UTC), level, logger, message, exc (if any)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        more = {"exc": self.formatException(record.exc_info)} if record.exc_info else {}
        return _json_line(record.created, record.levelname, record.name, record.getMessage(), **more)


def say(message: str, **fields: Any) -> None:
    """A command's summary line on stdout (what it did, where it listens): the text, or with
    `--log-format json` one JSON object (level INFO, logger rfork.cli) carrying `fields` as well."""
    if _format == "json":
        message = _json_line(time.time(), "INFO", "rfork.cli", message, **fields)
    print(message, flush=True)


class ConsoleHandler(logging.Handler):
    """Writes formatted records through the shared console (above a live progress bar)."""

    def emit(self, record: logging.LogRecord) -> None:
        """Print one record."""
        try:
            line = self.format(record)
            con = console()
            if con.is_terminal:  # through rich: above a progress bar while one is drawn
                from rich.text import Text

                con.print(Text(line), soft_wrap=True)
            else:
                stream = sys.stderr
                stream.write(line + "\n")
                stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def setup_logging(*, verbose: int, quiet: bool, fmt: str) -> None:
    """rfork's and the planner's records at INFO (WARNING with `quiet`, DEBUG with -v; -vv: every
    library's DEBUG too), other libraries' at WARNING; in `fmt` (text or json). Idempotent."""
    global _format
    _format = fmt
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = ConsoleHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root.addHandler(handler)
    ours = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    root.setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)
    for name in ("rfork", "planner", "bench"):
        logging.getLogger(name).setLevel(min(ours, root.level))
    # the transport library speaks at -v (its INFO is for its own debugging: engine open, ...)
    logging.getLogger("backends").setLevel(logging.DEBUG if verbose else logging.WARNING)


def human_bytes(n: float) -> str:
    """`n` bytes in decimal units (1.23 GB), as the fleet page writes them."""
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    value, i = float(n), 0
    while value >= 1000 and i < len(units) - 1:
        value /= 1000
        i += 1
    return f"{value:.0f} {units[i]}" if i == 0 else f"{value:.2f} {units[i]}"


@contextlib.contextmanager
def progress_bar(
    description: str, *, total: float | None = None, enabled: bool = True, unit: str = "bytes"
) -> Iterator[Callable[..., None]]:
    """A transient rich bar on the shared console (only where stderr is a terminal); yields
    `update(done, total=None, description=None)`. `unit` "bytes" shows sizes and speed, "count" done
    of total, "none" only the bar (pulsing without a total) and the time elapsed."""
    con = console()
    if not enabled or not con.is_terminal:
        yield lambda *_a, **_k: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    columns: tuple[Any, ...] = {
        "bytes": (DownloadColumn(), TransferSpeedColumn()),
        "count": (MofNCompleteColumn(),),
    }.get(unit, ())
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        *columns,
        TimeElapsedColumn(),
        console=con,
        transient=True,
    )
    task = bar.add_task(description, total=total)

    def update(done: float, total: float | None = None, description: str | None = None) -> None:
        fields: dict[str, Any] = {"completed": done}
        if total is not None:
            fields["total"] = total
        if description is not None:
            fields["description"] = description
        bar.update(task, **fields)

    with bar:
        yield update
