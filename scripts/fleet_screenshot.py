"""Watch the planner's fleet page in headless Chromium and keep the screenshot with the deepest tree.

For the docs: run `rfork bench scale-out --planner-port 8471 --modes tree ...` and, beside it,
`python scripts/fleet_screenshot.py --url http://127.0.0.1:8471/ui --out docs/fleet-page.png`.
The page is polled every `--every` seconds for `--seconds`; a shot is kept when its tree is deeper
(more levels from a root seed), or as deep with more pulls in progress, than the one kept so far.
Needs chromium, chromedriver (scripts/dev.sh) and selenium (the dev extras).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

DEPTH_JS = """
const paths = [...document.querySelectorAll('#tree path.edge')];
const parent = new Map(paths.map((p) => [p.dataset.loader, p.dataset.seed]));
let depth = 0;
for (const start of parent.keys()) {
  let d = 1, n = start;
  const seen = new Set();
  while (parent.has(n) && !seen.has(n)) { seen.add(n); n = parent.get(n); d += 1; }
  depth = Math.max(depth, d);
}
return [depth, paths.filter((p) => p.dataset.live === 'true').length];
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the fleet page, e.g. http://127.0.0.1:8471/ui")
    ap.add_argument("--token", default="any", help="a reader token (any string for a planner without auth)")
    ap.add_argument("--out", type=Path, required=True, help="where to write the PNG")
    ap.add_argument("--seconds", type=float, default=300.0, help="how long to watch (default 300)")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between looks (default 0.5)")
    ap.add_argument("--size", default="1400,1100", help="window size W,H (default 1400,1100)")
    args = ap.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        print("chromium and chromedriver are needed (scripts/dev.sh installs them)", file=sys.stderr)
        return 2
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={args.size}"):
        opts.add_argument(arg)
    driver: Any = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    best: tuple[int, int] = (0, 0)
    try:
        deadline = time.monotonic() + args.seconds
        logged_in = False
        while time.monotonic() < deadline:
            try:
                if not logged_in:
                    driver.get(args.url)
                    driver.find_element(By.ID, "token").send_keys(args.token)
                    driver.find_element(By.ID, "use").click()
                    logged_in = True
                depth, live = driver.execute_script(DEPTH_JS)
            except Exception as exc:  # noqa: BLE001 - the planner comes and goes between modes
                print(f"waiting for the page: {type(exc).__name__}", file=sys.stderr)
                logged_in = False
                time.sleep(1.0)
                continue
            if (depth, live) > best:
                args.out.write_bytes(driver.get_screenshot_as_png())
                best = (depth, live)
                print(f"kept: tree depth {depth}, {live} pulls in progress", flush=True)
            time.sleep(args.every)
    finally:
        driver.quit()
    return 0 if best[0] else 1


if __name__ == "__main__":
    sys.exit(main())
