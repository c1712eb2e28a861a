"""A `FleetReport` as text tables (rich), JSON, Prometheus text exposition (prometheus_client), or a
self-contained HTML page with its plots inline (matplotlib SVG).

matplotlib is imported only inside the HTML plots: it comes with the optional `html` extra, so a worker or
metrics image without it still renders every other format."""

from __future__ import annotations

import html
import importlib
import io
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

from bridge.errors import NkiCacheError
from bridge.miss_causes import MISS_CAUSE_MEANINGS, MISS_CAUSES, MISS_COUNTERS
from bridge.port import (
    HIT_RATE_FORMULAS,
    HIT_RATE_WORDS,
    IN_PASS_HIT_RATE,
    SHARED_HIT_RATE,
    format_rate,
    hit_rates,
    plural,
)
from cachestore.api import TOTAL_COUNTERS
from cachestore.json_text import json_text
from cachestore.report import FleetReport

logger = logging.getLogger(__name__)
RATES = (SHARED_HIT_RATE, IN_PASS_HIT_RATE)
TOTALS_SHOWN_FIRST = (
    *RATES,
    "passes",
    "kernels",
    "cache_hits",
    "cache_misses",
    "tier_lookups",
    "remote_hits",
    "traces",
    "compile_seconds",
    "tier_saved_seconds",
    "in_pass_saved_seconds",
)
# One word for each count, in every table, plot and metric help: "in-pass" is the pass's own cache (the
# specification's), "remote" the shared tier; a trace is a miss that neither answered.
TOTAL_LABELS = {
    "passes": "passes",
    "kernels": "kernels (internal kernel ops compiled)",
    "cache_hits": "in-pass hits (the pass's own cache)",
    "cache_misses": "in-pass misses",
    "tier_lookups": "tier lookups (in-pass misses that asked the shared tier)",
    "remote_hits": "remote hits (answered by the shared tier)",
    "traces": "traces (misses neither cache answered; beta3 compiles run)",
    "parallel_traces": "parallel traces (misses a trace task traced for the pass, compile --workers N)",
    "traces_refused": "handed-over traces refused (another compiler's: traced by the pass)",
    "known_failures": "known failures (kernels the tier knew fail to compile: failed at once, not compiled again)",
    **{name: f"{HIT_RATE_WORDS[name]} ({HIT_RATE_FORMULAS[name]})" for name in RATES},
    "compile_seconds": "compile seconds spent",
    "tier_saved_seconds": "compile seconds the shared tier saved (its remote hits)",
    "in_pass_saved_seconds": "compile seconds the in-pass cache saved (its hits)",
    "lease_waits": "lease waits",
    "tier_errors": "tier errors",
    "tier_timeouts": "tier timeouts",
    "tier_rejected": "tier entries rejected",
    "tier_dropped": "tier writes dropped",
}
# The miss counters have a table of their own (misses by cause), and one labelled metric family.
COUNTERS_BY_NAME = tuple(name for name in TOTAL_COUNTERS if name not in MISS_COUNTERS)
TOTALS_SHOWN = TOTALS_SHOWN_FIRST + tuple(name for name in COUNTERS_BY_NAME if name not in TOTALS_SHOWN_FIRST)


def label(name: str) -> str:
    return TOTAL_LABELS.get(name, name.replace("_", " "))


def when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    try:
        return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):  # a stored time no date is (1e300, NaN, a word)
        return f"{timestamp!r} (not a date)"


def shapes(values: list | None) -> str:
    if values is None:
        return "(entry not stored)"
    return " ".join("[" + ",".join(str(d) for d in shape) + "]" for shape in values) or "-"


def _value(name: str, value: float | None) -> str:
    if name in RATES:
        return format_rate(value)
    assert value is not None, name  # only a hit rate is ever None
    if name.endswith("seconds"):
        return f"{value:,.2f}"
    return f"{int(value):,}"


# -- JSON -------------------------------------------------------------------------------------------
def render_json(report: FleetReport) -> str:
    return json_text(report.as_json(), indent=2)


# -- text -------------------------------------------------------------------------------------------
def render_text(report: FleetReport, width: int | None = None, ascii_only: bool = False) -> str:
    """Tables for a terminal (plain text when not on one); `ascii_only` draws them with ASCII characters, for
    output that goes to a file, a pipe or a terminal that cannot show box drawing."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    buffer = io.StringIO()
    console = Console(file=buffer, width=width or 160, force_terminal=False, color_system=None, highlight=False)
    for part in text_parts(report):
        if ascii_only and isinstance(part, Table):
            part.box = box.ASCII
        console.print(part)
        if not isinstance(part, Text):  # a heading sits right above its table
            console.print()
    return buffer.getvalue()


def text_parts(report: FleetReport) -> Iterator[Any]:
    from rich.table import Table
    from rich.text import Text

    since = f", passes since {when(report.since)}" if report.since is not None else ""
    yield f"Fleet report: {report.tier}, {when(report.generated)}{since}"

    yield Text("Totals (all passes)", style="bold")

    totals = Table()
    totals.add_column("counter")
    totals.add_column("value", justify="right")
    for name in TOTALS_SHOWN:
        totals.add_row(label(name), _value(name, report.totals.get(name, 0)))
    totals.add_row("distinct variants (cache keys)", f"{report.variants:,}")
    totals.add_row("distinct kernel types", f"{len(report.per_kernel):,}")
    yield totals

    yield Text("Per host and worker", style="bold")

    workers = Table()
    workers.add_column("host")
    workers.add_column("worker")
    for column in WORKER_HEADERS:
        workers.add_column(column, justify="right")
    for host, info in report.per_host.items():
        for worker, values in info["workers"].items():
            workers.add_row(host, worker, *_worker_cells(values))
        if len(info["workers"]) > 1:
            workers.add_row(host, "(all)", *_worker_cells(info["totals"]), style="bold")
    yield workers

    if any(report.misses.values()):
        yield Text("Tier misses by cause (all passes; a tier miss is a tier lookup not answered)", style="bold")
        yield _misses_table(["cause", "misses", "meaning"], _cause_rows(report.misses))

    if report.per_toolchain:
        yield Text("Per toolchain (the compiler that ran each pass; an upgrade starts cold)", style="bold")
        toolchains = Table()
        toolchains.add_column("toolchain", no_wrap=True)  # an id is copied from here: one piece
        for column in WORKER_HEADERS:
            toolchains.add_column(column, justify="right")
        for toolchain, values in report.per_toolchain.items():
            toolchains.add_row(_toolchain_label(toolchain), *_worker_cells(values))
        yield toolchains

    if report.trust.get("writers") or report.trust.get("sentinel_checked"):
        trust = report.trust
        yield Text(
            f"Per writer (signing key id); sentinel: {plural(trust['sentinel_checked'], 'entry')} traced again, "
            f"{trust['quarantined']:,} quarantined",
            style="bold",
        )
        writers = Table()
        writers.add_column("writer", no_wrap=True)
        for column in ("stored", "served", "quarantined"):
            writers.add_column(column, justify="right")
        for writer, row in trust["writers"].items():
            writers.add_row(writer, f"{row['stored']:,}", f"{row['served']:,}", f"{row['quarantined']:,}")
        yield writers

    if report.coverage:
        yield Text(
            "Coverage (of another toolchain's stored variants, weighted by fleet usage: how warm each is)", style="bold"
        )
        coverage = Table()
        for column in COVERAGE_HEADERS:
            coverage.add_column(column, no_wrap=column != "share", justify="right" if column == "share" else "left")
        for row in _coverage_rows(report):
            coverage.add_row(*row)
        yield coverage

    yield Text("Per kernel (as _export_new_nki_fe_metrics, fleet-wide)", style="bold")

    kernels = Table()
    kernels.add_column("kernel")
    kernels.add_column("call_count", justify="right")
    kernels.add_column("variants", justify="right")
    for name, stats in report.per_kernel.items():
        kernels.add_row(name, f"{stats['call_count']:,}", f"{stats['variants']:,}")
    yield kernels

    if report.top_variants:
        yield Text(f"Top {plural(len(report.top_variants), 'variant')} by usage", style="bold")
        top = Table()
        for column in ("#", "kernel", "usage", "operand shapes", "result shapes", "dtypes", "key", "hosts", "last use"):
            top.add_column(column, justify="right" if column in ("#", "usage") else "left")
        for rank, v in enumerate(report.top_variants, 1):
            dtypes = ",".join(sorted(set((v.operand_dtypes or []) + (v.result_dtypes or [])))) or "-"
            top.add_row(
                str(rank),
                v.kernel_name,
                f"{v.usage:,}",
                shapes(v.operand_shapes),
                shapes(v.result_shapes),
                dtypes,
                v.key[:16],
                ",".join(v.hosts) or "-",
                when(v.last_use),
            )
        yield top

    if report.timeline:
        yield Text(f"Hit rates over time ({_width(report.bucket_seconds)} buckets)", style="bold")
        timeline = Table()
        for column in ("from", *TIMELINE_HEADERS, ""):
            timeline.add_column(column, justify="left" if column in ("from", "") else "right")
        for bucket in report.timeline:
            rates = hit_rates(bucket.counts)
            shared = rates[SHARED_HIT_RATE]
            bar = "#" * round(shared * 30) if shared is not None else ""  # the headline rate, as in the plot
            timeline.add_row(when(bucket.start), *_timeline_cells(bucket.counts), bar)
        yield timeline
        window = report.window
        for event in report.zeroed:
            yield f"Counters zeroed {when(event['when'])} by {event['host']}/{event['worker']} (nkicache report --zero)"
        if any(any(bucket.misses.values()) for bucket in report.timeline):
            yield Text("Tier misses by cause over time", style="bold")
            headers, rows = _misses_over_time(report)
            yield _misses_table(headers, rows)
        if report.kernel_misses:
            yield Text("Tier misses by cause per kernel (passes in these buckets)", style="bold")
            headers, rows = _kernel_miss_rows(report)
            yield _misses_table(headers, rows)
        yield (
            f"In these buckets: {plural(window['passes'] or 0, 'pass')}, {plural(window['kernels'] or 0, 'kernel')}, "
            f"{HIT_RATE_WORDS[SHARED_HIT_RATE]} {format_rate(window[SHARED_HIT_RATE])}, "
            f"{HIT_RATE_WORDS[IN_PASS_HIT_RATE]} {format_rate(window[IN_PASS_HIT_RATE])}"
        )
    else:
        yield "No passes in the pass log" + (" since then." if report.since is not None else ".")


WORKER_COUNTERS = (
    "passes",
    "kernels",
    "cache_hits",
    "tier_lookups",
    "remote_hits",
    "traces",
    *RATES,
    "compile_seconds",
    "tier_saved_seconds",
    "in_pass_saved_seconds",
)
# Two-line headers (the same words as the totals, broken where a narrow column would cut them).
RATE_HEADERS = [HIT_RATE_WORDS[name].replace(" hit rate", "\nhit rate") for name in RATES]
WORKER_HEADERS = [
    "passes",
    "kernels",
    "in-pass\nhits",
    "tier\nlookups",
    "remote\nhits",
    "traces",
    *RATE_HEADERS,
    "compile s",
    "tier\nsaved s",
    "in-pass\nsaved s",
    "tier err/\ntmo/rej",
]
TIMELINE_COUNTERS_SHOWN = ("passes", "kernels", "cache_hits", "tier_lookups", "remote_hits", "traces")
TIMELINE_HEADERS = ["passes", "kernels", "in-pass\nhits", "tier\nlookups", "remote\nhits", "traces", *RATE_HEADERS]


def _timeline_cells(counts: dict) -> list[str]:
    rates = hit_rates(counts)
    return [
        *(f"{int(counts.get(name, 0)):,}" for name in TIMELINE_COUNTERS_SHOWN),
        *(_value(name, rates[name]) if counts["kernels"] else "-" for name in RATES),
    ]


def _misses_table(headers: list[str], rows: list[list[str]]) -> Any:
    from rich.table import Table

    table = Table()
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 or header == "meaning" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _cause_rows(misses: dict[str, int]) -> list[list[str]]:
    return [[cause, f"{count:,}", MISS_CAUSE_MEANINGS[cause]] for cause, count in misses.items() if count]


def _causes_seen(counts: Iterable[Mapping[str, float]]) -> list[str]:
    """The causes any of `counts` has, in their order: a column for each cause that happened, not for all."""
    seen = {cause for one in counts for cause, count in one.items() if count}
    return [cause for cause in MISS_CAUSES if cause in seen]


def _misses_over_time(report: FleetReport) -> tuple[list[str], list[list[str]]]:
    causes = _causes_seen(bucket.misses for bucket in report.timeline)
    rows = [[when(bucket.start), *(f"{int(bucket.misses[cause]):,}" for cause in causes)] for bucket in report.timeline]
    return ["from", *causes], rows


def _kernel_miss_rows(report: FleetReport) -> tuple[list[str], list[list[str]]]:
    causes = _causes_seen(report.kernel_misses.values())
    ranked = sorted(report.kernel_misses.items(), key=lambda item: (-sum(item[1].values()), item[0]))
    rows = [[kernel, *(f"{by_cause.get(cause, 0):,}" for cause in causes)] for kernel, by_cause in ranked]
    return ["kernel", *causes], rows


def _worker_cells(values: dict) -> list[str]:
    tier = f"{int(values['tier_errors'])}/{int(values['tier_timeouts'])}/{int(values['tier_rejected'])}"
    return [*(_value(name, values[name]) for name in WORKER_COUNTERS), tier]


COVERAGE_HEADERS = ("toolchain", "covers", "variants held", "usage held", "share")


def _coverage_rows(report: FleetReport) -> list[list[str]]:
    return [
        [
            _toolchain_label(toolchain),
            other,
            f"{c.covered_variants:,} of {c.variants:,}",
            f"{c.covered_usage:,} of {c.usage:,}",
            f"{c.share:.1%}",
        ]
        for toolchain, of in report.coverage.items()
        for other, c in of.items()
    ]


def _toolchain_label(toolchain: str) -> str:
    from bridge.identity import toolchain_id

    return f"{toolchain} (this compiler)" if toolchain == toolchain_id() else toolchain


def _width(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


# -- Prometheus -------------------------------------------------------------------------------------
def _metric_families(report: FleetReport) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name in COUNTERS_BY_NAME:
        yield CounterMetricFamily(f"nkicache_{name}", f"Fleet total of {label(name)}.", value=report.totals[name])
    misses = CounterMetricFamily(
        "nkicache_tier_misses",
        "Fleet tier misses (lookups the tier did not answer) by cause (docs/tiers.md).",
        labels=["cause"],
    )
    for cause, count in report.misses.items():
        misses.add_metric([cause], count)
    yield misses
    yield from _rate_families("nkicache_", "Fleet", [], [((), report.totals)])
    yield GaugeMetricFamily("nkicache_variants", "Distinct cache keys the fleet used.", value=report.variants)
    for name in COUNTERS_BY_NAME:
        family = CounterMetricFamily(
            f"nkicache_worker_{name}", f"Per worker: {label(name)}.", labels=["host", "worker"]
        )
        for host, info in report.per_host.items():
            for worker, values in info["workers"].items():
                family.add_metric([host, worker], values[name])
        yield family
    calls = CounterMetricFamily(
        "nkicache_kernel_calls", "Per kernel name: summed usage (call_count), fleet-wide.", labels=["kernel"]
    )
    variants = GaugeMetricFamily(
        "nkicache_kernel_variants", "Per kernel name: distinct cache keys (variants).", labels=["kernel"]
    )
    for kernel, stats in report.per_kernel.items():
        calls.add_metric([kernel], stats["call_count"])
        variants.add_metric([kernel], stats["variants"])
    yield calls
    yield variants
    for name in COUNTERS_BY_NAME:
        family = CounterMetricFamily(
            f"nkicache_toolchain_{name}", f"Per toolchain (compiler id): {label(name)}.", labels=["toolchain"]
        )
        for toolchain, values in report.per_toolchain.items():
            family.add_metric([toolchain], values[name] or 0)  # (a count: never None, as a hit rate can be)
        yield family
    rows = [((toolchain,), values) for toolchain, values in report.per_toolchain.items()]
    yield from _rate_families("nkicache_toolchain_", "Per toolchain", ["toolchain"], rows)
    coverage = GaugeMetricFamily(
        "nkicache_toolchain_coverage",
        "Share of toolchain `of`'s stored variants, weighted by fleet usage, that `toolchain` holds too.",
        labels=["toolchain", "of"],
    )
    for toolchain, of in report.coverage.items():
        for other, c in of.items():
            coverage.add_metric([toolchain, other], c.share)
    yield coverage
    yield from _trust_families(report)


def _trust_families(report: FleetReport) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    trust = report.trust or {"writers": {}, "sentinel_checked": 0, "quarantined": 0, "quarantined_by_toolchain": {}}
    yield CounterMetricFamily(
        "nkicache_sentinel_checked", "Entries the sentinel traced again and compared.", value=trust["sentinel_checked"]
    )
    yield CounterMetricFamily(
        "nkicache_quarantined", "Entries the sentinel quarantined (binary differs).", value=trust["quarantined"]
    )
    by_toolchain = CounterMetricFamily(
        "nkicache_toolchain_quarantined", "Per toolchain: entries quarantined.", labels=["toolchain"]
    )
    for toolchain, count in trust["quarantined_by_toolchain"].items():
        by_toolchain.add_metric([toolchain], count)
    yield by_toolchain
    for field_name in ("stored", "served", "quarantined"):
        family = CounterMetricFamily(
            f"nkicache_writer_{field_name}", f"Per writer key id: entries {field_name}.", labels=["writer"]
        )
        for writer, row in trust["writers"].items():
            family.add_metric([writer], row[field_name])
        yield family


def _rate_families(prefix: str, scope: str, labels: list[str], rows: list[tuple[tuple, dict]]) -> Iterator[Any]:
    """PREFIXshared_hit_ratio and PREFIXin_pass_hit_ratio. A scope that never asked the tier has no shared
    sample at all: a 0 would read as a cache that never hits."""
    from prometheus_client.core import GaugeMetricFamily

    for name in RATES:
        family = GaugeMetricFamily(
            f"{prefix}{name.removesuffix('_rate')}_ratio",
            f"{scope}: {HIT_RATE_WORDS[name]}, {HIT_RATE_FORMULAS[name]}, from summed counts.",
            labels=labels,
        )
        for label_values, values in rows:
            if values[name] is not None:
                family.add_metric(list(label_values), values[name])
        yield family


class FleetCollector:
    """A prometheus_client collector that builds a fresh report on each scrape; a tier that cannot be read
    gives nkicache_tier_up 0 instead of a failed scrape."""

    def __init__(self, build: Callable[[], FleetReport]):
        self.build = build

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        started = time.perf_counter()
        try:
            report = self.build()
            families = list(_metric_families(report))  # all of them or none: never half a scrape, then a 500
        except Exception as exc:
            # A scrape always answers: prometheus_client turns an exception into an HTTP 500, and Prometheus
            # then sees no series at all instead of a tier that is down. What is not the tier's own error
            # (a value no reader expected) is logged, once per scrape.
            if not isinstance(exc, NkiCacheError):
                logger.warning("reading the tier for a scrape failed: %s: %s", type(exc).__name__, exc)
            yield GaugeMetricFamily("nkicache_tier_up", "1 when the tier could be read for this scrape.", value=0)
            return
        yield GaugeMetricFamily("nkicache_tier_up", "1 when the tier could be read for this scrape.", value=1)
        yield from families
        yield GaugeMetricFamily(
            "nkicache_report_seconds",
            "Seconds it took to read the tier for this scrape.",
            value=time.perf_counter() - started,
        )


def prometheus_registry(build: Callable[[], FleetReport]) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)  # describing would read the tier at registration
    registry.register(FleetCollector(build))
    return registry


def render_prometheus(report: FleetReport) -> str:
    """The text exposition format, for node_exporter's textfile collector."""
    from prometheus_client import generate_latest

    return generate_latest(prometheus_registry(lambda: report)).decode()


# -- HTML -------------------------------------------------------------------------------------------
CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #1f2328; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 2em; }
.sub { color: #59636e; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 1em; margin: 1.5em 0; }
.card { border: 1px solid #d1d9e0; border-radius: 8px; padding: 0.8em 1.2em; min-width: 10em; }
.card .v { font-size: 1.6em; font-weight: 600; } .card .k { color: #59636e; font-size: 0.9em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
th, td { border-bottom: 1px solid #d1d9e0; padding: 0.3em 0.8em; text-align: left; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
figcaption { color: #59636e; font-size: 0.9em; }
code { font-size: 0.9em; }
"""


HTML_EXTRA = "pip install 'nkicache[html]'"


def require_matplotlib() -> None:
    """Raise a project error (one line naming the `html` extra) when matplotlib cannot be imported, instead of
    letting an ImportError end `report --html` with a traceback."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        reason = " ".join(str(exc).split())
        raise NkiCacheError(
            f"the HTML report draws its plots with matplotlib, which cannot be imported ({reason}); "
            f"install the html extra: {HTML_EXTRA}"
        ) from None


def _svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def plot_hit_rate(report: FleetReport) -> str | None:
    """The two hit rates per bucket over time, above the kernels per bucket split as the tables split them:
    in-pass hits, remote hits and traces."""
    if not report.timeline:
        return None
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.figure import Figure

    starts = [datetime.fromtimestamp(b.start) for b in report.timeline]
    width_days = report.bucket_seconds / 86400 * 0.9
    local = [b.counts["cache_hits"] for b in report.timeline]
    remote = [b.counts["remote_hits"] for b in report.timeline]
    traced = [b.counts["traces"] for b in report.timeline]  # every trace, the parallel ones included
    centers = [datetime.fromtimestamp(b.start + report.bucket_seconds / 2) for b in report.timeline]

    figure = Figure(figsize=(10, 5.5), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    # One colour per cache: the shared tier's rate and its remote hits blue, the in-pass rate and hits green.
    for name, color, style in ((SHARED_HIT_RATE, "#0550ae", "-"), (IN_PASS_HIT_RATE, "#1a7f37", ":")):
        rated = [
            (c, rate * 100)
            for c, b in zip(centers, report.timeline, strict=True)
            if b.counts["kernels"] and (rate := hit_rates(b.counts)[name]) is not None
        ]
        overall = format_rate(report.window.get(name))
        legend = f"{HIT_RATE_WORDS[name]} ({HIT_RATE_FORMULAS[name]}), over the period: {overall}"
        top.plot(
            [c for c, _ in rated],
            [r for _, r in rated],
            marker="o",
            color=color,
            linestyle=style,
            linewidth=2,
            label=legend,
        )
    top.legend(loc="lower right", fontsize="small")
    top.set_ylim(0, 105)
    top.set_ylabel("hit rate (%)")
    top.set_title(
        f"Fleet hit rates over time: {HIT_RATE_WORDS[SHARED_HIT_RATE]} and {HIT_RATE_WORDS[IN_PASS_HIT_RATE]}",
        loc="left",
    )
    top.grid(alpha=0.3)
    bottom.bar(starts, local, width=width_days, align="edge", label="in-pass hits", color="#1a7f37")
    bottom.bar(starts, remote, width=width_days, align="edge", bottom=local, label="remote hits", color="#54aeff")
    stacked = [a + b for a, b in zip(local, remote, strict=True)]
    bottom.bar(starts, traced, width=width_days, align="edge", bottom=stacked, label="traces", color="#fd8c73")
    bottom.set_ylabel("kernels")
    bottom.legend(loc="upper left", fontsize="small", ncols=3)
    bottom.grid(alpha=0.3, axis="y")
    if len(starts) == 1:  # one bucket: show its whole width, not a few seconds around it
        bottom.set_xlim(starts[0] - (centers[0] - starts[0]), centers[0] + (centers[0] - starts[0]) * 2)
    locator = AutoDateLocator()
    bottom.xaxis.set_major_locator(locator)
    bottom.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    return _svg(figure)


def plot_kernel_usage(report: FleetReport, limit: int = 25) -> str | None:
    """call_count per kernel name (most used on top), each bar labelled with its number of variants."""
    if not report.per_kernel:
        return None
    from matplotlib.figure import Figure

    items = list(report.per_kernel.items())[:limit][::-1]
    names = [name for name, _ in items]
    calls = [stats["call_count"] for _, stats in items]
    figure = Figure(figsize=(10, 1.2 + 0.45 * len(items)), layout="constrained")
    axes = figure.subplots()
    bars = axes.barh(names, calls, color="#0969da")
    labels = [
        f"{plural(c, 'call')}, {plural(s['variants'], 'variant')}" for c, (_, s) in zip(calls, items, strict=True)
    ]
    axes.bar_label(bars, labels=labels, padding=4, fontsize="small")
    axes.set_xlabel("call_count (summed usage over all passes)")
    axes.set_title("Usage per kernel", loc="left")
    axes.set_xlim(0, max([*calls, 1]) * 1.35)
    axes.grid(alpha=0.3, axis="x")
    return _svg(figure)


def _plain_text_plots(report: FleetReport) -> tuple[str | None, str | None]:
    """The two plots, every label drawn as plain text. matplotlib reads text between two `$` as mathtext: a
    kernel name such as `a$\\frac{$b` (any name the fleet recorded) would fail the whole page with a parse error,
    and one that parses would be drawn as a formula, not as its name."""
    import matplotlib

    # svg.fonttype none: text stays text (the page's font, selectable and searchable), not glyph outlines.
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False, "svg.fonttype": "none"}):
        return plot_hit_rate(report), plot_kernel_usage(report)


def _cell(tag: str, value: Any, numeric: bool) -> str:
    return (
        f'<{tag} class="n">{html.escape(str(value))}</{tag}>'
        if numeric
        else f"<{tag}>{html.escape(str(value))}</{tag}>"
    )


def _table(headers: list[str], rows: list[list[Any]], numeric: set[int]) -> str:
    head = "".join(_cell("th", h, i in numeric) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(_cell("td", c, i in numeric) for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: FleetReport) -> str:
    """One self-contained page: summary, the two plots as inline SVG, and the report's tables."""
    require_matplotlib()  # even with nothing to plot, so `--html` needs the extra on every tier, not only on a busy one
    t = report.totals
    cards = [
        (HIT_RATE_WORDS[SHARED_HIT_RATE], _value(SHARED_HIT_RATE, t[SHARED_HIT_RATE])),
        (HIT_RATE_WORDS[IN_PASS_HIT_RATE], _value(IN_PASS_HIT_RATE, t[IN_PASS_HIT_RATE])),
        ("kernels", _value("kernels", t["kernels"])),
        ("passes", _value("passes", t["passes"])),
        ("traces", _value("traces", t["traces"])),
        ("compile s the shared tier saved", _value("tier_saved_seconds", t["tier_saved_seconds"])),
        ("compile s the in-pass cache saved", _value("in_pass_saved_seconds", t["in_pass_saved_seconds"])),
        ("variants", f"{report.variants:,}"),
    ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>nkicache fleet report: {html.escape(report.tier)}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>nkicache fleet report</h1>",
        f'<p class="sub">{html.escape(report.tier)}, generated {html.escape(when(report.generated))}'
        + (f", passes since {html.escape(when(report.since))}" if report.since is not None else "")
        + "</p>",
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="v">{html.escape(v)}</div><div class="k">{html.escape(k)}</div></div>'
            for k, v in cards
        )
        + "</div>",
    ]
    hit_plot, usage_plot = _plain_text_plots(report)
    parts.append("<h2>Hit rates over time</h2>")
    if hit_plot:
        parts.append(
            f'<figure id="plot-hit-rate">{hit_plot}<figcaption>{_width(report.bucket_seconds)} buckets by '
            "when each pass finished; in-pass hits are answered by the pass's own cache, remote hits by the "
            "shared tier, traces by neither.</figcaption></figure>"
        )
    else:
        parts.append("<p>No passes in the pass log.</p>")
    parts.append("<h2>Usage per kernel</h2>")
    if usage_plot:
        parts.append(f'<figure id="plot-kernel-usage">{usage_plot}</figure>')
    else:
        parts.append("<p>No kernels recorded.</p>")

    parts.append("<h2>Totals</h2>")
    parts.append(_table(["counter", "value"], [[label(n), _value(n, t.get(n, 0))] for n in TOTALS_SHOWN], {1}))
    if any(report.misses.values()):
        parts.append('<h2 id="misses">Tier misses by cause</h2>')
        parts.append(_table(["cause", "misses", "meaning"], _cause_rows(report.misses), {1}))
    if report.kernel_misses:
        headers, rows = _kernel_miss_rows(report)
        parts.append('<h2 id="kernel-misses">Tier misses by cause per kernel</h2>')
        parts.append(_table(headers, rows, set(range(1, len(headers)))))
    parts.append("<h2>Per host and worker</h2>")
    rows = [
        [host, worker, *_worker_cells(values)]
        for host, info in report.per_host.items()
        for worker, values in info["workers"].items()
    ]
    parts.append(_table(["host", "worker", *WORKER_HEADERS], rows, set(range(2, 2 + len(WORKER_HEADERS)))))
    parts.append('<h2 id="per-toolchain">Per toolchain</h2>')
    if report.per_toolchain:
        rows = [
            [_toolchain_label(toolchain), *_worker_cells(values)] for toolchain, values in report.per_toolchain.items()
        ]
        parts.append(_table(["toolchain", *WORKER_HEADERS], rows, set(range(1, 1 + len(WORKER_HEADERS)))))
    else:
        parts.append("<p>No pass named its toolchain.</p>")
    if report.coverage:
        parts.append('<h2 id="coverage">Coverage of other toolchains</h2>')
        parts.append(_table(list(COVERAGE_HEADERS), _coverage_rows(report), {4}))
    parts.append("<h2>Per kernel</h2>")
    parts.append(
        _table(
            ["kernel", "call_count", "variants"],
            [[n, f"{s['call_count']:,}", f"{s['variants']:,}"] for n, s in report.per_kernel.items()],
            {1, 2},
        )
    )
    if report.top_variants:
        parts.append(f"<h2>Top {plural(len(report.top_variants), 'variant')}</h2>")
        rows = [
            [
                str(i),
                v.kernel_name,
                f"{v.usage:,}",
                shapes(v.operand_shapes),
                shapes(v.result_shapes),
                ",".join(sorted(set((v.operand_dtypes or []) + (v.result_dtypes or [])))),
                v.key[:16],
                ",".join(v.hosts),
                when(v.last_use),
            ]
            for i, v in enumerate(report.top_variants, 1)
        ]
        parts.append(
            _table(
                ["#", "kernel", "usage", "operand shapes", "result shapes", "dtypes", "key", "hosts", "last use"],
                rows,
                {0, 2},
            )
        )
    parts.append("</body></html>")
    return "\n".join(parts)
