"""Bad configurations fail in the driver, before Ray starts, naming the full config key.

Each row is a command line of ``python -m verl.trainer.main_ppo``: composed by real Hydra with our
groups and run through verl's own ``main()`` up to ``run_ppo`` (``driver_entry.run_driver``).
A row passes only if the driver raises and the message names the key; ``run_ppo`` is the last
call of ``main()``, so a raise means no bad value reached Ray, the TaskRunner or any worker. A
row that the driver accepts fails as "silently accepted".
"""

from __future__ import annotations

import pytest
from driver_entry import model_override, run_driver

from verl_partial.config.partial import STATE_FILE

P = "+partial=default"
RC = "+rollout_correction"

# (command-line overrides, the full key the error must name)
BAD_CONFIGS: list[tuple[tuple[str, ...], str]] = [
    # --- partial rollout -------------------------------------------------------------------------
    ((P, "partial.extra_groups=-2"), "partial.extra_groups"),
    ((P, "partial.extra_groups=1.5"), "partial.extra_groups"),
    ((P, "partial.staleness_policy=ignore"), "partial.staleness_policy"),
    ((P, "+partial.no_such_knob=1"), "partial.no_such_knob"),
    ((P, "partial.max_staleness=-1"), "partial.max_staleness"),
    ((P, "partial.max_retries=-1"), "partial.max_retries"),
    ((P, "partial.request_timeout_s=0"), "partial.request_timeout_s"),
    ((P, "partial.step_token_budget=0"), "partial.step_token_budget"),
    ((P, "partial.chunk_tokens=0"), "partial.chunk_tokens"),
    ((P, "partial.kv_tokens_per_server=0"), "partial.kv_tokens_per_server"),
    ((P, "partial.kv_tokens_per_server=measured"), "partial.kv_tokens_per_server"),
    ((P, "partial.enable=maybe"), "partial.enable"),
    ((P, "partial.abort_on_done=sometimes"), "partial.abort_on_done"),
    ((P, "partial.ledger_path=3"), "partial.ledger_path"),
    ((P, "partial.schedule=shortest_first"), "partial.schedule"),
    ((P, "partial.refill=sometimes"), "partial.refill"),
    ((P, "partial.extra_groups=4"), "partial.extra_groups"),  # wait + refill carry no extra groups
    (("+partial=restart", "partial.max_staleness=-1"), "partial.max_staleness"),
    (("+partial=restart", "partial.staleness_policy=later"), "partial.staleness_policy"),
    ((P, "trainer.use_v1=true"), "trainer.use_v1"),
    (("+partial=kimi", "trainer.use_v1=true"), "trainer.use_v1"),
    ((P, "algorithm.adv_estimator=remax"), "algorithm.adv_estimator"),
    ((P, "actor_rollout_ref.rollout.calculate_log_probs=false"), "actor_rollout_ref.rollout.calculate_log_probs"),
    (
        (P, "actor_rollout_ref.rollout.agent.agent_loop_manager_class=null"),
        "actor_rollout_ref.rollout.agent.agent_loop_manager_class",
    ),
    (("+partial=nonexistent",), "partial"),
    # --- CPU backend ------------------------------------------------------------------------------
    (("+backend=cpu", "backend.name=tpu"), "backend.name"),
    (("+backend=cpu", "+backend.threads=2"), "backend.threads"),
    (("+backend=cpu", "trainer.use_v1=true"), "trainer.use_v1"),
    (("+backend=cpu_vllm", "trainer.use_v1=true"), "trainer.use_v1"),
    (("+backend=gpu",), "backend"),
    # --- group-preserving balancing ---------------------------------------------------------------
    (
        ("+balance=group", "trainer.use_v1=false", "actor_rollout_ref.actor.shuffle=true"),
        "actor_rollout_ref.actor.shuffle",
    ),
    (("+balance=group", "trainer.use_v1=false", "trainer.balance_batch=false"), "trainer.balance_batch"),
    (("+balance=group", "trainer.use_v1=false", "balance.cost=seconds"), "balance.cost"),
    (("+balance=group", "trainer.use_v1=false", "balance.on_infeasible=ignore"), "balance.on_infeasible"),
    (("+balance=group", "trainer.use_v1=false", "balance.enable=maybe"), "balance.enable"),
    (("+balance=group", "trainer.use_v1=false", "balance.keep_group_on_rank=2"), "balance.keep_group_on_rank"),
    (("+balance=group", "trainer.use_v1=false", "balance.group_key=''"), "balance.group_key"),
    (("+balance=group", "trainer.use_v1=false", "+balance.unknown=1"), "balance.unknown"),
    (("+balance=group", "trainer.use_v1=false", "balance.rows=turns"), "balance.rows"),
    (
        ("+balance=group", "trainer.use_v1=false", "algorithm.adv_estimator=grpo", "balance.rows=transition"),
        "actor_rollout_ref.rollout.multi_turn.enable",
    ),
    (
        (
            "+balance=group",
            "trainer.use_v1=false",
            "algorithm.adv_estimator=rloo",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "balance.rows=transition",
        ),
        "algorithm.adv_estimator",
    ),
    # teammate D's critic rules (config.check_balance_critic); GAE, verl's default estimator, trains a critic
    (("+balance=group", "trainer.use_v1=false", "critic.shuffle=true"), "critic.shuffle"),
    (("+balance=group", "trainer.use_v1=false", "critic.ppo_mini_batch_size=64"), "critic.ppo_mini_batch_size"),
    (
        (
            "+balance=group",
            "trainer.use_v1=false",
            "critic.enable=true",
            "algorithm.adv_estimator=grpo",
            "critic.shuffle=true",
        ),
        "critic.shuffle",
    ),
    (("+balance=group", "trainer.use_v1=true"), "trainer.use_v1"),
    (("+balance=group",), "trainer.use_v1"),  # verl's default trainer is v1
    # --- rollout correction: our block ------------------------------------------------------------
    ((f"{RC}=token_is", "rollout_correction.preset=tis"), "rollout_correction.preset"),
    ((f"{RC}=token_is", "rollout_correction.preset=geo_rs"), "rollout_correction.preset"),
    ((f"{RC}=token_is", "rollout_correction.is_level=tokens"), "rollout_correction.is_level"),
    ((f"{RC}=token_is", "rollout_correction.is_threshold=0.5"), "rollout_correction.is_threshold"),
    ((f"{RC}=token_is", "rollout_correction.is_threshold=true"), "rollout_correction.is_threshold"),
    ((f"{RC}=token_is", "rollout_correction.is_threshold_lower=1.5"), "rollout_correction.is_threshold_lower"),
    (
        (
            f"{RC}=decoupled_token_icepop",
            "rollout_correction.is_threshold=1.0",
            "rollout_correction.is_threshold_lower=1.0",
        ),
        "rollout_correction.is_threshold_lower",
    ),
    (
        (f"{RC}=decoupled_token_icepop", "rollout_correction.is_threshold_lower=0"),
        "rollout_correction.is_threshold_lower",
    ),
    (
        (f"{RC}=bypass_pg_token_icepop", "rollout_correction.is_threshold_lower=5.0"),
        "rollout_correction.is_threshold_lower",
    ),
    ((f"{RC}=disabled", "rollout_correction.is_threshold_lower=0.5"), "rollout_correction.is_threshold_lower"),
    ((f"{RC}=disabled", "rollout_correction.is_batch_normalize=true"), "rollout_correction.is_batch_normalize"),
    (
        (f"{RC}=disabled", "rollout_correction.rs_mode=geometric", "rollout_correction.rs_threshold=1.001"),
        "rollout_correction.rs_mode",
    ),
    ((f"{RC}=disabled", "rollout_correction.rs_mode=seq_mean_k1"), "rollout_correction.rs_threshold"),
    ((f"{RC}=decoupled_geo_rs", "rollout_correction.rs_threshold=1.0"), "rollout_correction.rs_threshold"),
    (
        (f"{RC}=decoupled_geo_rs", "rollout_correction.rs_threshold=1.0", "rollout_correction.rs_threshold_lower=null"),
        "rollout_correction.rs_threshold",
    ),
    ((f"{RC}=seq_is_rs", "rollout_correction.rs_threshold_lower=1.0"), "rollout_correction.rs_threshold_lower"),
    ((f"{RC}=seq_is_rs", "rollout_correction.rs_threshold_lower=1.2"), "rollout_correction.rs_threshold_lower"),
    ((f"{RC}=decoupled_k3_rs", "rollout_correction.rs_threshold=1e-300"), "rollout_correction.rs_threshold"),
    ((f"{RC}=decoupled_k3_rs", "rollout_correction.rs_threshold=0"), "rollout_correction.rs_threshold"),
    ((f"{RC}=bypass_ppo_clip_k3_rs", "rollout_correction.rs_threshold=-0.01"), "rollout_correction.rs_threshold"),
    ((f"{RC}=decoupled_k3_rs", "rollout_correction.rs_threshold_lower=0.5"), "rollout_correction.rs_threshold_lower"),
    ((f"{RC}=token_is", "rollout_correction.rs_threshold=2.0"), "rollout_correction.rs_threshold"),
    ((f"{RC}=geo_rs", "rollout_correction.rs_token_veto=2.0"), "rollout_correction.rs_token_veto"),
    ((f"{RC}=geo_rs", "rollout_correction.rs_token_veto=0.9999"), "rollout_correction.rs_token_veto"),
    ((f"{RC}=geo_rs", "rollout_correction.rs_mode=seq_max_k2"), "rollout_correction.rs_mode"),
    ((f"{RC}=token_is", "rollout_correction.loss_type=pg"), "rollout_correction.loss_type"),
    ((f"{RC}=token_is", "rollout_correction.loss_type=reinforce"), "rollout_correction.loss_type"),
    ((f"{RC}=ppo_is_bypass", "rollout_correction.is_level=token"), "rollout_correction.is_level"),
    ((f"{RC}=token_is", "rollout_correction.bypass_mode=yes"), "rollout_correction.bypass_mode"),
    ((f"{RC}=token_is", "rollout_correction.max_staleness=-1"), "rollout_correction.max_staleness"),
    ((f"{RC}=token_is", "rollout_correction.max_staleness=1.5"), "rollout_correction.max_staleness"),
    ((f"{RC}=token_is", "rollout_correction.max_staleness=2"), "rollout_correction.max_staleness"),  # no +partial
    ((f"{RC}=disabled", "rollout_correction.max_staleness=0"), "rollout_correction.max_staleness"),
    # the deprecated name still reaches the same checks (with a FutureWarning naming both keys)
    ((f"{RC}=token_is", "rollout_correction.max_token_staleness=-1"), "rollout_correction.max_staleness"),
    (
        (f"{RC}=token_is", "rollout_correction.max_token_staleness=1", "rollout_correction.max_staleness=2"),
        "rollout_correction.max_token_staleness",
    ),
    ((f"{RC}=token_is", "rollout_correction.log_by_lag=yes"), "rollout_correction.log_by_lag"),
    ((f"{RC}=token_is", "+rollout_correction.rollout_is=token"), "rollout_correction.rollout_is"),
    ((f"{RC}=nonexistent",), "rollout_correction"),
    # --- rollout correction against the trainer and verl's own keys -----------------------------
    (
        (f"{RC}=seq_is_rs", "actor_rollout_ref.rollout.calculate_log_probs=false"),
        "actor_rollout_ref.rollout.calculate_log_probs",
    ),
    (
        (f"{RC}=pure_is", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"),
        "actor_rollout_ref.actor.policy_loss.loss_mode",
    ),
    (
        (f"{RC}=token_is", "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"),
        "actor_rollout_ref.actor.policy_loss.loss_mode",
    ),
    (
        (f"{RC}=decoupled_geo_rs", "rollout_correction.bypass_mode=true"),
        "actor_rollout_ref.actor.policy_loss.loss_mode",
    ),
    ((f"{RC}=ppo_is_bypass", "rollout_correction.bypass_mode=false"), "actor_rollout_ref.actor.policy_loss.loss_mode"),
    ((f"{RC}=token_is", "algorithm.rollout_correction.rollout_is=sequence"), "algorithm.rollout_correction.rollout_is"),
    (
        (f"{RC}=token_is", "algorithm.rollout_correction.rollout_is_threshold=5.0"),
        "algorithm.rollout_correction.rollout_is_threshold",
    ),
    (
        (f"{RC}=geo_rs", "algorithm.rollout_correction.rollout_rs=seq_mean_k1"),
        "algorithm.rollout_correction.rollout_rs",
    ),
    ((f"{RC}=pure_is", "algorithm.rollout_correction.bypass_mode=false"), "algorithm.rollout_correction.bypass_mode"),
    ((f"{RC}=pure_is", "algorithm.rollout_correction.loss_type=ppo_clip"), "algorithm.rollout_correction.loss_type"),
    (
        (f"{RC}=pure_is", "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token"),
        "actor_rollout_ref.actor.policy_loss.rollout_correction",
    ),
]


@pytest.fixture(scope="module")
def model(demo_assets) -> str:
    return model_override(demo_assets)


def _ids() -> list[str]:
    return [" ".join(overrides) for overrides, _ in BAD_CONFIGS]


def test_the_table_is_large_enough() -> None:
    assert len(BAD_CONFIGS) >= 60


@pytest.mark.parametrize(("overrides", "key"), BAD_CONFIGS, ids=_ids())
def test_bad_config_fails_in_the_driver_naming_the_key(overrides: tuple[str, ...], key: str, model: str) -> None:
    try:
        run_driver(model, *overrides)
    except Exception as error:  # noqa: BLE001 - Hydra's own errors (unknown group option) count too
        assert key in str(error), f"{type(error).__name__} does not name {key}: {error}"
    else:
        pytest.fail(f"silently accepted: {' '.join(overrides)} reached run_ppo (Ray, the workers)")


def test_group_written_as_a_plain_value_in_a_user_yaml(tmp_path, model: str) -> None:
    """A user's primary config writing ``partial: default`` instead of selecting the group."""
    (tmp_path / "my_trainer.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\n\npartial: default\n")
    import driver_entry
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        config = compose(
            config_name="my_trainer",
            overrides=[f"hydra.searchpath=[file://{driver_entry.VERL_CONFIG_DIR}]", model, *driver_entry.MICRO_BATCHES],
        )
    from verl_partial.config.job import validate_root_config

    with pytest.raises(ValueError, match=r"partial is the plain value 'default'.*\+partial=default"):
        validate_root_config(config)


def test_resuming_a_partial_checkpoint_without_partial_is_refused(tmp_path, model: str) -> None:
    step = tmp_path / "global_step_3"
    step.mkdir()
    (step / STATE_FILE).write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(ValueError, match=rf"{STATE_FILE}.*no \+partial") as error:
        run_driver(model, "trainer.use_v1=false", f"trainer.default_local_dir={tmp_path}")
    assert str(step / STATE_FILE) in str(error.value)
    run_driver(model, P, f"trainer.default_local_dir={tmp_path}")  # with +partial it resumes
    run_driver(model, "trainer.use_v1=false", f"trainer.default_local_dir={tmp_path}", "trainer.resume_mode=disable")
