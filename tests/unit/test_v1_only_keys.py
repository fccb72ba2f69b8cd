"""Keys only verl 0.9.1's v1 trainer reads are refused at start-up, naming the key, when a verl-partial group moved
the job to the legacy trainer (issue 26, finding 8): on the legacy trainer they would be silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
import verl
from omegaconf import OmegaConf
from test_plugin_and_config import compose

from verl_partial.config.job import validate_root_config
from verl_partial.config.v1_only_keys import V1_ONLY_KEYS

VERL = Path(verl.__file__).parent


def test_every_listed_key_holds_verls_default_in_verls_own_config():
    """The table's defaults are verl 0.9.1's (a composed ppo_trainer), so an untouched config passes."""
    config = compose()
    for entry in V1_ONLY_KEYS:
        value = OmegaConf.select(config, entry.key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        assert value == entry.default, entry.key
    validate_root_config(compose("partial/default"))


@pytest.mark.parametrize("key", ["filter_groups", "checkpoint_callback_class", "max_off_policy_threshold"])
def test_each_listed_key_is_read_only_by_verls_v1_trainer(key):
    """The reason a key is listed: grep of verl's wheel finds readers under trainer/ppo/v1/ and no other (the config
    schema and the v1 checkpoint-callback builder aside, which only v1 calls)."""
    readers = {
        path.relative_to(VERL).as_posix()
        for path in VERL.rglob("*.py")
        if key in path.read_text(errors="ignore") and not path.relative_to(VERL).as_posix().startswith("trainer/config")
    }
    assert readers, key
    allowed = ("trainer/ppo/v1/", "utils/tracking.py", "trainer/ppo/checkpoint_callback.py")
    assert all(reader.startswith(allowed) for reader in readers), readers


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("algorithm.filter_groups.enable", True),
        ("trainer.checkpoint_callback_class", "my.module.Callback"),
        ("trainer.v1.trainer_mode", "colocate_async"),
        ("trainer.v1.sampler.max_off_policy_threshold", 2),
        ("trainer.v1.separate_async.parameter_sync_step", 1),
    ],
)
@pytest.mark.parametrize("group", ["partial/default", "backend/cpu"])
def test_a_v1_only_key_set_with_our_groups_is_refused_naming_it(group, key, value):
    """Before: accepted, and the legacy trainer silently did without (no DAPO filtering, no checkpoint callback)."""
    if group == "partial/default" and key == "algorithm.filter_groups.enable":
        pytest.skip("+partial filters groups itself: test_filter_groups_is_honoured_with_partial")
    config = compose(group, **{key.replace(".", "__"): value})
    with pytest.raises(ValueError) as refused:
        validate_root_config(config)
    message = str(refused.value)
    assert f"{key}={value!r}" in message and "trainer.use_v1=false" in message


def test_v1_only_keys_are_left_alone_on_verls_v1_trainer():
    """Without a verl-partial group that moves the job, verl's v1 trainer reads them: nothing to refuse."""
    validate_root_config(compose(algorithm__filter_groups__enable=True, trainer__v1__trainer_mode="colocate_async"))


def test_filter_groups_is_honoured_with_partial():
    """DAPO's dynamic sampling is implemented by +partial's pool (verl_partial.core.partial.group_filter): accepted
    there, read into the pool's group filter; still refused with +backend alone (nothing would filter)."""
    from verl_partial.config.job import group_filter_of
    from verl_partial.core.partial.group_filter import GroupFilter

    config = compose(
        "partial/default",
        algorithm__filter_groups__enable=True,
        algorithm__filter_groups__metric="acc",
        algorithm__filter_groups__max_num_gen_batches=3,
    )
    validate_root_config(config)
    assert group_filter_of(config) == GroupFilter(metric="acc", max_num_gen_batches=3)
    assert group_filter_of(compose("partial/default")) is None


def test_filter_groups_with_a_colocated_reward_model_is_refused():
    """The filter needs rewards during generation (verl's reward loop); a colocated reward model scores in fit()."""
    config = compose(
        "partial/default",
        algorithm__filter_groups__enable=True,
        reward__reward_model__enable=True,
        reward__reward_model__enable_resource_pool=False,
    )
    with pytest.raises(ValueError, match=r"algorithm\.filter_groups\.enable=true.*enable_resource_pool"):
        validate_root_config(config)
