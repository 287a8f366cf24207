"""A new rollout method is one object: a toy method defined here, in the test, registered through
:func:`ncgrpo.methods.register_method`, trains on the transformers engine, is probed by ``ncgrpo probe``
and is refused by vLLM and verl with its own reasons, with no edit in ``src/`` (issue 34)."""

from __future__ import annotations

import json
import math

import pytest

from ncgrpo.methods import RolloutMethod, get_method, register_method, unregister_method
from tiny_models import load_tiny_grpo

tiny = load_tiny_grpo()


class Unannealed(RolloutMethod):
    """Toy: eq. (2)'s independent draws at a fixed half of ``sigma0``, whatever the schedule says (an
    un-annealed, smaller noise), on the noisy half; everything else is the base class's."""

    name = "toy_unannealed"
    summary = "test method: latent noise at sigma0 / 2, never annealed"
    key_rule = "row"
    noise_mode = "independent"
    uses_sigma = True
    marginal = "draws"
    probe_refusal = None
    vllm_refusal = "a test method that was not written for the vLLM plugin"

    def begin_generation(self, tr, gen, k, K, prompt_ids, multimodal_fields):
        gen.sigma_k = 0.5 * float(tr.args.sigma0)


@pytest.fixture
def toy():
    register_method(Unannealed)
    yield get_method("toy_unannealed")
    unregister_method("toy_unannealed")


def test_a_method_defined_outside_src_trains_two_steps(tmp_path, toy) -> None:
    # the linear schedule would give sigma 0.5 then 0 over two steps; the toy keeps sigma0 / 2 = 0.5
    tr = tiny.trainer(tmp_path, rollout_method="toy_unannealed", sigma_schedule="linear", sigma0=1.0)
    assert tr.nc_method is toy
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        for name in (
            "noise/sigma_k",
            "noise/rel_perturbation",
            "reward/contrast",
            "noise/first_token_marginal_tv",
        ):
            assert name in log and math.isfinite(log[name]), (name, log)
    assert [log["noise/sigma_k"] for log in logs] == [0.5, 0.5]
    assert all(abs(log["noise/rel_perturbation"] - 0.5) < 0.25 for log in logs)  # ||delta|| / ||h|| ~ sigma
    rows = tr.nc_history[1].rows  # (global_row, branch, noisy, sign, key, adv_group)
    assert [r[2] for r in rows[:4]] == [False, False, True, True]
    assert [r[4][3] for r in rows if r[2]][:2] == [0, 1]  # the "row" key rule: draw j on noisy row j


def test_ncgrpo_probe_measures_it_and_vllm_and_verl_refuse_it(tmp_path, toy, capsys) -> None:
    from ncgrpo.cli import main
    from ncgrpo.integrations.verl.config import NCGRPOVerlConfig

    out = tmp_path / "probe.json"
    argv = ["probe", "--no_progress", "--rollout_method", "toy_unannealed", "--prompts", "2", "--rollouts", "2",
            "--max_completion_length", "4", "--marginal_draws", "16", "--output_file", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["method"] == "toy_unannealed" and result["rows"][0]["n_rollouts"] == 4

    with pytest.raises(NotImplementedError, match="toy_unannealed.*on vLLM: a test method"):
        tiny.config(tmp_path, rollout_method="toy_unannealed", use_vllm=True)
    with pytest.raises(ValueError, match="not supported on verl: the verl integration sends"):
        NCGRPOVerlConfig(rollout_method="toy_unannealed")
    with pytest.raises(ValueError, match="num_generations must be even"):
        tiny.config(
            tmp_path, rollout_method="toy_unannealed", num_generations=5, per_device_train_batch_size=10
        )


class Carded(Unannealed):
    name = "toy_carded"

    def card_settings(self, args):
        return [f"toy_half_sigma {0.5 * float(args.sigma0)}"]


def test_the_model_card_line_comes_from_the_method(tmp_path) -> None:
    """The card names a new method's own settings through its hooks; no name is tested in
    trainer/model_card.py (issue 45)."""
    from types import SimpleNamespace

    from ncgrpo.methods import baseline_method
    from ncgrpo.trainer import model_card

    args = SimpleNamespace(
        rollout_method="toy_carded",
        num_generations=4,
        sigma0=0.4,
        target_marginal_tv=None,
        noise_site="final_norm",
        noise_layer_decay=0.5,
        sigma_schedule="constant",
        branch_prefix="",
    )
    register_method(Carded)
    try:
        line = model_card._method(args)
        assert "rollout_method `toy_carded`" in line and "toy_half_sigma 0.2" in line and "sigma0 0.4" in line
        assert model_card._short_method(args) == "NC-GRPO (rollout_method `toy_carded`)"
    finally:
        unregister_method("toy_carded")
    plain = SimpleNamespace(
        num_generations=4, sigma_schedule="constant"
    )  # no rollout_method: the registry's baseline
    assert model_card._method(plain) == baseline_method().card_line(plain, "")
    assert model_card._short_method(plain) == "vanilla GRPO"
