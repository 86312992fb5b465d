"""The rule the Redis channel applies to the sentinels' answers, for every mix of answers.

The key cache's channel trusts the master it is subscribed to when a majority of the
sentinels name it cleanly and no sentinel that sees the master disputes it
(`apikeys.stores.redis.channel`). The live behaviour is tested on a real Sentinel set in
`tests/test_redis_topology.py` and `tests/test_redis_deployments.py`.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from apikeys.stores.redis.channel import _sentinel_verdict

SUBSCRIBED = ("10.0.0.1", 6379)
ELSEWHERE = ("10.0.0.2", 6379)
LINK = {"s_down", "disconnected"}
FAILOVER = {"o_down", "failover_in_progress", "promoted"}

answers_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "where": st.sampled_from([SUBSCRIBED, ELSEWHERE]),
            "flags": st.sets(st.sampled_from(sorted(LINK | FAILOVER))).map(
                lambda flags: {"master", *flags}
            ),
        }
    ).map(lambda a: {"ip": a["where"][0], "port": a["where"][1], "flags": a["flags"]}),
    max_size=5,
)


def trusted(answers: list[dict[str, Any]], sentinels: int) -> bool:
    doubt, named = _sentinel_verdict(answers, SUBSCRIBED)
    return not doubt and named >= sentinels // 2 + 1


@given(answers_strategy, st.integers(min_value=0, max_value=3))
def test_the_master_is_trusted_only_when_a_majority_names_it_and_none_that_sees_disputes(
    answers: list[dict[str, Any]], silent: int
) -> None:
    sentinels = len(answers) + silent  # `silent` ones did not answer in time
    clean = [a for a in answers if a["flags"] == {"master"}]
    naming = [a for a in clean if (a["ip"], a["port"]) == SUBSCRIBED]
    disputing = [a for a in clean if (a["ip"], a["port"]) != SUBSCRIBED]
    failover = [a for a in answers if a["flags"] & FAILOVER]
    expected = not disputing and not failover and len(naming) >= sentinels // 2 + 1
    assert trusted(answers, sentinels) == expected
    doubt, _ = _sentinel_verdict(answers, SUBSCRIBED)
    # The split-brain guard: another master named by one that sees it, or a failover
    # flagged, holds the store (a doubt), whatever the others say.
    assert bool(doubt) == bool(disputing or failover)


@given(st.integers(min_value=1, max_value=5))
def test_a_sentinel_that_cannot_see_the_master_is_no_veto(others: int) -> None:
    answers = [{"ip": SUBSCRIBED[0], "port": SUBSCRIBED[1], "flags": {"master"}}] * others
    cut_off = {"ip": ELSEWHERE[0], "port": ELSEWHERE[1], "flags": {"master", "s_down"}}
    assert trusted([*answers, cut_off], others + 1) == (others >= (others + 1) // 2 + 1)
