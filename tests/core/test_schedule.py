"""The one schedule object: sigma_k, the image method's t and the control's T_k from one decay (eq. 3)."""

from __future__ import annotations

import math

import pytest

from ncgrpo.core.image_noise import image_noise_t
from ncgrpo.core.noise import sigma_schedule
from ncgrpo.core.schedule import Schedule


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
