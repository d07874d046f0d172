"""benchmarks/kvmerger_collapse.py: where a loop starts, and the per-compression record on a cache whose
protected entries and pivots overflow keep (overflow="slot_order", the old default, drops the newest entry; "tiered", the default, keeps it)."""

from __future__ import annotations

from benchmarks.kvmerger_collapse import compression_record, loop_start, summarize_events
from kvpass.policies.kvmerger import KVMerger
from tests.policies.test_kvmerger import overflowing_cache


def test_loop_start_finds_the_periodic_tail():
    assert loop_start([5, 6, 7, 8, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2]) == 4     # period 2 from index 4
    assert loop_start([3, 4] + [9] * 10) == 2                              # a stutter
    assert loop_start(list(range(20))) is None                             # no repeat
    assert loop_start([1, 2, 3, 1, 2, 3]) is None                          # tail shorter than 8 tokens


def test_compression_record_counts_the_dropped_newest_entry():
    cache = overflowing_cache()
    keep = 12
    records = {}
    for overflow in ("slot_order", "tiered"):
        pol = KVMerger(value_scale="none", overflow=overflow)
        records[overflow] = compression_record(pol, cache, keep, pol.compress(cache, keep))
    old, new = records["slot_order"], records["tiered"]
    assert old["newest_kept"] == 0 and old["newest_pos_kept"] < cache.capacity - 1
    assert new["newest_kept"] == 1 and new["newest_pos_kept"] == cache.capacity - 1
    assert new["recent_kept"] == new["recent"] > old["recent_kept"]
    assert old["sets"] == new["sets"] > 0 and new["pivots_kept"] < old["pivots_kept"]
    assert new["max_log_size_held"] > 0                                    # log|S| bias (value_scale="none")
    ev = summarize_events([old, new], layers=2)
    assert len(ev) == 1 and ev[0]["newest_kept"] == 1 and ev[0]["sets"] == 2 * old["sets"]
