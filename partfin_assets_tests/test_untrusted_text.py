"""Text from outside shown where partfin renders it: on a terminal, in the Dagster UI's markdown, in the HTML report.

Each place is fed hostile text the way a user or another engine writes it: an acknowledgement's reason and author
(`partfin late-data ack --reason/--by`: a screen clear, a bell, an OSC 52 clipboard write, a newline forging a status
line), a privacy request id, the `partfin.watermark.policy` table property set by another engine (an `<img onerror>`,
a `javascript:` link, matplotlib mathtext, a terminal title escape), a writer id holding rich console markup
(`ops[/]team`). Whatever the text, it is shown as written, visibly, on its own line, and acts on nothing
(model/display_text.py); `--json` keeps it exactly.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import pty
import re
import subprocess

import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance
from markdown_it import MarkdownIt

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets.model import summary_keys as K
from partfin_assets.model.display_text import terminal_text
from partfin_assets.sources.synthetic import ORDERS_SPEC
from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.cdc_files import partfin, partfin_command, partfin_env
from partfin_assets_tests.test_kafka_cluster import produce
from partfin_assets_tests.test_kafka_source import kafka_spec

pytestmark = pytest.mark.timeout(600)

# a finished synthetic stream with late records in hours that are final (as test_dagster_defs.py)
STREAM = "synthetic:start=2026-01-01T00:00:00Z,end=2026-01-01T06:30:00Z,rate=0.5,late_fraction=0.02,idle_every=off,seed=5"
POLICY = "percentile:0.05:last:2"
REASON = "x\x1b[2J\x07\nfake line"  # clear the screen, ring the bell, then a line of its own
BY = "eve\x1b]52;c;ZXZpbA==\x07"  # OSC 52: write "evil" to the clipboard
REQUEST_ID = "req-7\x1b[2J\nprivacy delete done"
HOSTILE_POLICY = "<img src=x onerror=alert(1)> [x](javascript:alert(1)) $\\nope{$ | \x1b]0;pwned\x07"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what a terminal acts on (a newline ends a line: counted apart)


def _ingested(tmp_path):
    home = tmp_path / "home"
    done = partfin(home, "ingest", "--table", "orders", "--source", STREAM, "--watermark-policy", POLICY, "--checkpoint-records", "400")
    assert done.returncode == 0, done.stderr
    return home


def _set_policy_property(home, text: str) -> None:
    """What another engine (Spark's ALTER TABLE ... SET TBLPROPERTIES, PyIceberg) may write."""
    with load_partfin_catalog(home).load_table("cdc.orders").transaction() as tx:
        tx.set_properties({K.PROP_WATERMARK_POLICY: text})


def _assert_plain(text: str) -> None:
    assert not CONTROL.search(text), repr(text)


def test_status_ack_and_privacy_delete_show_outside_text_escaped_on_its_own_line(tmp_path):
    home = _ingested(tmp_path)
    assert json.loads(partfin(home, "status", "--json").stdout)["tables"][0]["late_records"] > 0

    ack = partfin(home, "late-data", "ack", "--table", "orders", "--all", "--reason", REASON, "--by", BY)
    assert ack.returncode == 0, ack.stderr
    _assert_plain(ack.stdout)
    assert not any(line.startswith("fake line") for line in ack.stdout.splitlines())
    deleted = partfin(home, "privacy-delete", "--table", "orders", "--key", '{"id": 1}', "--request-id", REQUEST_ID)
    assert deleted.returncode == 0, deleted.stderr
    _assert_plain(deleted.stdout)
    assert deleted.stdout.startswith(r"privacy delete req-7\x1b[2J\nprivacy delete done (1 key(s)") and deleted.stdout.count("\n") == 1
    _set_policy_property(home, HOSTILE_POLICY)

    status = partfin(home, "status")
    assert status.returncode == 0, status.stderr
    _assert_plain(status.stdout)
    lines = status.stdout.splitlines()
    assert not any(line.startswith("fake line") for line in lines)  # no forged line
    acknowledged = [line for line in lines if " acknowledged by " in line]
    assert acknowledged and all(r"by eve\x1b]52;c;ZXZpbA==\x07 at " in line and line.endswith(r": x\x1b[2J\x07\nfake line") for line in acknowledged)
    assert r"<img src=x onerror=alert(1)> [x](javascript:alert(1)) $\nope{$ | \x1b]0;pwned\x07" in status.stdout  # shown, not acted on
    # nothing lost: the machine-readable form keeps the text exactly
    tables = {t["name"]: t for t in json.loads(partfin(home, "status", "--json").stdout)["tables"]}
    assert {(a["reason"], a["by"]) for a in tables["cdc.orders"]["acknowledged_late_hours"]} == {(REASON, BY)}
    assert tables["cdc.orders"]["policy"] == HOSTILE_POLICY

    report = partfin(home, "report", "--table", "orders", "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr  # the policy's `$...$` is drawn as text, not read as mathtext
    page = (tmp_path / "report" / "orders.html").read_text()
    facts = re.search(r"<table id='policy'>(.*?)</table>", page).group(1)
    assert "<img" not in facts and "\x1b" not in page
    assert f"<td>{html.escape(terminal_text(HOSTILE_POLICY))}</td>" in facts
    assert (tmp_path / "report" / "orders.png").read_bytes().startswith(b"\x89PNG")

    # a log line quoting the property (a declared policy replaces it) is one line too
    declared = partfin(home, "ingest", "--table", "orders", "--source", STREAM, "--watermark-policy", POLICY)
    assert declared.returncode == 0, declared.stderr
    _assert_plain(declared.stderr)
    (warning,) = [line for line in declared.stderr.splitlines() if "watermark policy declared" in line]
    assert warning.endswith(f"(was {terminal_text(HOSTILE_POLICY)}): it takes effect with the next checkpoint")


def test_ingest_on_a_terminal_shows_a_writer_id_holding_console_markup_as_written(tmp_path, kafka_cluster):
    """The live progress line on a terminal (rich) names a Kafka partition's stream, `<writer id>/<topic>-<partition>`:
    markup in it (`[/]` closes a style nobody opened) is shown as written, never read."""
    topic = "dbserver1.public.orders"
    kafka_cluster.create_topic(topic, 1)
    produce(kafka_cluster, topic, [dbz.change(i, "c", 1_793_491_200_000 + i * 60_000) for i in range(1, 40)])
    command = partfin_command("ingest", "--table", "orders", "--source", kafka_spec(kafka_cluster, topic), "--primary-key", "id",
                              "--writer-id", "ops[/]team", "--max-checkpoints", "1")
    main, terminal = pty.openpty()
    process = subprocess.Popen(command, env=partfin_env(tmp_path / "home"), stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    code = process.wait(timeout=120)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode(errors="replace"))  # the terminal's own styling
    assert "MarkupError" not in text and "Traceback" not in text, text
    if code == 2:  # writer ids may refuse these characters: then in one line, as any refusal
        assert text.strip().startswith("partfin: error:") and text.strip().count("\n") == 0, text
        return
    assert code == 0, text
    assert f"partition ops[/]team/{topic}-0" in text, text


def test_the_dagster_report_shows_a_hostile_policy_property_as_text(tmp_path, monkeypatch):
    """The finalization report in Dagster's metadata (markdown the UI renders): a policy property another engine set
    is one table cell of literal text: no HTML, no link, no image but partfin's own plots."""
    from partfin_assets.defs import build_definitions
    from partfin_assets.defs.tables import PartfinTable

    home = _ingested(tmp_path)
    monkeypatch.setenv("PARTFIN_HOME", str(home))
    monkeypatch.setenv("PARTFIN_SOURCE", STREAM)
    monkeypatch.setenv("PARTFIN_PARTITIONS_START", "2026-01-01-00:00")
    monkeypatch.delenv("PARTFIN_CATALOG_URI", raising=False)
    monkeypatch.delenv("PARTFIN_CATALOG", raising=False)
    _set_policy_property(home, HOSTILE_POLICY)
    table = PartfinTable(spec=dataclasses.replace(ORDERS_SPEC, watermark_policy=POLICY), source=STREAM)
    defs = build_definitions([table])
    with DagsterInstance.ephemeral() as instance:
        # base_orders alone: the upsert, then the report (the sync's last step); no writer, which would replace the property
        run = defs.resolve_implicit_global_asset_job_def().execute_in_process(instance=instance, asset_selection=[AssetKey("base_orders")])
        assert run.success
        (observed,) = [r.event_log_entry.asset_observation.metadata
                       for r in instance.fetch_observations(AssetRecordsFilter(asset_key=AssetKey("report_orders")), limit=10).records]
    report = observed["finalization_report"].value
    assert observed["watermark policy"].value == HOSTILE_POLICY  # plain-text metadata: the value as it is

    # as a renderer that lets raw HTML and every link scheme through would read it
    markdown = MarkdownIt("commonmark", {"html": True}).enable("table")
    markdown.validateLink = lambda url: True
    tokens = [t for block in markdown.parse(report) for t in [block, *(block.children or [])]]
    assert not [t for t in tokens if t.type in ("html_inline", "html_block", "link_open")]
    images = [t.attrGet("src") for t in tokens if t.type == "image"]
    assert len(images) == 3 and all(src.startswith("data:image/png;base64,") for src in images)
    rendered = markdown.render(report)
    assert f"<td>watermark policy</td>\n<td>{html.escape(terminal_text(HOSTILE_POLICY), quote=False)}</td>" in rendered
    assert "\x1b" not in report


NASTY = ["plain text, as it is", HOSTILE_POLICY, REASON, BY, "a\u202eb\u2028c\x00d\x85e\x7f", "*em* _u_ `code` # h | a | \\ & &amp; <b>",
         "![i](https://x/t.png) <https://x> [r]: https://x \"t\"", "1. x", "- y", "é 漢字 🙂"]


@pytest.mark.parametrize("text", NASTY)
def test_each_target_shows_the_text_as_written_and_nothing_else(text):
    from partfin_assets.model.display_text import html_text, markdown_text

    shown = terminal_text(text)
    assert shown.isprintable() and "\n" not in shown
    assert all(c in shown for c in text if c.isprintable())  # nothing dropped
    assert terminal_text("plain, printable: kept as it is é🙂") == "plain, printable: kept as it is é🙂"
    # markdown: a CommonMark + GFM-table parser that lets raw HTML and any link through reads back the very text
    markdown = MarkdownIt("commonmark", {"html": True}).enable("table")
    markdown.validateLink = lambda url: True
    (cell,) = [t for t in markdown.parse(f"| x |\n|---|\n| {markdown_text(text)} |") if t.type == "inline"][1:]
    assert [t.type for t in cell.children] == ["text"] and cell.children[0].content == shown
    assert html_text(text) == html.escape(shown)
