"""The one schedule object: sigma_k, the image method's t and the control's T_k from one decay (eq. 3)."""

from __future__ import annotations

import math

import pytest

from ncgrpo.core import schedule
from ncgrpo.core.schedule import SCHEDULE_KINDS, Schedule, image_noise_t, kinds_text, sigma_schedule


@pytest.mark.parametrize("kind", ["sigmoid", "constant", "linear"])
def test_the_three_values_share_one_decay(kind):
    s = Schedule(kind=kind, gamma=30.0, k_mid=40.0)
    for k in (1, 20, 40, 50, 60):
        decay = sigma_schedule(k, 60, 1.0, kind=kind, gamma=30.0, k_mid=40.0)
        assert s.decay(k, 60) == decay
        assert s.sigma(k, 60, 0.2) == sigma_schedule(k, 60, 0.2, kind=kind, gamma=30.0, k_mid=40.0)
        assert s.image_t(k, 60, 500) == image_noise_t(k, 60, 500, kind=kind, gamma=30.0, k_mid=40.0)
        assert s.temperature(k, 60, 1.0, 3.0) == pytest.approx(1.0 + 2.0 * decay)
    # the control reaches the sampling temperature exactly when sigma reaches 0
    lin = Schedule(kind="linear")
    assert lin.sigma(60, 60, 0.5) == 0.0 and lin.temperature(60, 60, 0.7, 2.0) == 0.7


def test_position_counts_optimizer_steps_or_rollout_batches():
    assert Schedule().position(0, 60) == (1, 60) and Schedule().position(59, 60) == (60, 60)
    g = Schedule(unit="generation")
    # 4 optimizer steps per rollout batch: k counts batches, K = ceil(60 / 4)
    got = [g.position(s, 60, steps_per_generation=8, gradient_accumulation_steps=2) for s in (0, 3, 4, 59)]
    assert got == [(1, 15), (1, 15), (2, 15), (15, 15)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "cosine"}, "sigma_schedule='cosine' is an unknown schedule kind"),
        ({"gamma": -1.0}, "schedule_gamma must be >= 0"),
        ({"gamma": math.nan}, "schedule_gamma must be a finite number"),
        ({"k_mid": -3.0}, "schedule_k_mid .* must be >= 0"),
        ({"unit": "epoch"}, "schedule_unit must be"),
    ],
)
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


def test_anneals_before():
    assert Schedule(k_mid=40).anneals_before(60)
    assert not Schedule(k_mid=40).anneals_before(3)
    assert Schedule(kind="linear", k_mid=40).anneals_before(3)  # only the sigmoid has a midpoint


# ---------------------------------------------------------------------------------------------
# eq. (3): the kinds
# ---------------------------------------------------------------------------------------------
def test_sigmoid_schedule_matches_eq3_at_chosen_points() -> None:
    s = lambda k: sigma_schedule(k, 60, 1.0, gamma=30, k_mid=40)  # noqa: E731
    assert s(20) == pytest.approx(1.0, abs=1e-4)  # 1 - sigmoid(-10)
    assert s(40) == pytest.approx(0.5, abs=1e-12)
    assert s(55) == pytest.approx(1.0 - 1.0 / (1.0 + math.exp(-7.5)), rel=1e-9)
    assert s(55) < 1e-3
    assert s(50) == pytest.approx(0.00669, abs=1e-4)  # anchors.md: ~0.007 at step 50
    # direct formula at every step, and monotone non-increasing
    vals = [sigma_schedule(k, 60, 0.2) for k in range(1, 61)]
    for k, v in zip(range(1, 61), vals, strict=True):
        assert v == pytest.approx(0.2 * (1 - 1 / (1 + math.exp(-30 * (k - 40) / 60))), rel=1e-12)
    assert all(a >= b for a, b in zip(vals, vals[1:], strict=False))


def test_constant_and_linear_schedules() -> None:
    assert sigma_schedule(1, 60, 0.3, kind="constant") == 0.3
    assert sigma_schedule(60, 60, 0.3, kind="constant") == 0.3
    assert sigma_schedule(30, 60, 0.4, kind="linear") == pytest.approx(0.2)
    assert sigma_schedule(60, 60, 0.4, kind="linear") == 0.0


def test_schedule_extremes_do_not_overflow() -> None:
    assert sigma_schedule(10**9, 60, 0.5) == 0.0
    assert sigma_schedule(-(10**9), 60, 0.5) == 0.5
    with pytest.raises(ValueError, match="schedule kind"):
        sigma_schedule(1, 60, 0.5, kind="cosine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sigma0"):
        sigma_schedule(1, 60, -0.1)


def test_the_kinds_are_one_list_that_messages_read() -> None:
    assert list(SCHEDULE_KINDS) == ["sigmoid", "constant", "linear"]
    assert kinds_text() == "'sigmoid' (eq. 3), 'constant' or 'linear'"
    with pytest.raises(
        ValueError, match=r"unknown schedule kind 'cosine'; use 'sigmoid' \(eq. 3\), 'constant' or 'linear'"
    ):
        sigma_schedule(1, 60, 0.5, kind="cosine")
    with pytest.raises(ValueError, match="already registered"):
        schedule.schedule_kind("linear")(lambda k, K, gamma, k_mid: 1.0)


def test_a_new_kind_is_one_registered_function(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The walk of a new schedule kind: one decay function registered in core/schedule.py; the
    schedule object, both annealed values, the config's validation and the messages follow."""
    monkeypatch.setattr(schedule, "SCHEDULE_KINDS", dict(SCHEDULE_KINDS))
    monkeypatch.setattr(schedule, "SCHEDULE_NOTES", dict(schedule.SCHEDULE_NOTES))

    @schedule.schedule_kind("cosine", note="a test's")
    def _cosine(k: int, K: int, gamma: float, k_mid: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * min(max(k, 0), K) / K))

    s = Schedule(kind="cosine")
    assert s.sigma(30, 60, 0.2) == pytest.approx(0.1)
    assert s.sigma(60, 60, 0.2) == pytest.approx(0.0, abs=1e-12)
    assert s.image_t(30, 60, 500) == image_noise_t(30, 60, 500, kind="cosine") == 250
    assert s.temperature(30, 60, 1.0, 3.0) == pytest.approx(2.0)
    assert schedule.kinds_text().endswith("'linear' or 'cosine' (a test's)")
    from ncgrpo.trainer.config import NCGRPOConfig

    cfg = NCGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", sigma_schedule="cosine")
    assert cfg.schedule.sigma(30, 60, 0.2) == pytest.approx(0.1)
