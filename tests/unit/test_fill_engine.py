"""``partial.fill_engine``: admission follows the engines' free slots within the staleness bound (issue 25, item 5).

Through the real scheduler over the simulated engine (``sim_engine.py``): on a server that never fills, admission
by finished groups leaves slots idle while a group's last samples decode; filling admits whole groups into them, up to
``(1 + max_staleness) x batch`` groups held. On a server that queues, there is no free slot, and admission is the
refill's alone.
"""

from __future__ import annotations

import dataclasses

import pytest
from sim_engine import SimEngine, SimServer
from test_partial_scheduler import check_groups, check_ledger, simulate

from verl_partial.config.partial import PRESETS, PartialConfig
from verl_partial.core.partial.pool import RolloutPool

N, BATCH, LENGTH, SEED = 4, 4, 200, 3


def run(config: PartialConfig, max_num_seqs: int, steps: int = 5):
    engine = SimEngine(SEED, LENGTH, [SimServer("s0", max_num_seqs=max_num_seqs)])
    return simulate(config, n=N, batch=BATCH, steps=steps, response_length=LENGTH, seed=SEED, engine=engine)


def test_a_server_that_never_fills_gets_more_groups_and_nothing_breaks():
    """64 slots for 16 samples: by finished groups a group's slot is refilled only once all its samples are done;
    filling admits whole groups into the free slots (up to 8 groups held at max_staleness 1), and still trains exactly
    the batch each step, exact tokens, staleness <= 1, nothing lost or discarded."""
    by_groups = run(dataclasses.replace(PRESETS["default"], fill_engine=False), max_num_seqs=64)
    filling = run(PRESETS["default"], max_num_seqs=64)
    for r in (by_groups, filling):
        check_groups(r.trained, r.pool.config, N, BATCH, LENGTH, SEED)  # exact tokens, versions, staleness <= 1
        check_ledger(r, BATCH, 0)
        assert sum(m["partial/tokens_discarded"] for m in r.metrics) == 0
    # The same groups' worth of training in less rollout time (virtual seconds, a server whose step time does not
    # grow with its batch): the groups admitted early ran in slots the refill left idle until a whole group finished.
    assert sum(filling.seconds) < 0.9 * sum(by_groups.seconds)


def test_a_server_that_queues_gets_no_extra_group():
    """2 slots for 16 samples: the refill keeps more samples open than the engine runs, so filling never finds a
    free slot for a whole group and admits nothing the refill would not: the same groups train in the same steps."""
    by_groups = run(dataclasses.replace(PRESETS["default"], fill_engine=False), max_num_seqs=2)
    filling = run(PRESETS["default"], max_num_seqs=2)
    assert filling.pool.totals.admitted_groups == by_groups.pool.totals.admitted_groups
    assert [[g.key for g in step] for step in filling.trained] == [[g.key for g in step] for step in by_groups.trained]


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_the_pool_never_holds_more_than_the_staleness_bound(max_staleness: int):
    """Whatever the free slots, at most ``(1 + max_staleness) x batch`` groups are held; a group needs a free slot for
    every one of its samples."""
    config = PartialConfig(max_staleness=max_staleness)
    pool: RolloutPool = RolloutPool(
        config, group_size=N, batch_groups=BATCH, response_length=LENGTH, engine_slots=10_000
    )
    pool.begin_step(1, 0)
    while pool.free_slots():
        pool.admit(len(pool.groups), f"p{len(pool.groups)}")
    assert len(pool.groups) == (1 + max_staleness) * BATCH
    tight: RolloutPool = RolloutPool(config, group_size=N, batch_groups=BATCH, response_length=LENGTH, engine_slots=23)
    tight.begin_step(1, 0)
    while tight.free_slots():
        tight.admit(len(tight.groups), f"p{len(tight.groups)}")
    assert len(tight.groups) == BATCH + 1  # the batch (refill's floor), then one whole group in 23 - 16 = 7 slots


def test_without_the_engines_slots_the_pool_refuses_to_guess():
    pool: RolloutPool = RolloutPool(PartialConfig(), group_size=N, batch_groups=1, response_length=LENGTH)
    pool.begin_step(1, 0)
    pool.admit("a", "a")
    with pytest.raises(RuntimeError, match="partial.fill_engine needs the engines' sample slots"):
        pool.free_slots()


def test_presets_that_fix_their_over_provisioning_do_not_fill():
    """restart and kimi keep their literature's fixed extra groups, on_policy has no room at staleness 0."""
    assert PRESETS["default"].fill_engine and PRESETS["tail"].fill_engine
    assert not any(PRESETS[name].fill_engine for name in ("restart", "kimi", "on_policy", "tail_on_policy"))
