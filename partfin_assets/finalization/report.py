"""A picture of finalization: `partfin report --table T` -> a self-contained HTML page (plotly) and a PNG (matplotlib).

Everything is read from the late-data ledger and table properties (no data files):

- the watermark over wall time: each checkpoint's commit clock (x) against the watermark it
  recorded (y), with the wall clock itself (y = x) for reference: the gap between them is how
  far event-time completeness trails real time;
- finalization lag per hour: when the hour finalized minus the hour's end (finalization/hour_truth.py);
- late records per hour, and records per hour;
- the current policy and watermark.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import polars as pl
from pyiceberg.catalog import Catalog

from partfin_assets.finalization.hour_truth import HourTruth, hour_truths
from partfin_assets.finalization.hours import finalized_through
from partfin_assets.iceberg.catalog import load_existing_table
from partfin_assets.iceberg.history import watermark_of
from partfin_assets.iceberg.ledger import read_ledger
from partfin_assets.model.display_text import html_text, markdown_text
from partfin_assets.model.table_options import WATERMARK_POLICY
from partfin_assets.model.timeutil import format_duration, from_us, iso_z


@dataclass(frozen=True)
class FinalizationPicture:
    table: str
    policy: str | None
    watermark_us: int | None
    steps: list[tuple[datetime, datetime]]  # (commit clock, watermark recorded), in commit order
    hours: list[HourTruth]

    @property
    def hour_times(self) -> list[datetime]:
        return [from_us(h.hour_us) for h in self.hours]

    def facts(self) -> dict[str, str]:
        final = finalized_through(self.watermark_us)
        return {
            "table": f"cdc.{self.table}",
            "watermark policy": self.policy or "-",
            "watermark": iso_z(self.watermark_us) if self.watermark_us is not None else "-",
            "finalized through": iso_z(final) if final is not None else "-",
            "hours": str(len(self.hours)),
            "records": str(sum(h.records for h in self.hours)),
            "late records": str(sum(h.late_records for h in self.hours)),
        }


def finalization_picture(catalog: Catalog, name: str) -> FinalizationPicture:
    cdc = load_existing_table(catalog, f"cdc.{name}")
    ledger = read_ledger(catalog, f"cdc.{name}")
    watermark = watermark_of(cdc.properties)
    steps_frame = (
        ledger.filter(pl.col("watermark").is_not_null())
        .group_by("stream", "checkpoint_id")
        .agg(pl.col("commit_time").first(), pl.col("watermark").first())
        .sort("commit_time")
    )
    steps = list(zip(steps_frame["commit_time"].to_list(), steps_frame["watermark"].to_list()))
    hours = ledger.filter(pl.col("hour").is_not_null())["hour"].dt.epoch("us").unique().to_list()
    return FinalizationPicture(name, WATERMARK_POLICY.text(cdc.properties), watermark, steps, hour_truths(ledger, hours, watermark))


def _lags_hours(picture: FinalizationPicture) -> list[float | None]:
    """Finalization lag per hour in hours (an axis people read: 6, not 21,600 s)."""
    return [round(h.finalization_lag_seconds / 3600, 2) if h.finalization_lag_seconds is not None else None for h in picture.hours]


def write_html(picture: FinalizationPicture, path: Path) -> Path:
    """One self-contained page (plotly.js inlined): opens without a network."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=4, cols=1, vertical_spacing=0.07,
        subplot_titles=("Watermark over wall time", "Finalization lag per hour (h): finalized_at - hour end",
                        "Late records per hour", "Records per hour"),
    )
    if picture.steps:
        clock, watermark = zip(*picture.steps)
        fig.add_trace(go.Scatter(x=clock, y=watermark, mode="lines", line_shape="hv", name="watermark"), row=1, col=1)
        fig.add_trace(go.Scatter(x=[clock[0], clock[-1]], y=[clock[0], clock[-1]], mode="lines", name="wall clock (y = x)",
                                 line={"dash": "dot"}), row=1, col=1)
    times = picture.hour_times
    fig.add_trace(go.Bar(x=times, y=_lags_hours(picture), name="finalization lag (h)",
                         hovertext=[format_duration(h.finalization_lag_seconds) for h in picture.hours]), row=2, col=1)
    fig.add_trace(go.Bar(x=times, y=[h.late_records for h in picture.hours], name="late records"), row=3, col=1)
    fig.add_trace(go.Bar(x=times, y=[h.records for h in picture.hours], name="records"), row=4, col=1)
    fig.update_layout(height=1300, showlegend=True, margin={"t": 60})
    fig.update_xaxes(title_text="commit clock (wall time, UTC)", row=1, col=1)
    fig.update_yaxes(title_text="watermark (event time, UTC)", row=1, col=1)
    for row in (2, 3, 4):
        fig.update_xaxes(title_text="event hour (UTC)", row=row, col=1)
    rows = "".join(f"<tr><th>{html_text(k)}</th><td>{html_text(v)}</td></tr>" for k, v in picture.facts().items())
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>partfin finalization report: cdc.{html_text(picture.table)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}th{text-align:left;padding-right:2em}</style></head><body>"
        f"<h1>Finalization of cdc.{html_text(picture.table)}</h1><table id='policy'>{rows}</table>"
        + fig.to_html(full_html=False, include_plotlyjs=True)
        + "</body></html>"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


MARKDOWN_ROWS = 24  # hours and watermark steps a markdown report lists (the newest)


def markdown_report(picture: FinalizationPicture) -> str:
    """The report as markdown, for Dagster's metadata (the UI renders it, images included: no file on the server's disk
    to open): the facts, the plots people need (plot_pngs, as data: URIs, which Dagster's markdown renderer allows),
    the watermark against the wall clock, and per hour its finalization lag, late records and records. Durations as
    durations; the newest rows only. The facts (the policy is a table property anyone may set) are literal text."""
    facts = picture.facts()
    lines = [f"## Finalization of {markdown_text(facts['table'])}", "", "| | |", "|---|---|",
             *(f"| {markdown_text(k)} | {markdown_text(v)} |" for k, v in facts.items()), ""]
    for title, png in plot_pngs(picture).items():
        lines += [f"![{title}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})", ""]
    lines += ["### Watermark vs wall clock", "", "| commit clock (UTC) | watermark (UTC) | watermark trails the wall clock by |",
              "|---|---|---|"]
    steps = picture.steps[-MARKDOWN_ROWS:]
    lines += [f"| {iso_z(clock)} | {iso_z(mark)} | {format_duration((clock - mark).total_seconds())} |" for clock, mark in steps]
    lines += ["", "### Per hour: finalization lag, late records", "",
              "| hour (UTC) | final | finalization lag | late records | late share | records |", "|---|---|---|---:|---:|---:|"]
    for h in picture.hours[-MARKDOWN_ROWS:]:
        share = f"{h.late_records / h.records:.2%}" if h.records else "-"
        lag = format_duration(h.finalization_lag_seconds) or "-"
        lines.append(f"| {iso_z(h.hour_us)} | {'yes' if h.finalized else 'no'} | {lag} | {h.late_records} | {share} | {h.records} |")
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _draw_watermark(ax, picture: FinalizationPicture) -> None:
    if picture.steps:
        clock, watermark = zip(*picture.steps)
        ax.step(clock, watermark, where="post", label="watermark")
        ax.plot([clock[0], clock[-1]], [clock[0], clock[-1]], linestyle=":", label="wall clock (y = x)")
        ax.legend(fontsize="small")
    ax.set_title("Watermark over wall time")
    ax.set_xlabel("commit clock (UTC)")
    ax.set_ylabel("watermark (event time, UTC)")


def _hour_series(picture: FinalizationPicture) -> dict[str, list[float]]:
    """The per-hour bars: title -> value per hour (picture.hour_times)."""
    return {
        "Finalization lag per hour (h)": [v if v is not None else 0 for v in _lags_hours(picture)],
        "Late records per hour": [h.late_records for h in picture.hours],
        "Records per hour": [h.records for h in picture.hours],
    }


def _draw_bars(ax, times: list[datetime], values: list[float], title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.bar(times, values, width=1 / 30)  # days: a bar of two minutes per hour keeps hours apart
    ax.yaxis.set_major_locator(MaxNLocator(integer=not title.endswith("(h)")))  # counts: no 0.5 record
    ax.set_title(title)
    ax.set_xlabel("event hour (UTC)")


def write_png(picture: FinalizationPicture, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(11, 15), constrained_layout=True)
    policy = picture.facts()
    fig.suptitle(f"cdc.{picture.table}: policy {policy['watermark policy']}, watermark {policy['watermark']}",
                 parse_math=False)  # the policy is a table property: its `$` is text, not mathtext
    _draw_watermark(axes[0], picture)
    for ax, (title, values) in zip(axes[1:], _hour_series(picture).items()):
        _draw_bars(ax, picture.hour_times, values, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


MARKDOWN_PLOTS = ("Watermark over wall time", "Finalization lag per hour (h)", "Late records per hour")
PLOT_SIZE_INCHES, PLOT_DPI, PLOT_COLORS = (7.5, 2.8), 80, 32  # 600 x 224 px, a 32-colour palette: a few kB per plot


def plot_pngs(picture: FinalizationPicture) -> dict[str, bytes]:
    """The plots people need most, one small PNG each (title -> bytes), for the markdown report: watermark vs wall clock,
    finalization lag per hour, late records per hour (the newest MARKDOWN_ROWS hours)."""
    from PIL import Image

    plt = _pyplot()
    recent = FinalizationPicture(picture.table, picture.policy, picture.watermark_us, picture.steps, picture.hours[-MARKDOWN_ROWS:])
    series = _hour_series(recent)
    out = {}
    for title in MARKDOWN_PLOTS:
        fig, ax = plt.subplots(figsize=PLOT_SIZE_INCHES, constrained_layout=True)
        if title in series:
            _draw_bars(ax, recent.hour_times, series[title], title)
        else:
            _draw_watermark(ax, recent)
        ax.tick_params(labelsize="small")
        raw = io.BytesIO()
        fig.savefig(raw, dpi=PLOT_DPI, format="png")
        plt.close(fig)
        small = io.BytesIO()  # a palette image: line plots need few colours, and the report is stored on every refresh
        Image.open(raw).convert("RGB").quantize(colors=PLOT_COLORS).save(small, format="PNG", optimize=True)
        out[title] = small.getvalue()
    return out


def write_report(picture: FinalizationPicture, out_dir: Path) -> tuple[Path, Path]:
    """Write <out_dir>/<table>.html and <out_dir>/<table>.png of a picture (finalization_picture); returns their paths."""
    return write_html(picture, out_dir / f"{picture.table}.html"), write_png(picture, out_dir / f"{picture.table}.png")


def report_dir(home: Path) -> Path:
    """Where reports go by default: $PARTFIN_HOME/reports."""
    return home / "reports"


def report_is_stale(path: Path, max_age_s: float) -> bool:
    """Whether a report file is missing or older than `max_age_s` (the sync job refreshes it at most that often)."""
    import time

    return not path.exists() or time.time() - path.stat().st_mtime > max_age_s
