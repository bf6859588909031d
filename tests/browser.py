"""A real browser for the UI tests: Debian's Chromium, headless, started per page.

:func:`open_page` loads a URL, lets its scripts run (a single-page app fetches its data after
the first paint) and returns the DOM as the browser built it, saving a screenshot beside it as
a test artifact (``$GRAPHTRIM_TEST_ARTIFACTS``, default ``.test-artifacts/browser`` in the
checkout). Assertions are made on the DOM, never on pixels.

The test command installs Chromium where it is missing and it can (``make test`` as root on
Debian); without a browser the tests that need one fail with the command to install it.
"""

from __future__ import annotations

import contextlib
import html.parser
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.tiers import require

ROOT = Path(__file__).resolve().parent.parent


def chromium() -> str:
    """The Chromium binary; a clear failure when there is none."""
    require("browser")
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise AssertionError(
            "these tests need a browser: apt-get install -y chromium (make test does it as root)"
        )
    return found


def artifacts() -> Path:
    out = Path(os.environ.get("GRAPHTRIM_TEST_ARTIFACTS") or ROOT / ".test-artifacts" / "browser")
    out.mkdir(parents=True, exist_ok=True)
    return out


# A page whose scripts keep the virtual clock from running out can hold Chromium well past its
# budget (seen once in CI on a loaded machine: --dump-dom never returned). --timeout stops the
# navigation after that much real time and dumps what there is; an attempt that still does not
# end is killed with its child processes and tried again.
_REAL_TIME_MS = 90_000
_ATTEMPT_S = 150
_ATTEMPTS = 3


def _run(args: list[str], budget_ms: int) -> subprocess.CompletedProcess[str]:
    failures: list[str] = []
    for _ in range(_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="graphtrim-chromium-") as profile:
            cmd = [
                chromium(),
                "--headless=new",
                "--no-sandbox",  # root in CI containers
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-extensions",
                "--disable-background-networking",
                f"--user-data-dir={profile}",
                f"--disk-cache-dir={profile}/cache",
                "--window-size=1400,1100",
                f"--virtual-time-budget={budget_ms}",
                f"--timeout={max(budget_ms, _REAL_TIME_MS)}",
                *args,
            ]
            env = {
                **os.environ,
                "HOME": profile,
                "XDG_CONFIG_HOME": profile,
                "XDG_CACHE_HOME": profile,
            }
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            try:
                out, err = proc.communicate(timeout=_ATTEMPT_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                out, err = proc.communicate()
                failures.append(f"no answer in {_ATTEMPT_S} s: {(err or '')[-500:]}")
                continue
            _kill_group(proc)  # a renderer or GPU process left behind by the browser
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    raise AssertionError(
        f"chromium did not finish {args[-1]} in {_ATTEMPTS} attempts: " + " | ".join(failures)
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def open_page(url: str, name: str, *, budget_ms: int = 20000) -> str:
    """The DOM of ``url`` once its scripts have had ``budget_ms`` of (virtual) time, and a
    screenshot ``<name>.png`` among the test artifacts."""
    shot = artifacts() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.png"
    _run([f"--screenshot={shot}", url], budget_ms)
    done = _run(["--dump-dom", url], budget_ms)
    if not done.stdout.strip():
        raise AssertionError(f"chromium rendered nothing for {url}: {done.stderr[-2000:]}")
    (shot.with_suffix(".html")).write_text(done.stdout)
    return done.stdout


class _Text(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def parse(dom: str) -> tuple[str, list[tuple[str, dict[str, str | None]]]]:
    """The visible text of ``dom`` (whitespace collapsed) and its tags with attributes."""
    p = _Text()
    p.feed(dom)
    p.close()
    return re.sub(r"\s+", " ", " ".join(p.parts)), p.tags
