"""Finalization tags on base.<table>: one per finalization and amendment, kept for their
max-ref-age by snapshot expiry, and dropped by a privacy delete when they hold an erased key."""

from __future__ import annotations

from partfin_assets.iceberg.expiry import Retention, expire_snapshots
from partfin_assets.iceberg.tables import read_base
from partfin_assets.jobs.privacy import privacy_delete
from partfin_assets.model.stats import CommitWindow
from partfin_assets.model.timeutil import to_us
from partfin_assets_tests.scenario_helpers import partfin
from partfin_assets_tests.test_upsert import T0, Harness

HOUR = to_us(T0)


def refs(h: Harness) -> dict[str, int]:
    return {name: ref.snapshot_id for name, ref in h.base().metadata.refs.items() if name.startswith("finalized-")}


def upserted(h: Harness, changes) -> int:
    h.write(changes)
    h.upsert()
    return h.base().current_snapshot().snapshot_id


def test_a_finalization_and_each_amendment_get_a_tag_once(tmp_path):
    from partfin_assets.finalization.tags import Finalization, tag_finalizations

    h = Harness(tmp_path)
    first = upserted(h, [(1, "c", 0, 1, 1.0)])
    assert tag_finalizations(h.catalog, "base.orders", [Finalization(HOUR, first, False)]) == ["finalized-2024-05-01-10"]
    assert tag_finalizations(h.catalog, "base.orders", [Finalization(HOUR, first, False)]) == []  # a repeated tick
    late = upserted(h, [(2, "c", 5, 2, 2.0)])
    assert tag_finalizations(h.catalog, "base.orders", [Finalization(HOUR, late, True)]) == ["finalized-2024-05-01-10-amend-1"]
    assert tag_finalizations(h.catalog, "base.orders", [Finalization(HOUR, late, True)]) == []
    later = upserted(h, [(3, "c", 6, 3, 3.0)])
    assert tag_finalizations(h.catalog, "base.orders", [Finalization(HOUR, later, True), Finalization(HOUR + 3_600_000_000, later, False)]) == [
        "finalized-2024-05-01-10-amend-2", "finalized-2024-05-01-11"]
    assert refs(h) == {"finalized-2024-05-01-10": first, "finalized-2024-05-01-10-amend-1": late,
                       "finalized-2024-05-01-10-amend-2": later, "finalized-2024-05-01-11": later}
    shown = partfin(tmp_path, "status")  # how a user finds them
    assert shown.returncode == 0, shown.stderr
    assert ("base.orders: 4 finalized hour(s) tagged, finalized-2024-05-01-10 .. finalized-2024-05-01-11" in shown.stdout
            and "FOR VERSION AS OF 'finalized-2024-05-01-11'" in shown.stdout)


def test_expiry_keeps_what_tags_hold_until_their_max_age(tmp_path):
    from partfin_assets.finalization.tags import Finalization, tag_finalizations

    h = Harness(tmp_path)
    tagged = upserted(h, [(1, "c", 0, 1, 1.0)])
    tag_finalizations(h.catalog, "base.orders", [Finalization(HOUR, tagged, False)])
    for i in range(2, 6):
        upserted(h, [(1, "u", i, i, float(i))])
    now_ms = h.base().metadata.snapshot_by_id(tagged).timestamp_ms
    expire_snapshots(h.base(), Retention(keep_last=1, slack=0), CommitWindow(commits=1), now_ms=now_ms + 3_600_000)
    assert refs(h) == {"finalized-2024-05-01-10": tagged} and h.base().metadata.snapshot_by_id(tagged) is not None
    assert read_base(h.catalog, "orders", snapshot_id=tagged).column("amount").to_pylist() == [1.0]
    eight_days = 8 * 24 * 3_600_000  # past the default max-ref-age (7 days)
    expire_snapshots(h.base(), Retention(keep_last=1, slack=0), CommitWindow(commits=1), now_ms=now_ms + eight_days)
    assert refs(h) == {} and h.base().metadata.snapshot_by_id(tagged) is None


def test_a_privacy_delete_drops_the_tags_that_hold_an_erased_key(tmp_path):
    from partfin_assets.finalization.tags import Finalization, tag_finalizations

    h = Harness(tmp_path)
    before_key = upserted(h, [(1, "c", 0, 1, 1.0)])
    with_key = upserted(h, [(7, "c", 70, 2, 7.0)])
    tag_finalizations(h.catalog, "base.orders", [Finalization(HOUR, before_key, False), Finalization(HOUR + 3_600_000_000, with_key, False)])
    h.writer.close()
    privacy_delete(h.catalog, "orders", [{"id": 7}], request_id="req-7")
    assert refs(h) == {"finalized-2024-05-01-10": before_key}  # the hour tagged before key 7 existed holds nothing of it
    assert 7 not in read_base(h.catalog, "orders", include_deleted=True).column("id").to_pylist()
