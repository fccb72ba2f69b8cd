"""Typed rollout-correction presets, mapped onto verl 0.9's ``algorithm.rollout_correction``.

verl 0.9 configures rollout correction with seven loosely typed keys (threshold *strings* such as
``"0.5_2.0"``, comma-chained rejection modes) and 19 preset classmethods; the preset names users know
from verl PR #3984 (``token_is``, ``seq_is_rs``, ``geo_rs``...) no longer exist there. This module is
the typed front end: one frozen dataclass whose field docstrings document the ``rollout_correction.*`` keys
(docs/configuration.md is generated from them), every preset under both the old and the current names, defined
once here (``hydra_configs/rollout_correction/<name>.yaml`` starts from ``disabled.yaml`` and restates only the
keys that differ; tests/unit/test_correction_config.py composes each and compares it field by field), and
validation (:mod:`verl_partial.config.checks`) that fails before Ray starts on the combinations verl would
silently ignore or override.

Conventions (see docs/rollout-correction.md):

* r = π_old / π_rollout per token (π_θ / π_rollout in bypass mode, where π_old = π_rollout).
* Every ratio bound here bounds r itself. verl applies the bounds of its ``*_k1`` rejection modes to
  k1 = -log r, i.e. to 1/r, so ``to_verl_fields`` hands verl the reflected interval [1/upper, 1/lower].
* No verl import, no torch: the driver can validate a config without loading either.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from verl_partial.config.checks import check_types, choices, rename_deprecated, require

BLOCK = "rollout_correction"

IsLevel = Literal["token", "sequence"]
# verl 0.9.1 rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS, in its documented order.
RsMode = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
LossType = Literal["ppo_clip", "reinforce"]
IS_LEVELS: tuple[str, ...] = choices(IsLevel)
RS_MODES: tuple[str, ...] = choices(RsMode)
LOSS_TYPES: tuple[str, ...] = choices(LossType)
# The actor loss mode that runs verl's bypass correction; the bypass presets write it into the composed config.
BYPASS_LOSS_MODE = "bypass_mode"
# Smallest k2/k3 divergence bound accepted: on-policy fp32 data already differs by ~1e-4 in log-prob between
# rollout and training (k2 = k3 ~ 5e-9 per token), so a bound below this rejects (almost) every sequence.
MIN_DIVERGENCE_THRESHOLD = 1e-6
# The seed-era per-token veto ("reject the sequence if any token ratio < veto") is expressed with
# verl's sequence-max of k2 = ½(log r)²; see ``RolloutCorrectionConfig.rs_token_veto``.
VETO_RS_MODE = "seq_max_k2"
# The veto becomes the k2 bound ½(log veto)², which must stay >= MIN_DIVERGENCE_THRESHOLD: veto <= exp(-sqrt(2e-6)).
MAX_TOKEN_VETO = 0.998

SEED_PRESET_NAMES = ("token_is", "seq_is", "seq_is_rs", "geo_rs", "ppo_is_bypass", "pure_is", "disabled")
VERL_PRESET_NAMES = (
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_token_icepop",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "bypass_ppo_clip",
    "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs",
    "bypass_pg_is",
    "bypass_pg_token_icepop",
    "bypass_pg_geo_rs",
    "decoupled_geo_rs_seq_tis",
    "decoupled_geo_rs_token_tis",
    "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis",
    "decoupled_k3_rs",
    "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis",
    "disabled",
)
PRESET_NAMES = SEED_PRESET_NAMES + tuple(name for name in VERL_PRESET_NAMES if name not in SEED_PRESET_NAMES)
DEFAULT_PRESET = "disabled"
#: Keys of the ``rollout_correction`` block renamed (old -> new); the old names still work, with a FutureWarning.
#: ``max_staleness`` is the one name of the staleness bound, as in ``partial.max_staleness``.
RENAMED_KEYS: dict[str, str] = {"max_token_staleness": "max_staleness"}


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """One rollout-correction setup; ``RolloutCorrectionConfig()`` equals ``preset("disabled")``."""

    preset: str = DEFAULT_PRESET
    """Name of the preset the values started from (a label; the other keys are what counts): a seed-era name or
    any verl 0.9.1 ``RolloutCorrectionConfig`` classmethod name, as listed under ``hydra_configs/rollout_correction``.
    Selecting a preset and overriding single keys keeps the label."""

    is_level: IsLevel | None = None
    """Importance-sampling weights per ``token`` or per ``sequence`` (product of the token ratios), or ``null`` for
    no IS weights. verl: ``rollout_is``."""

    is_threshold: float = 2.0
    """Upper bound of the IS weight, >= 1. Alone it truncates (TIS: w = min(r, upper)); with
    ``is_threshold_lower`` it masks (IcePop: w = r inside [lower, upper], else 0). verl:
    ``rollout_is_threshold``."""

    is_threshold_lower: float | None = None
    """IcePop lower bound on r, in (0, 1], or ``null`` for truncation."""

    is_batch_normalize: bool = False
    """Rescale IS weights to mean 1 over the batch. verl: ``rollout_is_batch_normalize``."""

    rs_mode: RsMode | None = None
    """Rejection-sampling statistic, or ``null``. ``token_*`` masks single tokens; ``seq_sum_*`` / ``seq_mean_*`` /
    ``seq_max_*`` mask whole sequences. k1 = -log r (ratio modes), k2 = ½(log r)², k3 = r - 1 - log r
    (divergences). verl: ``rollout_rs``."""

    rs_threshold: float | None = None
    """For k1 modes the upper bound on the ratio (r for token_k1, Π r for seq_sum_k1, the geometric mean
    exp(mean log r) for seq_mean_k1); for k2/k3 modes the largest divergence kept. ``null`` without ``rs_mode``."""

    rs_threshold_lower: float | None = None
    """k1 modes only: the lower bound on that ratio; ``null`` means 1 / rs_threshold."""

    rs_token_veto: float | None = None
    """Reject a whole sequence if any of its tokens has r < veto (or r > 1/veto), the nearest verl 0.9 equivalent
    of the seed-era veto; ``null`` disables it."""

    bypass_mode: bool = False
    """Reuse the rollout log-probs as π_old (two policies, no old-log-prob pass); correction then runs inside the
    actor's loss against the current policy. The bypass presets also set
    ``actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode``."""

    loss_type: LossType = "ppo_clip"
    """Bypass mode's loss: ``ppo_clip`` (the PPO ratio π_θ/π_rollout is the IS correction) or ``reinforce``
    (explicit IS weights, no clipping). Must be ``ppo_clip`` without bypass."""

    max_staleness: int | None = None
    """Train no token generated more than this many policy versions before the policy being trained (xtuner-style
    token mask, counted in ``rollout_corr/stale_tokens_masked``); ``null`` disables the mask. Needs ``+partial``,
    which records each token's policy version. The same bound as ``partial.max_staleness``, enforced at training
    instead of at rollout. Formerly ``rollout_correction.max_token_staleness``."""

    log_by_lag: bool = True
    """Also log the rollout-correction metrics split by token policy-version lag."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def max_token_staleness(self) -> int | None:
        """Deprecated name of ``max_staleness`` (reading it warns); kept for code written against it."""
        warnings.warn(
            "RolloutCorrectionConfig.max_token_staleness is deprecated: use max_staleness", FutureWarning, stacklevel=2
        )
        return self.max_staleness

    def validate(self) -> None:
        """Raise ValueError naming ``rollout_correction.<field>`` and its allowed values."""
        check_types(self, BLOCK)
        _require(self.preset in PRESET_NAMES, "preset", f"one of {list(PRESET_NAMES)}", self.preset)
        self._validate_importance_sampling()
        self._validate_rejection_sampling()
        self._validate_mode()
        _require(
            self.max_staleness is None or self.max_staleness >= 0,
            "max_staleness",
            "null or an integer >= 0",
            self.max_staleness,
        )

    def _validate_importance_sampling(self) -> None:
        # An upper bound below 1 would cap (or mask) every weight below the on-policy value 1.
        _require(
            _is_number(self.is_threshold) and self.is_threshold >= 1.0,
            "is_threshold",
            "a number >= 1",
            self.is_threshold,
        )
        if self.is_threshold_lower is not None:
            _require(
                _is_number(self.is_threshold_lower) and 0.0 < self.is_threshold_lower <= 1.0,
                "is_threshold_lower",
                "null or a number in (0, 1] (IcePop keeps r in [lower, is_threshold])",
                self.is_threshold_lower,
            )
            _require(
                self.is_threshold_lower < self.is_threshold,
                "is_threshold_lower",
                f"below is_threshold={self.is_threshold} (an empty IcePop band [lower, upper] masks every token)",
                self.is_threshold_lower,
            )
        if self.is_level is None:
            _require(
                self.is_threshold_lower is None,
                "is_threshold_lower",
                "null when is_level is null (there are no IS weights to mask)",
                self.is_threshold_lower,
            )
            _require(
                not self.is_batch_normalize,
                "is_batch_normalize",
                "false when is_level is null (there are no IS weights to normalize)",
                self.is_batch_normalize,
            )

    def _validate_rejection_sampling(self) -> None:
        if self.rs_mode is None:
            _require(
                self.rs_threshold is None,
                "rs_threshold",
                "null when rs_mode is null (verl would ignore it)",
                self.rs_threshold,
            )
            _require(
                self.rs_threshold_lower is None,
                "rs_threshold_lower",
                "null when rs_mode is null (verl would ignore it)",
                self.rs_threshold_lower,
            )
        elif self.rs_mode.endswith("k1"):
            # A ratio band that excludes 1 rejects on-policy data; an upper bound < 1 alone is empty.
            # rs_threshold = 1 is the band [1, 1]: only exactly on-policy sequences would survive.
            _require(
                _is_number(self.rs_threshold) and self.rs_threshold > 1.0,
                "rs_threshold",
                f"a number > 1 (upper bound on the ratio) for rs_mode={self.rs_mode}",
                self.rs_threshold,
            )
            _require(
                self.rs_threshold_lower is None
                or (_is_number(self.rs_threshold_lower) and 0.0 < self.rs_threshold_lower < 1.0),
                "rs_threshold_lower",
                f"null (= 1/rs_threshold) or a number in (0, 1) (lower bound on the ratio) for rs_mode={self.rs_mode}",
                self.rs_threshold_lower,
            )
        else:
            _require(
                _is_number(self.rs_threshold) and self.rs_threshold >= MIN_DIVERGENCE_THRESHOLD,
                "rs_threshold",
                f"a number >= {MIN_DIVERGENCE_THRESHOLD} (largest divergence kept; smaller rejects even on-policy "
                f"data) for rs_mode={self.rs_mode}",
                self.rs_threshold,
            )
            _require(
                self.rs_threshold_lower is None,
                "rs_threshold_lower",
                f"null for rs_mode={self.rs_mode} (divergences have no lower bound)",
                self.rs_threshold_lower,
            )
        if self.rs_token_veto is not None:
            _require(
                _is_number(self.rs_token_veto) and 0.0 < self.rs_token_veto <= MAX_TOKEN_VETO,
                "rs_token_veto",
                f"null or a number in (0, {MAX_TOKEN_VETO}] (a veto closer to 1 rejects even on-policy data)",
                self.rs_token_veto,
            )
            _require(
                self.rs_mode != VETO_RS_MODE,
                "rs_mode",
                f"not {VETO_RS_MODE} when rs_token_veto is set (the veto is itself {VETO_RS_MODE})",
                self.rs_mode,
            )

    def _validate_mode(self) -> None:
        if not self.bypass_mode:
            _require(
                self.loss_type == "ppo_clip",
                "loss_type",
                "'ppo_clip' when bypass_mode is false (verl reads loss_type only in bypass mode)",
                self.loss_type,
            )
        elif self.loss_type == "ppo_clip":
            _require(
                self.is_level is None,
                "is_level",
                "null with bypass_mode=true and loss_type=ppo_clip: verl's bypass PPO-clip loss never applies IS "
                "weights (its ratio pi_theta/pi_rollout already is the correction); use loss_type=reinforce",
                self.is_level,
            )

    @property
    def corrects(self) -> bool:
        """Whether this config changes training (weights, masks or the loss), not just logs metrics."""
        return (
            self.is_level is not None
            or self.rs_mode is not None
            or self.rs_token_veto is not None
            or self.bypass_mode
            or self.max_staleness is not None
        )


_PRESETS: dict[str, RolloutCorrectionConfig] = {}


def preset(name: str) -> RolloutCorrectionConfig:
    """The preset called ``name`` (a seed-era name or any verl 0.9.1 classmethod name)."""
    _require(name in PRESET_NAMES, "preset", f"one of {list(PRESET_NAMES)}", name)
    return _PRESETS[name]


def from_mapping(values: Mapping[str, Any]) -> RolloutCorrectionConfig:
    """Build a config from a ``rollout_correction`` block: the named preset, then the given keys on top.

    So ``{preset: seq_is_rs}`` alone selects the preset, and a full block (as written by our YAML
    group, possibly with command-line overrides) yields exactly its values.
    """
    values = rename_deprecated(values, BLOCK, RENAMED_KEYS)
    known = {field.name for field in dataclasses.fields(RolloutCorrectionConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {[f'{BLOCK}.{key}' for key in unknown]}; allowed keys: {sorted(known)}")
    return dataclasses.replace(preset(values.get("preset", DEFAULT_PRESET)), **values)


def to_verl_fields(cfg: RolloutCorrectionConfig) -> dict[str, Any]:
    """Keyword arguments of verl's ``verl.trainer.config.algorithm.RolloutCorrectionConfig``.

    Threshold formats follow verl: a float for truncation / symmetric bounds / divergences, a
    ``"lower_upper"`` string for IcePop and asymmetric k1 bounds, comma-joined when the veto adds a
    second rejection mode.
    """
    modes: list[str] = []
    specs: list[float | str] = []
    if cfg.rs_mode is not None:
        modes.append(cfg.rs_mode)
        specs.append(_verl_rs_threshold(cfg))
    if cfg.rs_token_veto is not None:
        modes.append(VETO_RS_MODE)
        specs.append(veto_k2_threshold(cfg.rs_token_veto))
    if cfg.is_threshold_lower is None:
        is_threshold: float | str = float(cfg.is_threshold)
    else:
        is_threshold = f"{float(cfg.is_threshold_lower)}_{float(cfg.is_threshold)}"
    return {
        "rollout_is": cfg.is_level,
        "rollout_is_threshold": is_threshold,
        "rollout_is_batch_normalize": cfg.is_batch_normalize,
        "rollout_rs": ",".join(modes) if modes else None,
        "rollout_rs_threshold": specs[0] if len(specs) == 1 else (",".join(map(str, specs)) if specs else None),
        "bypass_mode": cfg.bypass_mode,
        "loss_type": cfg.loss_type,
    }


def check_against_trainer(cfg: RolloutCorrectionConfig, *, calculate_log_probs: bool, policy_loss_mode: str) -> None:
    """Fail fast on trainer settings that would make ``cfg`` silently ineffective or crash mid-run.

    Args:
        cfg: our rollout-correction config.
        calculate_log_probs: ``actor_rollout_ref.rollout.calculate_log_probs``.
        policy_loss_mode: ``actor_rollout_ref.actor.policy_loss.loss_mode``.
    """
    if cfg.corrects and not calculate_log_probs:
        raise ValueError(
            f"actor_rollout_ref.rollout.calculate_log_probs must be true for {BLOCK} preset {cfg.preset!r}, got false: "
            "verl computes IS weights and rejection masks only when the batch holds rollout log-probs (and skips "
            "them silently otherwise), bypass mode raises at the first step without them, and the staleness mask "
            "runs in the same rollout-correction step"
        )
    check_loss_mode(bypass_mode=cfg.bypass_mode, policy_loss_mode=policy_loss_mode)


def check_loss_mode(*, bypass_mode: bool, policy_loss_mode: str) -> None:
    """Bypass needs the actor's ``bypass_mode`` loss, and that loss needs bypass (the composed config holds both)."""
    if bypass_mode and policy_loss_mode != BYPASS_LOSS_MODE:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode must be '{BYPASS_LOSS_MODE}' with "
            f"{BLOCK}.bypass_mode=true, got {policy_loss_mode!r}: bypass's PPO-clip/REINFORCE, IS and RS run "
            f"inside the actor's '{BYPASS_LOSS_MODE}' loss, {policy_loss_mode!r} would ignore them. The bypass "
            f"presets set it; when turning bypass on over another preset, also set "
            f"actor_rollout_ref.actor.policy_loss.loss_mode={BYPASS_LOSS_MODE}"
        )
    if not bypass_mode and policy_loss_mode == BYPASS_LOSS_MODE:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode='bypass_mode' requires {BLOCK}.bypass_mode=true: in "
            "decoupled mode the driver already applies IS weights and rejection, the bypass loss would apply them "
            "again against the rollout policy"
        )


def veto_k2_threshold(veto: float) -> float:
    """verl ``seq_max_k2`` bound that rejects a sequence holding a token with r < veto or r > 1/veto."""
    return 0.5 * math.log(veto) ** 2


def _reciprocal(value: float) -> float:
    """1/value rounded to 15 significant digits, so that 1/(1/x) gives back a short decimal x exactly.

    Reflecting ratio bounds into verl's k1 convention inverts them; without the rounding 1/(1/0.999)
    can come back one ulp off and a preset would not reproduce verl's ``"0.999_1.001"``.
    """
    return float(f"{1.0 / value:.15g}")


def _verl_rs_threshold(cfg: RolloutCorrectionConfig) -> float | str:
    assert cfg.rs_mode is not None and cfg.rs_threshold is not None  # guaranteed by validate()
    if cfg.rs_mode.endswith("k1") and cfg.rs_threshold_lower is not None:
        # verl keeps k1 = -log r in [log lo, log hi], i.e. r in [1/hi, 1/lo]: hand it the reflection.
        return f"{_reciprocal(cfg.rs_threshold)}_{_reciprocal(cfg.rs_threshold_lower)}"
    # Divergence upper bound, or a symmetric k1 band [1/upper, upper], which verl infers from one float.
    return float(cfg.rs_threshold)


def _bounds_of_verl_k1(lower: float, upper: float) -> dict[str, float]:
    """Our ratio bounds for a verl k1 threshold ``"lower_upper"``, which bounds 1/r to [lower, upper]."""
    return {"rs_threshold_lower": 1.0 / upper, "rs_threshold": 1.0 / lower}


def _is_number(value: object) -> bool:
    """A finite number (``check_types`` has already refused non-numbers in number fields; this refuses inf, nan)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, field: str, allowed: str, value: object) -> None:
    require(ok, f"{BLOCK}.{field}", allowed, value)


def _define_presets() -> None:
    geo = _bounds_of_verl_k1(0.999, 1.001)  # verl's Geo-RS default "0.999_1.001"
    seq_band = _bounds_of_verl_k1(0.5, 2.0)  # verl's Seq-MIS default "0.5_2.0" (symmetric: [0.5, 2.0])
    k3 = {"rs_mode": "seq_mean_k3", "rs_threshold": 0.01}
    bypass_pg = {"bypass_mode": True, "loss_type": "reinforce"}
    bypass_clip = {"bypass_mode": True, "loss_type": "ppo_clip"}
    token_tis = {"is_level": "token", "is_threshold": 2.0}
    seq_tis = {"is_level": "sequence", "is_threshold": 2.0}
    icepop = {"is_level": "token", "is_threshold": 5.0, "is_threshold_lower": 0.5}
    values: dict[str, dict[str, Any]] = {
        # Seed-era names (verl PR #3984), reproduced as closely as verl 0.9.1 allows.
        "token_is": token_tis,
        "seq_is": seq_tis,
        "seq_is_rs": {**seq_tis, "rs_mode": "seq_sum_k1", "rs_threshold": 2.0, "rs_threshold_lower": 0.5},
        "geo_rs": {"rs_mode": "seq_mean_k1", "rs_threshold": 1.001, "rs_token_veto": 1e-4},
        "ppo_is_bypass": bypass_clip,
        "pure_is": {**seq_tis, **bypass_pg},
        "disabled": {},
        # verl 0.9.1 classmethods with their default arguments.
        "decoupled_token_is": token_tis,
        "decoupled_seq_is": seq_tis,
        "decoupled_token_icepop": icepop,
        "decoupled_seq_is_rs": {**seq_tis, "rs_mode": "seq_sum_k1", **seq_band},
        "decoupled_geo_rs": {"rs_mode": "seq_mean_k1", **geo},
        "bypass_ppo_clip": bypass_clip,
        "bypass_ppo_clip_geo_rs": {"rs_mode": "seq_mean_k1", **geo, **bypass_clip},
        "bypass_ppo_clip_k3_rs": {**k3, **bypass_clip},
        "bypass_pg_is": {**seq_tis, **bypass_pg},
        "bypass_pg_token_icepop": {**icepop, **bypass_pg},
        "bypass_pg_geo_rs": {"rs_mode": "seq_mean_k1", **geo, **bypass_pg},
        "decoupled_geo_rs_seq_tis": {**seq_tis, "rs_mode": "seq_mean_k1", **geo},
        "decoupled_geo_rs_token_tis": {**token_tis, "rs_mode": "seq_mean_k1", **geo},
        "bypass_pg_geo_rs_seq_tis": {**seq_tis, "rs_mode": "seq_mean_k1", **geo, **bypass_pg},
        "bypass_pg_geo_rs_token_tis": {**token_tis, "rs_mode": "seq_mean_k1", **geo, **bypass_pg},
        "decoupled_k3_rs": k3,
        "decoupled_k3_rs_seq_tis": {**seq_tis, **k3},
        "decoupled_k3_rs_token_tis": {**token_tis, **k3},
    }
    for name, fields in values.items():
        _PRESETS[name] = RolloutCorrectionConfig(preset=name, **fields)


_define_presets()
