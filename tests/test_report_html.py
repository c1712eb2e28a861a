"""`nkicache report --html`: a self-contained page whose plots render in headless Chromium.

Chromium is looked for at /usr/bin/chromium (Debian's package; `.ci/run` installs it). Without it the
test is skipped locally and fails under CI=true. Set NKICACHE_SCREENSHOT_DIR to keep the screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
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
# Colours the plots draw with (cachestore/report_render.py): in-pass rate line and hits, kernel usage bars.
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
                  "cache_misses": kernels - hits // 3, "tier_lookups": kernels - hits // 3,
                  "traces": kernels - hits}  # fmt: skip
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
    assert "<h2>Hit rates over time</h2>" in html and "<h2>Usage per kernel</h2>" in html
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
    for name, colour in (("in-pass rate line / in-pass hits", GREEN), ("kernel usage bars", BLUE)):
        drawn = np.all(np.abs(pixels - np.array(colour)) <= 6, axis=-1).sum()
        assert drawn > 2000, f"{name}: only {drawn} pixels in {colour}"
    if os.environ.get("NKICACHE_SCREENSHOT_DIR"):
        shutil.copy(screenshot, Path(os.environ["NKICACHE_SCREENSHOT_DIR"]) / "report.png")


# -- matplotlib comes with the `html` extra only ---------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
HTML_EXTRA = "pip install 'nkicache[html]'"


def python(script: str, *args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter (this one's), so its sys.modules says what the command imported."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=cwd, check=False)  # fmt: skip


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_matplotlib_is_an_extra_that_the_dev_install_includes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "matplotlib" not in requirement_names(project["dependencies"])  # `pip install nkicache`: no plots
    extras = project["optional-dependencies"]
    assert "matplotlib" in requirement_names(extras["html"])
    # The README's first command installs the dev extra; it must still bring matplotlib (the HTML test needs it).
    assert "nkicache[html]" in extras["dev"] or "matplotlib" in requirement_names(extras["dev"])
    assert "pip install -e '.[dev]'" in (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```")[0]


def test_html_report_without_matplotlib_says_how_to_get_it(tier: Tier, tmp_path: Path) -> None:
    add_history(tier)  # something to plot
    page = tmp_path / "report.html"
    script = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # `import matplotlib` now raises ImportError, as without the extra\n"
        "from workers.cli import main\n"
        "main(sys.argv[1:], prog_name='nkicache')\n"
    )
    result = python(script, "report", "--html", str(page), env=tier.env(), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("nkicache: error: ") and HTML_EXTRA in line, line
    assert result.stdout == "" and not page.exists()


def test_text_json_and_prometheus_reports_never_import_matplotlib(tier: Tier, tmp_path: Path) -> None:
    add_history(tier)  # a timeline and per-kernel usage: what the HTML page would plot
    script = (
        "import json, sys\n"
        "from workers.cli import main\n"
        "for output in (['--json'], ['--prometheus'], []):\n"
        "    main(['report', *output], prog_name='nkicache', standalone_mode=False)\n"
        "    assert 'matplotlib' not in sys.modules, f'report {output} imported matplotlib'\n"
        "print(json.dumps('matplotlib' in sys.modules))\n"
    )
    result = python(script, env=tier.env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"passes": 24' in result.stdout  # the JSON report read the history
    assert result.stdout.splitlines()[-1] == "false"
