#!/usr/bin/env python
"""Screenshot an HTML page (a ``sot trace`` page) with headless Chromium, offline.

    python scripts/screenshot.py trace.html docs/img/trace-humaneval.png [--width 1300]
"""
from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("page")
    ap.add_argument("out")
    ap.add_argument("--width", type=int, default=1300)
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    from PIL import Image
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync"])
        page = browser.new_page(viewport={"width": args.width, "height": 1000})
        page.goto(Path(args.page).resolve().as_uri())
        page.wait_for_timeout(1500)
        shot = page.screenshot(full_page=True)
        browser.close()
    # a palette PNG: a quarter of the bytes, no visible difference for charts
    Image.open(io.BytesIO(shot)).convert("RGB").quantize(colors=128).save(args.out, optimize=True)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
