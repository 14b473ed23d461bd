"""The fleet page in a real browser (headless Chromium driven by Selenium) over a real fleet: a
planner, a seed process and two loader processes, the second chained from the first, so the
fan-out tree has three levels. The page must draw what the planner's API says, never run a name it
did not write, and show nothing without a token. A screenshot is kept as a test artifact
($RFORK_TEST_ARTIFACTS, else the test's tmp_path)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.processes import load_args
from planner.contract import PlannerClient
from tests.conftest import IN_CI
from tests.rfork.conftest import ADMIN, LOAD, READER, REGISTER, identity_of, start_seed
from tests.waiting import holds_for, wait_until

pytestmark = pytest.mark.slow

HOSTILE = "<img src=x onerror=alert(1)>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium through the system chromedriver (scripts/dev.sh installs both)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extras")
    if CHROMIUM is None or DRIVER is None:
        why = "chromium and chromedriver are not installed (scripts/dev.sh installs them on Debian)"
        if IN_CI:
            pytest.fail(f"the browser test must run in CI: {why}")
        pytest.skip(why)
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1500,1700")
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    return wait_until(check, timeout_s, what, every_s=0.2)


def _page_state(driver: Any) -> dict[str, Any]:
    """What the page shows, read from its DOM."""
    return driver.execute_script(
        """
        const q = (s) => [...document.querySelectorAll(s)];
        return {
          visible: !document.getElementById('fleet').hidden,
          edges: q('#tree path.edge').map((p) => [p.dataset.seed, p.dataset.loader, p.dataset.live]),
          nodes: q('#tree g.node').map((g) => g.dataset.node),
          states: Object.fromEntries(
            q('#instances tbody tr').map((r) => [r.dataset.instance, r.dataset.state])),
          transfers: q('#transfers tbody tr').map((r) => [r.dataset.transfer, r.dataset.outcome]),
          models: q('#identities td.model').map((td) => td.textContent),
          labels: q('#tree text.edge-label').map((t) => t.textContent),
          imgs: document.getElementsByTagName('img').length,
          text: document.body.innerText,
        };
        """
    )


def test_fleet_page_in_chromium(browser, fleet, small_ckpt, planner, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    # a registered instance with a hostile model name (READY, so it is listed as any seed is)
    reg = PlannerClient(planner, token=REGISTER).register_instance(
        identity={**identity_of(small_ckpt).model_dump(), "model": HOSTILE}, labels={"node": HOSTILE}
    )
    PlannerClient(planner, token=reg.token).set_status(reg.id, "READY")

    # seed -> loader 1 -> loader 2 (loader 2 may not use the first seed, so it chains)
    (seed_id,), _ = start_seed(fleet, small_ckpt, planner)
    first_json, second_json = fleet.workdir / "l1.json", fleet.workdir / "l2.json"
    l1 = fleet.spawn(
        "loader1", load_args(first_json, planner_url=planner, checkpoint=small_ckpt, then="serve")
    )
    first = fleet.wait_file(l1, first_json, timeout_s=90)
    l2 = fleet.spawn(
        "loader2",
        load_args(second_json, planner_url=planner, checkpoint=small_ckpt, then="serve", exclude=[seed_id]),
    )
    second = fleet.wait_file(l2, second_json, timeout_s=90)
    assert first["source"] == second["source"] == "rfork-tcp"

    # a pull in progress: a lease held by the load token, halfway through by its own report
    loader = PlannerClient(planner, token=LOAD)
    live = loader.request_assignment(identity=identity_of(small_ckpt), rank=0, exclude=[seed_id])
    assert live is not None
    total = live.candidates[0].rank_manifest().region_bytes
    loader.report_progress(live.id, bytes_done=total // 2, bytes_total=total)

    api = PlannerClient(planner, token=READER).fleet()
    ids = {i.id for i in api.instances}
    l1_id, l2_id = (e.loader_id for e in sorted(api.edges, key=lambda e: e.started_at) if not e.live)
    assert {l1_id, l2_id} <= ids
    chain = {(e.seed_id, e.loader_id) for e in api.edges if not e.live}
    assert chain == {(seed_id, l1_id), (l1_id, l2_id)}  # three levels

    # unauthenticated: the page shows nothing, and the API refuses
    browser.get(planner + "/ui")
    _wait("the page's script", lambda: "Paste a reader token" in browser.find_element(By.ID, "status").text)
    state = _page_state(browser)
    assert not state["visible"]
    assert state["edges"] == []
    assert state["states"] == {}
    assert seed_id[:8] not in state["text"]

    # the reader token, pasted once
    browser.find_element(By.ID, "token").send_keys(READER)
    browser.find_element(By.ID, "use").click()
    state = _wait(
        "the live tree", lambda: (s := _page_state(browser))["visible"] and len(s["edges"]) >= 3 and s
    )
    assert browser.find_element(By.ID, "token").get_attribute("value") == ""  # not left in the form
    assert browser.execute_script("return sessionStorage.getItem('rfork.fleet.token')") == READER
    assert browser.execute_script("return localStorage.length") == 0

    # the tree, states and transfers are the API's
    drawn = {(s, ld) for s, ld, lv in state["edges"] if lv == "false"}
    assert drawn == chain
    (live_edge,) = [e for e in state["edges"] if e[2] == "true"]
    assert live_edge[0] == live.candidates[0].instance_id
    assert any(f"/ {_gb(total)}" in label for label in state["labels"]), state["labels"]
    assert any("GB/s · tcp" in label for label in state["labels"]), state["labels"]
    assert state["states"] == {i.id: i.status.value for i in api.instances}
    assert {t for t, _ in state["transfers"]} == {t.assignment_id for t in api.transfers}
    assert {o for _, o in state["transfers"]} == {"success"}
    assert set(state["nodes"]) >= {seed_id, l1_id, l2_id}
    # each identity says which digest its anchor is made with, and whether it resists a crafted input
    (anchor,) = {a.checksum_algorithm for d in api.identities for a in d.anchors}
    shown = f"rank 0 {anchor} ({'' if anchor == 'blake3' else 'not '}cryptographic)"
    assert shown in state["text"], state["text"]

    # the hostile name is shown as text and never ran
    assert HOSTILE in state["models"]
    assert HOSTILE in state["text"]
    assert state["imgs"] == 0
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018 - raises when no alert is open

    artifacts = Path(os.environ.get("RFORK_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "fleet-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    # the token is kept for this tab only: a new tab asks again
    browser.switch_to.new_window("tab")
    browser.get(planner + "/ui")
    _wait("the new tab's page", lambda: "Paste a reader token" in browser.find_element(By.ID, "status").text)
    assert not _page_state(browser)["visible"]

    # a token the planner does not know shows nothing either
    browser.find_element(By.ID, "token").send_keys("not-a-token")
    browser.find_element(By.ID, "use").click()
    _wait("the refusal", lambda: "refused" in browser.find_element(By.ID, "status").text)
    assert not _page_state(browser)["visible"]
    # a negative window: two more polls without a token (about 1 s apart); the refusal stays until the
    # token changes
    holds_for(lambda: "refused" in browser.find_element(By.ID, "status").text, 2.5,
              "the refusal stays while the token is unchanged", every_s=0.25)
    loader.report_transfer(live.id, outcome="success", bytes=total, seconds=0.1)
    with PlannerClient(planner, token=ADMIN) as admin:
        admin.delete_instance(reg.id)


def _gb(n: int) -> str:
    """The page's own byte format (fleet.js fmtBytes) for the sizes of this test."""
    units = ["B", "KB", "MB", "GB", "TB"]
    v, i = float(n), 0
    while v >= 1000 and i < len(units) - 1:
        v, i = v / 1000, i + 1
    return (f"{v:.0f}" if i == 0 else f"{v:.2f}") + " " + units[i]


def test_an_insecure_planner_needs_no_token_and_its_docs_render_offline(browser, sqlite_url):
    """`planner serve --insecure`: the page shows the fleet without asking for a token (main: it asked),
    and /docs renders from the planner's own files on this machine, which reaches no CDN (main: blank)."""
    from selenium.webdriver.common.by import By

    from planner import PlannerServer
    from tests.planner.conftest import identity

    with PlannerServer(db_url=sqlite_url, port=0, insecure=True) as srv:
        reg = PlannerClient(srv.url).register_instance(identity=identity(), labels={"node": "n-open"})
        browser.get(srv.url + "/ui")
        state = _wait("the fleet without a token", lambda: (s := _page_state(browser))["visible"] and s)
        assert reg.id in state["states"]
        assert "without auth" in browser.find_element(By.ID, "status").text
        assert not browser.find_element(By.ID, "login").is_displayed()
        browser.get(srv.url + "/docs")
        title = _wait(
            "Swagger UI's title",
            lambda: browser.execute_script(
                "const t = document.querySelector('.swagger-ui .info .title'); return t && t.textContent"
            ),
        )
        assert "rfork planner" in title
        assert browser.find_elements(By.CSS_SELECTOR, ".opblock")  # the operations are listed
