"""`nkicache report --html`: a self-contained page whose plots render in headless Chromium.

Chromium is looked for at /usr/bin/chromium (Debian's package; `.ci/run` installs it). Without it the
test is skipped locally and fails under CI=true. Set NKICACHE_SCREENSHOT_DIR to keep the screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers_graphs import unique_namespace
from helpers_report import Tier, nkicache, run_known_fleet

from cachestore.api import MetricsBatch
from cachestore.backends.sqlite import SqliteBackend

CHROMIUM = "/usr/bin/chromium"
HISTORY_CALLS = {"blockwise_mm": 20, "conv2d_pbp_kxk": 12, "resize_nearest_fixed_dma_kernel": 8}
# Colours the plots draw with (cachestore/report_render.py): hit-rate line and local hits, kernel usage bars.
GREEN = (0x1A, 0x7F, 0x37)
BLUE = (0x09, 0x69, 0xDA)


def chromium() -> str:
    path = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    if path is None:
        reason = f"headless Chromium not found at {CHROMIUM} (apt-get install -y chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI=true: the HTML report test must not be skipped", pytrace=False)
        pytest.skip(reason)
    return path


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Tier]:
    path = tmp_path / "tier.sqlite"
    backend = SqliteBackend(path)
    yield Tier("local", f"local:{path}", unique_namespace(), backend)
    backend.close()


def add_history(tier: Tier, hours: int = 24) -> None:
    """A day of earlier passes, one an hour, their hit rate climbing as the fleet's cache warms up."""
    now = time.time()
    for hour in range(hours, 0, -1):
        kernels = 40
        hits = round(kernels * min(0.95, 0.15 + 0.035 * (hours - hour)))
        counts = {"passes": 1, "kernels": kernels, "cache_hits": hits // 3, "remote_hits": hits - hits // 3,
                  "cache_misses": kernels - hits // 3, "traces": kernels - hits}  # fmt: skip
        record = {**counts, "finished": now - hour * 3600, "host": "hist", "worker": "w0"}
        tier.backend.apply_metrics(MetricsBatch(f"history-{hour}", "hist", "w0", dict(counts), HISTORY_CALLS,
                                                {}, record))  # fmt: skip


def render(browser: str, page: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio",
         f"--user-data-dir={out.parent / 'chromium-profile'}", "--window-size=1280,2600", *flags, page.as_uri()],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip


def test_html_report_renders_in_headless_chromium_with_its_plots(tier: Tier, tmp_path: Path) -> None:
    browser = chromium()
    add_history(tier)
    run_known_fleet(tier)
    page = tmp_path / "report.html"
    result = nkicache(tier, "report", "--html", str(page))
    assert result.exit_code == 0, result.output
    html = page.read_text()

    # Self-contained: nothing fetched from anywhere.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "<script" not in html
    assert html.count("<svg") == 2
    assert "<h2>Hit rate over time</h2>" in html and "<h2>Usage per kernel</h2>" in html
    for kernel in ("matmul_tiled", "softmax", "rmsnorm", "blockwise_mm"):
        assert kernel in html

    dom = render(browser, page, tmp_path / "dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for plot in ("plot-hit-rate", "plot-kernel-usage"):
        figure = re.search(rf'<figure id="{plot}">(.*?)</figure>', dom.stdout, re.S)
        assert figure, f"{plot} missing from the rendered DOM"
        assert "<svg" in figure.group(1) and figure.group(1).count("<path") > 20, plot
    assert '<div class="v">27</div><div class="k">passes</div>' in dom.stdout  # 24 earlier passes + 3

    screenshot = tmp_path / "report.png"
    shot = render(browser, page, tmp_path / "shot", f"--screenshot={screenshot}")
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-2000:]
    from matplotlib.image import imread

    pixels = (imread(screenshot)[..., :3] * 255).round().astype(np.int32)
    assert pixels.shape[1] == 1280
    not_white = np.any(pixels < 245, axis=-1).mean()
    assert not_white > 0.05, f"the page is nearly blank ({not_white:.1%} of pixels drawn)"
    for name, colour in (("hit-rate line / local hits", GREEN), ("kernel usage bars", BLUE)):
        drawn = np.all(np.abs(pixels - np.array(colour)) <= 6, axis=-1).sum()
        assert drawn > 2000, f"{name}: only {drawn} pixels in {colour}"
    if os.environ.get("NKICACHE_SCREENSHOT_DIR"):
        shutil.copy(screenshot, Path(os.environ["NKICACHE_SCREENSHOT_DIR"]) / "report.png")
