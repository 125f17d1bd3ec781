"""Headless Chromium and its driver from Debian's packages, driven with selenium: apt-get installs them when
they are missing and this process is root (as CI runs `make test`); elsewhere the test is skipped, saying why."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

import pytest

PACKAGES = ["chromium", "chromium-driver", "fonts-liberation"]  # the font: readable text in screenshots


def _binaries() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def _apt_get_install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
        if r.returncode != 0:
            pytest.skip(f"headless Chromium: `{' '.join(command)}` failed: {(r.stdout + r.stderr)[-500:]}")


def chromium_paths() -> tuple[str, str]:
    """(chromium, chromedriver), installed first where missing and possible; else the test is skipped."""
    chromium, driver = _binaries()
    if not (chromium and driver) and os.geteuid() == 0 and shutil.which("apt-get"):
        _apt_get_install()
        chromium, driver = _binaries()
    if not (chromium and driver):
        pytest.skip("headless Chromium: Debian's `chromium` and `chromium-driver` are not installed, and this "
                    "process cannot apt-get them (it is not root, or has no apt-get)")
    return chromium, driver


@contextlib.contextmanager
def chrome(width: int = 1280, height: int = 1000):
    """A headless Chromium session that records every network request of its pages (the `performance` log)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the `dev` extra has it)")
    chromium, driver = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # with the driver's path given too, selenium downloads nothing
    for arg in ("--headless=new", "--no-sandbox",  # as root, Chromium starts only without its sandbox
                "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={width},{height}", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-default-apps",
                "--disable-sync"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # chromedriver makes the browser's profile in TMPDIR and leaves it there: give it a folder that goes.
    with tempfile.TemporaryDirectory(prefix="bertserve-chromium-") as tmp:
        service = webdriver.ChromeService(executable_path=driver, env={**os.environ, "TMPDIR": tmp})
        browser = webdriver.Chrome(options=options, service=service)
        try:
            yield browser
        finally:
            browser.quit()
