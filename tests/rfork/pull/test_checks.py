"""The settings a load checks before it starts (rfork.pull.checks) and what it counts when it falls back."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rfork import ConfigurationError, Loader, LoadOptions, SeedRequired
from rfork.metrics import REGISTRY
from rfork.pull.checks import check_planner_url, check_provider_names
from rfork.pull.options import BusyWait


@given(st.text(max_size=80))
def test_any_planner_url_is_accepted_as_http_or_refused_naming_the_setting(text):
    try:
        url = check_planner_url(text)
    except ConfigurationError as exc:
        refused: ConfigurationError | None = exc
    else:
        refused = None
    if refused is not None:
        assert refused.setting == "planner_url"
        assert "http://HOST:PORT" in str(refused)
        return
    assert url is not None
    parts = urlsplit(url)
    assert parts.scheme in ("http", "https")
    assert parts.hostname
    assert not url.endswith("/")


@pytest.mark.parametrize(
    ("given_url", "expected"),
    [
        ("http://planner:8470/", "http://planner:8470"),
        ("https://planner.example", "https://planner.example"),
        ("http://[::1]:8470", "http://[::1]:8470"),
    ],
)
def test_good_planner_urls_pass(given_url, expected):
    assert check_planner_url(given_url) == expected


@pytest.mark.parametrize(
    "bad", ["127.0.0.1:8470", "planner:8470", "ftp://p", "http://p:99999", "http://:80", "http://p:0"]
)
def test_typos_in_planner_urls_are_configuration_errors(bad):
    with pytest.raises(ConfigurationError):
        check_planner_url(bad)


def test_provider_names_are_checked():
    assert check_provider_names(["tcp", "nccl", "auto"]) == ["tcp", "nccl", "auto"]
    with pytest.raises(ConfigurationError, match="unknown transport provider 'tpc'"):
        check_provider_names(["tpc"])


def test_a_loader_refuses_a_bad_url_or_provider_at_construction(small_ckpt):
    from rfork.weights.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(small_ckpt)
    with pytest.raises(ConfigurationError):
        Loader(identity=info.identity(), planner_url="127.0.0.1:1", checkpoint=info)
    with pytest.raises(ConfigurationError):
        Loader(
            identity=info.identity(),
            planner_url=None,
            checkpoint=info,
            options=LoadOptions(providers=["tpc"]),
        )


def _fallbacks(reason: str) -> float:
    return REGISTRY.get_sample_value("rfork_fallbacks_total", {"reason": reason}) or 0.0


def test_an_outage_is_counted_and_require_seed_refuses_it(small_ckpt):
    from rfork.weights.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(small_ckpt)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends
    before = _fallbacks("planner_unreachable")
    disk_before = (
        REGISTRY.get_sample_value("rfork_pulls_total", {"source": "disk", "outcome": "success"}) or 0
    )
    # a planner that stays down is given up on after planner_outage_s (30 s by default, to ride out a
    # restart; test_planner_session covers that wait): 1 s here, so the test measures no timeout
    brief = BusyWait(outage_retry_s=0.2, planner_outage_s=1.0)
    opts = LoadOptions(providers=["tcp"], become_seed=False, busy_wait=brief)
    result = Loader(identity=info.identity(), planner_url=url, checkpoint=info, options=opts).load()
    assert result.source == "disk"
    assert _fallbacks("planner_unreachable") == before + 1
    assert (
        REGISTRY.get_sample_value("rfork_pulls_total", {"source": "disk", "outcome": "success"})
        == disk_before + 1
    )
    strict = LoadOptions(providers=["tcp"], become_seed=False, require_seed=True, busy_wait=brief)
    with pytest.raises(SeedRequired, match="unreachable"):
        Loader(identity=info.identity(), planner_url=url, checkpoint=info, options=strict).load()
