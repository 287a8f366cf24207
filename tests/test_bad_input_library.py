"""Library entry points refuse bad input instead of computing garbage (issue 10, class 3).

Before: ``RowNoise(sigma=nan)`` / negative sigma read as "clean" (NaN compares False), ``sigma=inf``
turned the prompt states into NaN and decoded garbage, a nested ``prefill_noise`` on one model added
the noise twice, and ``NCGRPOConfig(schedule_gamma=-30)`` annealed backwards.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ncgrpo.core.noise import NoiseKey, RowNoise, perturb_rows
from ncgrpo.engines.transformers import prefill_noise
from tiny_models import build_tokenizer, tiny_text_model

KEY = NoiseKey(seed=1, step=1, prompt_id=0, draw=0)


@pytest.mark.parametrize("sigma", [math.nan, -0.1, -math.inf, math.inf])
def test_row_noise_rejects_non_finite_or_negative_sigma(sigma: float) -> None:
    with pytest.raises(ValueError, match="finite number >= 0"):
        RowNoise(sigma=sigma, key=KEY)


def test_row_noise_rejects_a_sign_other_than_plus_or_minus_one() -> None:
    with pytest.raises(ValueError, match=r"\+1 or -1"):
        RowNoise(sigma=0.2, key=KEY, sign=0.0)
    assert RowNoise(sigma=0.2, key=KEY, sign=-1.0).noisy and not RowNoise().noisy


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0])
def test_perturb_rows_rejects_a_bad_sigma_scale(scale: float) -> None:
    h = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="sigma_scale"):
        perturb_rows(h, [RowNoise(0.2, KEY)], sigma_scale=scale)
    out, _ = perturb_rows(h, [RowNoise(0.2, KEY)], sigma_scale=0.5)
    assert torch.isfinite(out).all() and not torch.equal(out, h)


@pytest.fixture(scope="module")
def model_and_inputs():
    tok = build_tokenizer()
    model = tiny_text_model("qwen2", tokenizer=tok, num_hidden_layers=2)
    return model, tok(["The quick brown fox"], return_tensors="pt")


def _prefill_logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits[:, -1]


def test_nested_prefill_noise_is_an_error_and_the_outer_hook_still_works(model_and_inputs) -> None:
    model, inputs = model_and_inputs
    clean = _prefill_logits(model, inputs)
    rows = [RowNoise(0.5, KEY)]
    with prefill_noise(model, rows):
        once = _prefill_logits(model, inputs)
        with pytest.raises(RuntimeError, match="already active on this model"), prefill_noise(model, rows):
            pass
        assert torch.equal(_prefill_logits(model, inputs), once)  # the failed inner call added nothing
    assert not torch.equal(once, clean)
    assert torch.equal(_prefill_logits(model, inputs), clean)  # all hooks gone on exit
    with prefill_noise(model, rows):  # and the model can be hooked again
        assert torch.equal(_prefill_logits(model, inputs), once)


def test_prefill_noise_is_released_when_the_body_raises(model_and_inputs) -> None:
    model, inputs = model_and_inputs
    with pytest.raises(KeyError), prefill_noise(model, [RowNoise(0.5, KEY)]):
        raise KeyError("boom")
    with prefill_noise(model, [RowNoise()]):
        pass


def test_prefill_noise_rejects_rows_that_are_not_row_noise(model_and_inputs) -> None:
    model, _ = model_and_inputs
    with pytest.raises(TypeError, match="row 0"), prefill_noise(model, [0.2]):
        pass


# --- NCGRPOConfig: eq. (3) schedule parameters -------------------------------------------------------
def _cfg(tmp_path, **kw):
    from ncgrpo.trainer import NCGRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8)
    return NCGRPOConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"schedule_gamma": -30.0}, "anneals backwards"),
        ({"schedule_gamma": math.nan}, "finite"),
        ({"schedule_gamma": math.inf}, "finite"),
        ({"schedule_k_mid": -1.0}, "must be >= 0"),
        ({"schedule_k_mid": math.nan}, "finite"),
    ],
)
def test_config_rejects_schedule_nonsense(tmp_path, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **kw)


def test_config_warns_when_k_mid_is_after_the_last_step(tmp_path) -> None:
    with pytest.warns(UserWarning, match="never anneals"):
        _cfg(tmp_path, max_steps=10, schedule_k_mid=40.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _cfg(
            tmp_path, max_steps=60, schedule_k_mid=40.0, schedule_gamma=0.0
        )  # the paper's K; gamma 0 is flat
        _cfg(tmp_path, max_steps=10, schedule_k_mid=40.0, sigma_schedule="constant")  # k_mid unused
