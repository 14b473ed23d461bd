"""What a fleet run means: the ideal times from the same rates, the table, and the timeline plot."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

# timeline colours by where an instance's weights came from
COLOURS = {
    "first seed": "#1f77b4",
    "loaded instance": "#2ca02c",
    "storage": "#7f7f7f",
    "failed": "#d62728",
}


def transfer_s(model_bytes: int, mbit: float) -> float:
    """One model over one link of `mbit` Mbit/s."""
    return model_bytes / (mbit * 1e6 / 8)


def ideal_tree_s(n: int, model_bytes: int, nic_mbit: float) -> float:
    """Every holder serves one newcomer per transfer time: ceil(log2(n+1)) transfers."""
    return math.ceil(math.log2(n + 1)) * transfer_s(model_bytes, nic_mbit)


def ideal_rack_tree_s(
    loaders_per_rack: list[int], model_bytes: int, nic_mbit: float, uplink_mbit: float
) -> float:
    """Generations of a rack-aware tree from one seed in rack 0: each generation every holder serves one
    newcomer, at most floor(uplink / NIC) (at least 1) of them across each rack's uplink; greedy."""
    cross = max(1, int(uplink_mbit // nic_mbit)) if uplink_mbit > 0 else 10**6
    need = list(loaders_per_rack)
    holders = [1] + [0] * (len(need) - 1)  # the seed
    gens = 0
    while any(need):
        gens += 1
        if gens > 1000:
            raise ValueError("ideal_rack_tree_s: no progress")
        spare = list(holders)
        add = [0] * len(need)
        for r in range(len(need)):  # a rack without a copy gets its first ones across the spine
            if holders[r] == 0 and need[r]:
                for src in range(len(need)):
                    k = min(cross, spare[src], need[r] - add[r])
                    if k > 0 and holders[src] > 0:
                        spare[src] -= k
                        add[r] += k
                        break
        for r in range(len(need)):
            add[r] += min(spare[r] if holders[r] else 0, need[r] - add[r])
        for r in range(len(need)):
            need[r] -= add[r]
            holders[r] += add[r]
    return gens * transfer_s(model_bytes, nic_mbit)


def origin(row: dict[str, Any], seeds: set[str]) -> str:
    """Where an instance's weights came from, for the plot's colours."""
    if not row.get("ok"):
        return "failed"
    parent = row.get("parent")
    if parent == "storage" or row.get("source") == "disk":
        return "storage"
    return "first seed" if parent in seeds else "loaded instance"


def summarise(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run that its table row shows."""
    rows = doc["instances"]
    seeds = {f"h{i:02d}" for i in range(doc["config"]["seeds"])}
    parents = Counter(origin(r, seeds) for r in rows)
    overlap = _max_pulls_per_seed(rows)
    return {
        "mode": doc["mode"],
        "all_ready_s": doc["all_ready_s"],
        "verified": f"{sum(1 for r in rows if r['ok'] and r['verified'])}/{len(rows)}",
        "from": dict(parents),
        "max_pulls_per_seed": overlap,
        "asked_again": sum(r.get("asked_again", 0) for r in rows),
        "cpu_mean_busy": doc["cpu"]["mean_busy"],
        "cpu_saturated": doc["cpu"]["saturated"],
        "failed": doc["failed"],
    }


def _max_pulls_per_seed(rows: list[dict[str, Any]]) -> int:
    """Most pulls any seed served at once (each from its lease to the end of the loader's pull)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("ok") and r.get("pull_started") is not None and r.get("pull_s") is not None:
            start = r["pull_started"]
            spans.setdefault(str(r["parent"]), []).append((start, start + r["pull_s"]))
    best = 0
    for s in spans.values():
        points = sorted([(a, 1) for a, _ in s] + [(b, -1) for _, b in s])
        cur = 0
        for _, step in points:
            cur += step
            best = max(best, cur)
    return best


def plot_timeline(doc: dict[str, Any], path: Path, *, title: str) -> None:
    """One line per instance from process start to verified: dotted while importing (before the start
    signal at 0), thin while waiting for a source, thick while pulling, coloured by source."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError as exc:
        raise RuntimeError("the timeline needs matplotlib (pip install 'rfork[dev]')") from exc
    rows = sorted(doc["instances"], key=lambda r: (r.get("ready_s") is None, r.get("ready_s") or 0.0))
    seeds = {f"h{i:02d}" for i in range(doc["config"]["seeds"])}
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.6))
    for y, r in enumerate(rows):
        colour = COLOURS[origin(r, seeds)]
        start = r.get("process_started") or 0.0
        ax.plot([start, 0], [y, y], linestyle=":", color="#bbbbbb", linewidth=1)
        pull = r.get("pull_started")
        if pull is None and r.get("fetch_s") is not None:
            pull = 0.0
        end = r.get("ready_s")
        if end is None:
            ax.plot([0, doc["config"]["timeout_s"]], [y, y], color=colour, linewidth=1)
            continue
        if pull is None:
            pull = 0.0
        ax.plot([0, pull], [y, y], color=colour, linewidth=1, alpha=0.6)
        ax.plot([pull, end], [y, y], color=colour, linewidth=5, solid_capstyle="butt")
        label = f"{r['host']} ← {r.get('parent')}"
        ax.text(end + 0.3, y, label, va="center", fontsize=7)
    for f in doc.get("faults", []):
        ax.axvline(f["t"], color="#d62728", linestyle="--", linewidth=1)
        ax.text(f["t"], len(rows) - 0.3, f" {f['fault']}", color="#d62728", fontsize=7, va="top")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
    ax.set_xlabel("seconds after the start signal (dotted: process start-up before it)")
    ax.set_title(title, fontsize=9)
    handles = [Line2D([], [], color=c, linewidth=5, label=k) for k, c in COLOURS.items()]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
