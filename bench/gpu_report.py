"""`rfork bench gpu`'s figures: derived columns, the goals, the table and the JSON (no GPU needed).

A row is a dict with at least ``source`` and ``seconds`` (for ``bytes``, default the run's size) and
optionally ``kind`` ("baseline", "disk", "rfork", "digest"), ``page_cache``, ``verified``, ``note``.
``finish`` adds ``gb_per_s`` (10^9 bytes per second), ``x_of_d2d``, ``x_of_pinned_h2d`` and
``speedup_vs_disk_cold``; ``goals`` judges them against the targets below. Kept apart from the
measuring code so that it is tested on CPU with made-up timings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

D2D = "d2d copy (baseline)"
PINNED_H2D = "pinned h2d copy (baseline)"
DISK_COLD = "disk->gpu safetensors, cache dropped"
DISK_WARM = "disk->gpu safetensors, warm"
DEVICE_DIGEST = "device digest"
# targets: CUDA IPC within 2x of a d2d copy, shm staging at 0.7x pinned h2d or better, every R-Fork row
# more than 10x faster than disk->gpu with the cache dropped, the device digest at 100 GB/s or more
IPC_MAX_X_D2D_TIME = 2.0
SHM_MIN_X_H2D = 0.7
RFORK_MIN_SPEEDUP_VS_COLD = 10.0
DIGEST_MIN_GBPS = 100.0


def _by_source(rows: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {str(r["source"]): r for r in rows}


def finish(rows: list[dict[str, Any]], nbytes: int) -> list[dict[str, Any]]:
    """Fill the derived columns in place (None where the baseline is missing); returns rows."""
    base = _by_source(rows)

    def gbps(r: Mapping[str, Any] | None) -> float | None:
        if r is None or not r.get("seconds"):
            return None
        return float(r.get("bytes", nbytes)) / float(r["seconds"]) / 1e9

    d2d, h2d, cold = gbps(base.get(D2D)), gbps(base.get(PINNED_H2D)), base.get(DISK_COLD)
    for r in rows:
        r.setdefault("bytes", nbytes)
        g = gbps(r)
        r["gb_per_s"] = g
        r["x_of_d2d"] = g / d2d if g and d2d else None
        r["x_of_pinned_h2d"] = g / h2d if g and h2d else None
        same_size = cold is not None and cold.get("bytes", nbytes) == r["bytes"]
        r["speedup_vs_disk_cold"] = (
            float(cold["seconds"]) / float(r["seconds"]) if same_size and r.get("seconds") and cold else None
        )
    return rows


def goals(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each goal with the figure it was judged on and met (True/False, None where not measured)."""
    base = _by_source(rows)
    out: list[dict[str, Any]] = []
    d2d = base.get(D2D)
    for r in rows:
        if str(r["source"]).startswith("rfork cuda-ipc"):
            ratio = float(r["seconds"]) / float(d2d["seconds"]) if d2d and r.get("seconds") else None
            met = None if ratio is None else ratio <= IPC_MAX_X_D2D_TIME and bool(r.get("verified"))
            out.append({"goal": f"{r['source']} <= {IPC_MAX_X_D2D_TIME:g}x the time of a d2d copy",
                        "figure": ratio, "unit": "x d2d time", "met": met})
    shm = base.get("rfork shm+staging")
    x = None if shm is None else shm.get("x_of_pinned_h2d")
    met = None if x is None or shm is None else x >= SHM_MIN_X_H2D and bool(shm.get("verified"))
    out.append({"goal": f"rfork shm+staging >= {SHM_MIN_X_H2D:g}x pinned h2d", "figure": x, "unit": "x h2d",
                "met": met})
    rfork = [r for r in rows if r.get("kind") == "rfork"]
    speedups = [r.get("speedup_vs_disk_cold") for r in rfork]
    worst = min((s for s in speedups if s is not None), default=None)
    out.append({"goal": f"every R-Fork row > {RFORK_MIN_SPEEDUP_VS_COLD:g}x faster than cold disk->gpu",
                "figure": worst, "unit": "x (slowest row)",
                "met": None if worst is None or None in speedups
                else worst > RFORK_MIN_SPEEDUP_VS_COLD})
    digest = base.get(DEVICE_DIGEST)
    g = None if digest is None else digest.get("gb_per_s")
    met = None if g is None or digest is None else g >= DIGEST_MIN_GBPS and bool(digest.get("verified"))
    out.append({"goal": f"device digest >= {DIGEST_MIN_GBPS:g} GB/s", "figure": g, "unit": "GB/s",
                "met": met})
    return out


def _fmt(v: Any, spec: str) -> str:
    return "" if v is None else format(v, spec)


def print_tables(rows: Sequence[Mapping[str, Any]], judged: Sequence[Mapping[str, Any]], title: str) -> None:
    """The rows and the goals as two rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("source", "page cache", "GiB", "seconds", "GB/s", "x of d2d", "x of pinned h2d",
                "speed-up vs cold disk", "verified"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["source"]), str(r.get("page_cache", "")), f"{int(r['bytes']) / (1 << 30):.2f}",
            _fmt(r.get("seconds"), ".4f"), _fmt(r.get("gb_per_s"), ".2f"), _fmt(r.get("x_of_d2d"), ".2f"),
            _fmt(r.get("x_of_pinned_h2d"), ".2f"), _fmt(r.get("speedup_vs_disk_cold"), ".1f"),
            str(r.get("verified", "")),
        )
    console = Console(width=200)
    console.print(table)
    gt = Table(title="goals")
    for col in ("goal", "figure", "met"):
        gt.add_column(col)
    for g in judged:
        fig = "not measured" if g["figure"] is None else f"{g['figure']:.2f} {g['unit']}"
        gt.add_row(str(g["goal"]), fig, {True: "met", False: "NOT met", None: "-"}[g["met"]])
    console.print(gt)


def write_json(path: str | Path, machine: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
               judged: Sequence[Mapping[str, Any]], errors: Sequence[str]) -> None:
    """{"machine", "rows", "goals", "errors"}; strict JSON (no NaN)."""
    doc = {"machine": dict(machine), "rows": list(rows), "goals": list(judged), "errors": list(errors)}
    Path(path).write_text(json.dumps(doc, indent=1, allow_nan=False, default=str))
