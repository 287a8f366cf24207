"""One seam per generation (issue 45): the trainer's generation makes one call to the rollout method,
``plan_generation``, and reads everything that differs by method off the ``GenerationPlan`` it returns;
the method's own per-generation values live in ``method_values`` (``Generation`` and ``StepRecord`` name
no method's field)."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch

from ncgrpo.core.plan import plan_rows
from ncgrpo.core.schedule import Schedule
from ncgrpo.methods import get_method, methods
from ncgrpo.methods.base import Generation, GenerationPlan, StepRecord
from tiny_models import load_tiny_grpo

tiny = load_tiny_grpo()


def _asking(method):
    """A copy of ``method`` that records every attribute ``NCGRPOTrainer._nc_generate`` itself reads of it."""
    asked: list[str] = []

    def __getattribute__(self, name):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "<listcomp>":  # a comprehension inside _nc_generate is _nc_generate's
            caller = caller.f_back
        if caller.f_code.co_name == "_nc_generate":
            asked.append(name)
        return object.__getattribute__(self, name)

    spy = type(f"Asking{type(method).__name__}", (type(method),), {"__getattribute__": __getattribute__})()
    return spy, asked


@pytest.mark.parametrize(
    ("method", "extra", "values", "metric"),
    [
        ("spsa", dict(sigma0=2.0, spsa_lr=1.0), "mu_norm", "spsa/mu_norm"),
        ("image", dict(image_noise_step=500), "image_t", "image_noise/t"),
        (
            "first_token_temperature",
            dict(first_token_temperature=3.0),
            "first_token_temperature",
            "control/first_token_temperature",
        ),
    ],
)
def test_one_call_per_generation_and_the_methods_values_recorded(tmp_path, method, extra, values, metric):
    tr = tiny.trainer(tmp_path, rollout_method=method, max_steps=2, **extra)
    tr.nc_method, asked = _asking(tr.nc_method)
    gens = []
    orig = tr._nc_generate

    def spy(*args):
        out = orig(*args)
        gens.append(tr._nc_gen)
        return out

    tr._nc_generate = spy
    tr.train()
    assert len(gens) == 2 and asked == ["plan_generation"] * 2, asked  # before: 5 hooks, L + 4 calls
    for gen, rec in zip(gens, tr.nc_history, strict=True):
        plan = gen.plan
        assert isinstance(plan, GenerationPlan)
        assert plan.rows == [tr.nc_method.row_noise(p, gen.sigma_k) for p in gen.plans]
        assert plan.images is None and plan.logit_scales is None  # vLLM's, not asked on transformers
        # the record keeps the method's own values, which its metrics log
        assert set(rec.method_values) == {values} and rec.method_values == gen.method_values
        assert rec.metrics[metric] == pytest.approx(float(rec.method_values[values]))
    if method == "spsa":
        assert gens[0].method_values["mu_norm"] == 0.0 < gens[1].method_values["mu_norm"]
        assert gens[1].plan.steer is not None and float(gens[1].plan.steer.norm()) > 0  # the first update
    if method == "image":
        assert gens[0].method_values["image_t"] == 500
        pv, noisy = gens[0].plan.inputs["pixel_values"], [p.noisy for p in gens[0].plans]
        rows = [
            pv[i * (len(pv) // len(noisy)) : (i + 1) * (len(pv) // len(noisy))] for i in range(len(noisy))
        ]
        clean, (a, b) = rows[0], [r for r, n in zip(rows, noisy, strict=True) if n]
        assert torch.equal(a, b) and not torch.equal(
            a, clean
        )  # the distorted copy the noisy rows generated from
    if method == "first_token_temperature":
        for gen in gens:  # what the branch-point metrics measure the noisy rows at: the control's T_k
            assert gen.noisy_first_token_temperature == gen.plan.noisy_first_token_temperature == 3.0
            assert gen.method_values["first_token_temperature"] == 3.0


def _view(method: str, **args):
    a = SimpleNamespace(
        first_token_temperature=2.0, first_token_temperature_auto=False, image_noise_step=400, sigma0=0.5,
        target_marginal_tv=None, **args,
    )  # fmt: skip
    m = get_method(method)
    tr = SimpleNamespace(args=a, schedule=Schedule("linear"), temperature=1.0, use_vllm=False)
    tr.nc_state = m.init_state(SimpleNamespace(hidden_size=lambda: 3))
    plans = plan_rows(range(4), [7] * 4, num_generations=4, method=m, seed=1, step=1)
    return m, tr, Generation(step=1, total_steps=4, sigma_k=0.0, plans=plans, schedule_k=2)


def test_the_plan_carries_what_each_engine_reads():
    """``plan_generation`` on both engines: the rows' noise at this generation's sigma_k, the control's
    logit scales and first-token temperature, vLLM's fields only on vLLM; the plan is kept on ``gen``."""
    m, tr, gen = _view("first_token_temperature")
    plan = m.plan_generation(tr, gen, [[1, 2]] * 4, None, {})
    assert gen.plan is plan and plan.logit_scales is None and plan.images is None
    assert gen.method_values == {"first_token_temperature": 1.5}  # linear: T + (T0 - T) * (1 - 2/4)
    assert plan.noisy_first_token_temperature == gen.noisy_first_token_temperature == 1.5
    tr.use_vllm = True
    _, _, gen = _view("first_token_temperature")
    plan = m.plan_generation(tr, gen, [[1, 2]] * 4, ["im"] * 4, {})
    assert plan.logit_scales == [None, None, 1 / 1.5, 1 / 1.5] and plan.images == ["im"] * 4

    m, tr, gen = _view("latent")
    plan = m.plan_generation(tr, gen, [[1, 2]] * 4, None, {"x": 1})
    assert gen.sigma_k == 0.25 and [r.sigma for r in plan.rows] == [0.0, 0.0, 0.25, 0.25]
    assert plan.inputs == {"x": 1} and plan.steer is None and gen.noisy_first_token_temperature is None
    with plan.hooks(None) as control:  # latent noise has no hooks of its own around generate
        assert control is None
    assert gen.method_values == {}


def test_the_records_name_no_methods_field():
    """``Generation`` and ``StepRecord`` hold what every method has; a method's own values go in
    ``method_values`` (the image method's t, the control's temperature, SPSA's mu were fields once)."""
    names = {f.name for cls in (Generation, StepRecord) for f in dataclasses.fields(cls)}
    own = {"image_t", "first_token_temperature", "gen_pixel_values", "mu_norm", "spsa_mu"}
    assert not names & own, names & own
    assert not [n for n in names for m in methods() if m.name in n or (m.slug and m.slug in n)]
    assert "method_values" in names
