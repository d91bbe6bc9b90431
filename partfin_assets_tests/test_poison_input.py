"""One bad message never stops a table, as `partfin ingest` meets it.

Whatever a single message does to the decoder (nesting deep enough to exhaust Python's recursion,
a line over the size limit, a value a library chokes on), it goes to `cdc.<t>__rejected` with its
reason and position, and every good message after it lands; through Kafka, one poisoned message in
one partition stops neither that partition nor the others.
"""

from __future__ import annotations

import json

import pyarrow.compute as pc
import pytest

from partfin_assets.iceberg.catalog import load_partfin_catalog
from partfin_assets_tests import debezium_messages as dbz
from partfin_assets_tests.debezium_lines import change_line
from partfin_assets_tests.test_bad_input import MINUTE_MS, T0_MS, table_rows, write_lines
from partfin_assets_tests.test_cli import partfin

SIZE_LIMIT = 65_536  # PARTFIN_MAX_MESSAGE_BYTES for these tests: a "huge" line need not be 64 MiB here
DEEP = '{"schema":null,"payload":' + "[" * 5_000 + "]" * 5_000 + "}"  # 10 KB, 5,000 levels deep
POISON = {
    "deep-nesting": (DEEP, "nested deeper than"),
    "huge-line": (change_line({"id": 500, "amount": 1.0, "note": "x" * (2 * SIZE_LIMIT)}, T0_MS), "over the limit"),
    # a lone UTF-16 surrogate: valid JSON, but no UTF-8 text (pyarrow refuses it when the batch is built)
    "lone-surrogate": (change_line({"id": 501, "amount": 1.0, "note": "\ud800"}, T0_MS), "UTF-8"),
}


def good_lines(start: int, count: int) -> list[str]:
    return [change_line({"id": i, "amount": float(i), "note": None}, T0_MS + i * MINUTE_MS) for i in range(start, start + count)]


@pytest.mark.parametrize("poison", list(POISON))
def test_a_poisoned_debezium_line_is_rejected_and_the_good_lines_after_it_land(tmp_path, poison):
    line, reason_part = POISON[poison]
    path = write_lines(tmp_path / "changes.jsonl", [*good_lines(0, 10), line, *good_lines(10, 20)])
    args = ("ingest", "--table", "shop", "--source", f"debezium:{path}", "--primary-key", "id", "--checkpoint-records", "7")
    env = {"PARTFIN_MAX_MESSAGE_BYTES": str(SIZE_LIMIT)}

    first = partfin(tmp_path, *args, env_extra=env)
    again = partfin(tmp_path, *args, env_extra=env)
    cdc = table_rows(tmp_path, "cdc.shop")
    rejected = table_rows(tmp_path, "cdc.shop__rejected")
    print(f"\n{poison}: exit {first.returncode}, again {again.returncode}; stderr tail {first.stderr.strip().splitlines()[-1:]}; "
          f"cdc rows {getattr(cdc, 'num_rows', None)} of 30; rejected {getattr(rejected, 'num_rows', None)}")

    assert first.returncode == 0, first.stderr
    assert again.returncode == 0, again.stderr
    assert cdc.num_rows == 30 and sorted(pc.cast(cdc.column("source_seq"), "int64").to_pylist()) == [*range(1, 11), *range(12, 32)]
    assert rejected.column("source_seq").to_pylist() == [11]  # once, at its line
    (reason,) = rejected.column("reason").to_pylist()
    assert reason.startswith("line 11: ") and reason_part in reason, reason
    (raw,) = rejected.column("raw").to_pylist()
    if poison == "huge-line":
        assert len(raw.encode()) <= SIZE_LIMIT and line.startswith(raw)  # its head, as evidence; the reason says where it is
        assert "byte" in reason
    elif poison == "deep-nesting":
        assert raw == line


def test_the_size_limit_is_explicit_and_a_bad_setting_is_one_line(tmp_path):
    path = write_lines(tmp_path / "changes.jsonl", good_lines(0, 3))
    result = partfin(tmp_path, "ingest", "--table", "shop", "--source", f"debezium:{path}", "--primary-key", "id",
                     env_extra={"PARTFIN_MAX_MESSAGE_BYTES": "lots"})
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "PARTFIN_MAX_MESSAGE_BYTES" in result.stderr


TOPIC = "dbserver1.public.orders"


def test_a_poisoned_kafka_message_in_one_partition_stops_no_partition(tmp_path, kafka_cluster):
    """Partition 1 holds a message nested 5,000 deep between good ones: all 30 good messages of the three
    partitions land, the poisoned one is in cdc.orders__rejected with its topic, partition and offset."""
    from partfin_assets_tests.test_kafka_source import kafka_spec, produce_to, run_ingest

    kafka_cluster.create_topic(TOPIC, 3)
    for partition in range(3):
        ids = range(partition * 10, partition * 10 + 10)
        messages = [dbz.change(i, "c", T0_MS + n * 60_000, version=0) for n, i in enumerate(ids)]
        if partition == 1:
            messages.insert(4, dbz.DebeziumMessage(b'{"id":14}', DEEP.encode(), T0_MS))
        produce_to(kafka_cluster, partition, messages)
    home = tmp_path / "home"
    stderr = run_ingest(home, kafka_spec(kafka_cluster), "--checkpoint-records", "3")
    print(f"\nlast progress line: {stderr.strip().splitlines()[-1:]}")

    catalog = load_partfin_catalog(home)
    cdc = catalog.load_table("cdc.orders").scan().to_arrow()
    assert sorted(json.loads(k)["id"] for k in cdc.column("key").to_pylist()) == list(range(30))
    rejected = catalog.load_table("cdc.orders__rejected").scan().to_arrow()
    assert rejected.column("source_log").to_pylist() == [f"orders-writer/{TOPIC}-1"] and rejected.column("source_seq").to_pylist() == [4]
    assert "nested deeper than" in rejected.column("reason").to_pylist()[0]
