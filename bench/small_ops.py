"""Small-op part of `rfork bench transport`: FastLane latency and batched page writes, with baselines.

- 64 B read latency through a FastLane (a one-op batch on the engine's op path) and through the
  future API, against the native round trip of `fi_pingpong` on the same provider, same run.
- Batches of 16 KiB page writes (scattered pages, one batch, one handle) against 1 MiB writes
  (the engine's large-op rate), same run, same peer.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

log = logging.getLogger(__name__)

KiB, MiB = 1 << 10, 1 << 20
PAGE = 16 * KiB
SPAN = 32 * MiB  # bytes per batch of pages, and per round of 1 MiB writes


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples) * 1e6, samples[max(0, int(len(samples) * 0.99) - 1)] * 1e6


def measure(eng: Any, reg: Any, src: Any, dst: Any, provider: str, *, seconds: float) -> dict[str, Any]:
    """Latency (us) and page-batch GB/s; eng/reg are the bench's engine and 64 MiB local region."""
    import numpy as np

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends.lane import FastLane
    from bench.native import native_round_trip_us

    out: dict[str, Any] = {}
    try:
        out["native_round_trip_us"] = round(native_round_trip_us(provider), 2)
    except RuntimeError as exc:
        log.warning("native baseline unavailable: %s", exc)
        out["native_round_trip_us"] = 0.0
    with FastLane(eng) as lane:
        lane.read(reg, 0, 64, src, 0).wait(10)  # warm-up
        lat = []
        for _ in range(3000):
            t0 = time.perf_counter()
            lane.read(reg, 0, 64, src, 0).wait(10)
            lat.append(time.perf_counter() - t0)
        out["lane_read_64_p50_us"], out["lane_read_64_p99_us"] = (round(x, 2) for x in _percentiles(lat))
        lat = []
        for _ in range(1000):
            t0 = time.perf_counter()
            eng.read(reg, 0, 64, src, 0).result(10)
            lat.append(time.perf_counter() - t0)
        out["future_read_64_p50_us"], out["future_read_64_p99_us"] = (round(x, 2) for x in _percentiles(lat))

        n = SPAN // PAGE
        rng = np.random.default_rng(1)
        spans = [
            (int(s) * PAGE, int(d) * PAGE, PAGE)
            for s, d in zip(rng.permutation(n), rng.permutation(n), strict=True)
        ]
        reps = max(2, int(seconds * 2e9 // SPAN))

        def pages_batch() -> None:
            lane.submit(lane.batch("pages").write_spans(reg, spans, dst)).wait(60)

        def big_writes() -> None:
            futs = [eng.write(reg, o, MiB, dst, o) for o in range(0, SPAN, MiB)]
            for f in futs:
                f.result(60)

        def engine_pages() -> None:
            eng.write_spans(reg, spans, dst).result(60)

        rates = {}
        for name, fn in (("big", big_writes), ("lane_pages", pages_batch), ("engine_pages", engine_pages)):
            fn()  # warm-up
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            rates[name] = reps * SPAN / (time.perf_counter() - t0) / 1e9
    out["write_1mib_gb_per_s"] = round(rates["big"], 3)
    out["lane_pages_16k_gb_per_s"] = round(rates["lane_pages"], 3)
    out["engine_pages_16k_gb_per_s"] = round(rates["engine_pages"], 3)
    native = out["native_round_trip_us"]
    out["lane_latency_ratio"] = round(out["lane_read_64_p50_us"] / native, 2) if native else 0.0
    out["lane_pages_ratio"] = round(rates["lane_pages"] / rates["big"], 3) if rates["big"] else 0.0
    return out


def report_lines(res: dict[str, Any]) -> list[str]:
    """Human-readable lines for the bench's console output."""
    return [
        f"64 B read p50 / p99: lane {res['lane_read_64_p50_us']:.1f} / {res['lane_read_64_p99_us']:.1f} us, "
        f"future API {res['future_read_64_p50_us']:.1f} / {res['future_read_64_p99_us']:.1f} us; "
        f"native round trip (fi_pingpong, 2 x usec/xfer) {res['native_round_trip_us']:.1f} us; "
        f"lane / native = {res['lane_latency_ratio']:.2f}x",
        f"16 KiB page batches: lane {res['lane_pages_16k_gb_per_s']:.2f} GB/s, engine write_spans "
        f"{res['engine_pages_16k_gb_per_s']:.2f} GB/s; 1 MiB writes {res['write_1mib_gb_per_s']:.2f} GB/s; "
        f"lane / 1 MiB = {res['lane_pages_ratio']:.2f}x",
    ]
