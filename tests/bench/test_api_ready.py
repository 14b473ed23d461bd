"""`rfork bench api-ready`: the breakdown read from a vLLM log, and the table (the runs need vLLM)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from bench import api_ready

LOG = """\
(Worker pid=2) INFO 11-24 01:05:04 [cpu_model_runner.py:68] Starting to load model /m...
INFO 11-24 01:05:07 [rfork.integrations.vllm.compile_cache] rfork: compile cache ab installed from x: \
51 new file(s), 3471360 bytes, 0.085 s
(Worker pid=2) INFO 11-24 01:05:07 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=2) WARNING 11-24 01:05:10 [decorators.py:333] Compiling model again due to a load failure
(Worker pid=2) INFO 11-24 01:05:19 [decorators.py:743] [backbone] saved AOT compiled function to /c/model
(Worker pid=2) INFO 11-24 01:05:19 [cpu_model_runner.py:91] Warming up done.
(EngineCore pid=1) INFO 11-24 01:05:20 [core.py:402] init engine (profile, create kv cache, warmup model) \
took 13.00 s
"""


def _server(tmp_path: Path) -> SimpleNamespace:
    log = tmp_path / "row.log"
    log.write_text(LOG)
    kernel = tmp_path / "cache" / "k.so"
    kernel.parent.mkdir()
    kernel.write_bytes(b"x")  # built "now": after started=0
    return SimpleNamespace(child=SimpleNamespace(log_path=log), started=0.0, cache_root=tmp_path / "cache")


def test_breakdown_from_the_log(tmp_path: Path) -> None:
    row = api_ready._figures(_server(tmp_path), 30.0, 31.5)  # type: ignore[arg-type]
    assert row["load_s"] == 3.0
    assert row["cache_fetch_s"] == 0.085
    assert row["engine_init_s"] == 13.0
    assert row["compile_s"] == 12.0  # log timestamps, 1 s resolution
    assert row["warmup_other_s"] == 1.0
    assert row["imports_setup_s"] == 30.0 - 3.0 - 13.0
    assert row["first_request_s"] == 1.5
    assert row["cache_installed"]
    assert row["vllm_compiled"]
    assert row["aot_load_failures"] == 1
    assert row["kernels_built"] == 1


def test_table_shows_rows_side_by_side_with_the_ratio(tmp_path: Path) -> None:
    row = api_ready._figures(_server(tmp_path), 30.0, 31.5)  # type: ignore[arg-type]
    cold = {**row, "api_ready_s": 63.0, "cache_installed": False}
    table = api_ready._table(
        {"size_mib": 64, "load_before": (1.0, 0, 0), "load_after": (2.0, 0, 0),
         "rows": {"cold": cold, "weights+caches": row}, "kernels": {}}
    )
    assert "2.00x" in table
    assert "installed" in table
    assert table.index("cold") < table.index("weights+caches")
