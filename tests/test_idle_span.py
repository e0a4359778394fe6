"""A pipeline rank's idle over the span of the step its ranks run together (toolkit/observe/idle.py)."""

from __future__ import annotations

import pytest

from toolkit.observe.idle import idle_over_span


def _rank(windows, *, group=0, host="a", own=0.5):
    return {"stages": [0], "bubble_measured": own, "p2p_measured": 0.0, "step_windows": windows,
            "span_group": group, "host": host}


def test_a_rank_that_finishes_early_idles_until_the_last_rank_of_its_step_is_done():
    # step 1: rank 0 from 0 to 9 s working 8 (and 0.5 posting), rank 1 from 0.5 to 8 working 6; step 2 likewise
    # 10 s later; span 9 s: rank 0 idles 0.5/9, rank 1 (its own call 7.5 s) idles 3/9, not 1.5/7.5
    ranks = [_rank([(0.0, 9.0, 8.0, 0.5), (10.0, 19.0, 8.0, 0.5)]),
             _rank([(0.5, 8.0, 6.0, 0.0), (10.5, 18.0, 6.0, 0.0)])]
    out = idle_over_span(ranks)
    assert out[0]["bubble_measured"] == pytest.approx(0.5 / 9)
    assert out[0]["p2p_measured"] == pytest.approx(0.5 / 9)
    assert out[1]["bubble_measured"] == pytest.approx(3 / 9)
    assert all(not {"step_windows", "span_group", "host"} & set(m) for m in out)  # not written to run.json
    assert "step_windows" in ranks[0]  # the gathered measurements themselves are not changed


def test_each_replica_is_its_own_span_and_ranks_on_several_hosts_keep_their_own_idle():
    replicas = [_rank([(0.0, 9.0, 8.0, 0.0)], group=0), _rank([(0.0, 4.0, 2.0, 0.0)], group=1),
                _rank([(0.0, 9.0, 6.0, 0.0)], group=0), _rank([(0.0, 2.0, 2.0, 0.0)], group=1)]
    out = idle_over_span(replicas)
    assert [m["bubble_measured"] for m in out] == pytest.approx([1 / 9, 0.5, 1 / 3, 0.5])
    hosts = idle_over_span([_rank([(0.0, 9.0, 8.0, 0.0)], host="a"), _rank([(0.0, 4.0, 2.0, 0.0)], host="b")])
    assert [m["bubble_measured"] for m in hosts] == [0.5, 0.5]  # clocks of two machines are not compared
    assert idle_over_span([None, {}]) == [None, {}]  # strategies that measure nothing
