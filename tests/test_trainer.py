"""NCGRPOConfig / NCGRPOTrainer on TRL 1.16 with a tiny Qwen2.5-VL on the CPU.

Fast: config validation, the importance-sampling policy, the first-token
temperature control, vanilla == GRPOTrainer, latent(sigma0=0) == vanilla, latent/vanilla smoke runs,
Proposition 2 on real rollouts, the image method's clean loss inputs. Slow (``-m slow``): every
method trains two steps.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

from ncgrpo.core import noise as nz
from ncgrpo.core.advantages import decompose_advantages, group_advantages
from ncgrpo.core.noise import parse_noise_site
from ncgrpo.core.plan import plan_rows
from ncgrpo.methods import get_method
from ncgrpo.methods.image import distort_multimodal_fields, distorted_row_images
from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer, apply_noisy_importance_sampling
from ncgrpo.trainer.checkpoints import load_nc_state, save_nc_state
from ncgrpo.trainer.vllm import measure_branch_point, vllm_requests

_spec = importlib.util.spec_from_file_location(
    "tiny_grpo", Path(__file__).parent / "scripts" / "tiny_grpo.py"
)
tiny = importlib.util.module_from_spec(_spec)
sys.modules["tiny_grpo"] = tiny
_spec.loader.exec_module(tiny)

NC_METRICS = (
    "reward/clean",
    "reward/noisy",
    "reward/contrast",
    "noise/first_token_divergence",
    "noise/agreement",
)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def _cfg(tmp_path, **kw) -> NCGRPOConfig:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8)
    base.update(kw)
    return NCGRPOConfig(**base)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(rollout_method="latent", num_generations=3, per_device_train_batch_size=6), "must be even"),
        (
            dict(rollout_method="antithetic", num_generations=6, per_device_train_batch_size=6),
            "multiple of 4",
        ),
        (dict(rollout_method="spsa", num_generations=2), "multiple of 4"),
        (dict(sigma0=-0.1), "sigma0 must be"),
        (dict(sigma0=float("nan")), "sigma0 must be"),
        (dict(rollout_method="noisy"), "unknown"),
        (dict(noise_site="last"), "final_norm"),
        (dict(noise_site="3,3"), "distinct"),
        (dict(sigma_schedule="cosine"), "sigmoid"),
        (dict(antithetic_grouping="separate"), "only applies"),
        (dict(noise_layer_decay=0.0), "noise_layer_decay"),
        (dict(noise_positions="last"), "noise_positions"),
        (dict(first_token_temperature=0.0), "first_token_temperature"),
        (dict(image_noise_step=1000), "image_noise_step"),
        (dict(noisy_importance_sampling="mask"), "noisy_importance_sampling"),
        (dict(schedule_unit="epoch"), "schedule_unit"),
        (dict(spsa_min_sigma_ratio=2.0), "spsa_min_sigma_ratio"),
        (dict(first_token_temperature=float("inf")), "first_token_temperature"),
        (dict(first_token_marginal_draws=0), "first_token_marginal_draws"),
        (dict(spsa_lr=float("nan")), "spsa_lr must be a finite number"),
        (dict(spsa_mu_max=float("inf")), "spsa_mu_max must be a finite number"),
        (dict(marginal_tv_draws=-1), "marginal_tv_draws"),
        (dict(rollout_method="first_token_marginal", noise_site="1"), "no such q_bar"),
        (dict(first_token_temperature_auto=True, noise_site="1"), "first_token_temperature_auto"),
        (
            dict(rollout_method="spsa", num_generations=4, per_device_train_batch_size=4, noise_site="1"),
            "different directions",
        ),
    ],
)
def test_config_validation_says_what_to_fix(tmp_path, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **kw)


def test_config_defaults_and_odd_g_for_vanilla(tmp_path) -> None:
    c = _cfg(tmp_path)
    assert (c.rollout_method, c.sigma0, c.noise_site, c.noisy_importance_sampling) == (
        "latent",
        0.2,
        "final_norm",
        "exclude",
    )
    assert isinstance(c, GRPOConfig)
    _cfg(tmp_path, rollout_method="vanilla", num_generations=3, per_device_train_batch_size=6)  # fine
    _cfg(tmp_path, rollout_method="antithetic", antithetic_grouping="separate")  # G=8: n=4 even


def test_noise_site_parse() -> None:
    assert parse_noise_site("final_norm") == "final_norm"
    assert parse_noise_site("12") == [12]
    assert parse_noise_site(" 14,10 ") == [10, 14]
    assert parse_noise_site(3) == [3]


def test_cli_keys_are_field_names(tmp_path) -> None:
    (c,) = HfArgumentParser(NCGRPOConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "--rollout_method",
            "antithetic",
            "--sigma0",
            "0.5",
            "--noise_site",
            "10,14",
            "--antithetic_grouping",
            "separate",
            "--per_device_train_batch_size",
            "8",
        ]
    )
    assert (c.rollout_method, c.sigma0, c.noise_site_parsed, c.antithetic_grouping) == (
        "antithetic",
        0.5,
        [10, 14],
        "separate",
    )


# ---------------------------------------------------------------------------------------------
# importance sampling policy (TRL's vLLM path; no vLLM here, so on a constructed ratio)
# ---------------------------------------------------------------------------------------------
def test_noisy_importance_sampling() -> None:
    seq = torch.tensor([[1.2], [0.0], [0.0], [2.5]])  # sequence_mask mode: rows 1, 2 masked to 0
    tok = torch.tensor([[1.0, 0.5], [0.0, 3.0], [0.7, 0.0], [1.1, 1.0]])
    noisy = torch.tensor([False, False, True, True])
    assert torch.equal(
        apply_noisy_importance_sampling(seq, noisy, "exclude"), torch.tensor([[1.2], [0.0], [1.0], [1.0]])
    )
    assert torch.equal(apply_noisy_importance_sampling(seq, noisy, "apply"), seq)
    out = apply_noisy_importance_sampling(tok, noisy, "exclude")
    assert torch.equal(out[:2], tok[:2]) and torch.equal(out[2:], torch.ones(2, 2))
    with pytest.raises(ValueError, match="match"):
        apply_noisy_importance_sampling(seq, noisy[:3], "exclude")


def test_the_logged_ratios_the_loss_used_are_taken_as_trl_takes_its_own() -> None:
    """``sampling/importance_sampling_ratio_used/{min,mean,max}``: after the noisy-row policy, over TRL's
    entries (every row in sequence modes, the completion tokens in token modes; none: zeros)."""
    from ncgrpo.trainer.metrics import importance_ratio_stats

    noisy = torch.tensor([False, False, True, True])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    seq = apply_noisy_importance_sampling(torch.tensor([[1.2], [0.0], [3.0], [0.5]]), noisy, "exclude")
    assert importance_ratio_stats(seq, mask, sequence_level=True).tolist() == pytest.approx([0.0, 0.8, 1.2])
    tok = torch.tensor([[1.0, 2.0, 9.0], [0.5, 1.0, 9.0], [4.0, 0.0, 9.0], [0.2, 9.0, 9.0]])
    tok = apply_noisy_importance_sampling(tok, noisy, "exclude")  # the 9s beyond the mask are not counted
    stats = importance_ratio_stats(tok, mask, sequence_level=False)
    assert stats.tolist() == pytest.approx([0.5, 8.5 / 8, 2.0])
    assert importance_ratio_stats(tok, 0 * mask, sequence_level=False).tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# first-token temperature control
# ---------------------------------------------------------------------------------------------
def test_first_token_temperature_scales_only_flagged_prefill_logits() -> None:
    from ncgrpo.engines.controls import first_token_temperature
    from tiny_models import build_tokenizer, tiny_text_model

    tok = build_tokenizer()
    model = tiny_text_model("qwen2", tokenizer=tok)
    enc = tok(["The triangle has sides", "Solve for x: 3x"], padding=True, return_tensors="pt")
    kw = dict(
        max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0
    )
    base = model.generate(**enc, **kw)
    with first_token_temperature(model, [False, True], temperature=1.0, first_token_temperature=2.0) as h:
        out = model.generate(**enc, **kw)
    assert h.calls == 1
    torch.testing.assert_close(out.logits[0][0], base.logits[0][0], rtol=0, atol=0)  # clean row
    torch.testing.assert_close(out.logits[0][1], base.logits[0][1] * 0.5, rtol=0, atol=1e-6)  # T / T_ft
    assert torch.equal(out.sequences, base.sequences)  # greedy: scaling keeps the argmax
    for step in range(1, len(base.logits)):  # decode steps untouched
        torch.testing.assert_close(out.logits[step], base.logits[step], rtol=0, atol=0)
    assert not model.lm_head._forward_hooks  # restored


# ---------------------------------------------------------------------------------------------
# trainer
# ---------------------------------------------------------------------------------------------
def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _last_metrics(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def test_vanilla_equals_grpo_trainer(tmp_path) -> None:
    """rollout_method='vanilla' is TRL's GRPOTrainer: same step-1 loss, grad norm and parameters."""
    ref = tiny.trainer(
        tmp_path / "trl", trainer_cls=GRPOTrainer, args=tiny.grpo_config(tmp_path / "trl", max_steps=1)
    )
    ref.train()  # (Trainer.__init__ seeds the global RNG: build each trainer right before training it)
    ours = tiny.trainer(tmp_path / "nc", rollout_method="vanilla", max_steps=1)
    init = _params(ours.model)
    ours.train()
    a, b = _last_metrics(ref)[0], _last_metrics(ours)[0]
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["reward"] == b["reward"]
    pa, pb = _params(ref.model), _params(ours.model)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert any(not torch.equal(init[k], pb[k]) for k in pb)  # and it did train
    assert not any(k.startswith(("noise/", "reward/")) for k in b)
    assert ours.nc_history == []


def test_latent_sigma0_zero_is_vanilla(tmp_path) -> None:
    """With sigma0 = 0 the hook, planner and metrics change nothing: bit-identical to vanilla."""
    van = tiny.trainer(tmp_path / "v", rollout_method="vanilla", max_steps=1)
    van.train()
    lat = tiny.trainer(tmp_path / "l", rollout_method="latent", sigma0=0.0, max_steps=1)
    lat.train()
    pa, pb = _params(van.model), _params(lat.model)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    m = _last_metrics(lat)[0]
    assert m["noise/sigma_k"] == 0.0 and m["noise/rel_perturbation"] == 0.0


def test_no_gradient_checkpointing_deprecation_reaches_the_user(tmp_path) -> None:
    """transformers 5.2x renamed gradient checkpointing to activation checkpointing. TRL's default is set
    under the new name, and TRL's own calls of the old names around each generation are not shown (only
    TRL can act on them); a value given under the old name (the recipes write it, for vLLM's older
    transformers) moves to the new one, with no warning."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = tiny.trainer(tmp_path, rollout_method="latent", max_steps=1)
        tr.train()
    said = [
        str(w.message) for w in caught if "checkpointing" in str(w.message) and "deprecated" in str(w.message)
    ]
    assert not said, said
    assert tr.args.activation_checkpointing and tr.args.gradient_checkpointing  # still on, as TRL's default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = tiny.config(tmp_path, gradient_checkpointing=False, gradient_checkpointing_kwargs={"x": 1})
    assert off.activation_checkpointing is False and not off.gradient_checkpointing
    assert off.activation_checkpointing_kwargs == {"x": 1}


def _check_run(trainer, expected: tuple[str, ...]) -> None:
    before = _params(trainer.model)
    trainer.train()
    after = _params(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    logs = _last_metrics(trainer)
    assert len(logs) == 2
    for log in logs:
        for name in expected:
            assert name in log, f"{name} not logged; got {sorted(log)}"
            assert math.isfinite(log[name]), (name, log[name])


def test_latent_trains_and_logs(tmp_path) -> None:
    tr = tiny.trainer(tmp_path, rollout_method="latent")
    _check_run(tr, (*NC_METRICS, "noise/sigma_k", "noise/rel_perturbation"))
    rec = tr.nc_history[0]
    assert rec.step == 1 and rec.sigma_k == 1.0
    # the noisy half carries keys NoiseKey(seed, k, prompt_id, j); the clean half none
    for row in rec.rows:
        global_row, branch, noisy, sign, key, _ = row
        assert noisy == (branch >= 2)
        assert (key is None) == (not noisy)
        if noisy:
            assert key[:2] == (0, 1) and key[3] == branch - 2
    # measured relative perturbation ~ sigma_k (Prop. 1: E||h~-h||^2 = sigma^2 ||h||^2; d = 32 here)
    assert 0.3 < _last_metrics(tr)[0]["noise/rel_perturbation"] < 1.7


def test_noise_moves_greedy_first_tokens(tmp_path) -> None:
    """Greedy decoding: clean rows always take the clean argmax; noisy rows depart from it."""
    tr = tiny.trainer(
        tmp_path, rollout_method="latent", sigma0=3.0, max_steps=1, generation_kwargs={"do_sample": False}
    )
    tr.train()
    m = _last_metrics(tr)[0]
    assert m["noise/first_token_divergence_clean"] == 0.0
    assert m["noise/first_token_divergence"] > 0.0
    assert m["noise/first_token_tv"] > 0.0
    assert m["noise/agreement"] < 1.0


def test_agreement_metrics_follow_sigma(tmp_path) -> None:
    """The logged branch-point statistics are model-dependent: no noise, full agreement; more, less."""
    logged = {}
    for sigma0 in (0.0, 0.5, 4.0):
        tr = tiny.trainer(tmp_path / str(sigma0), rollout_method="latent", sigma0=sigma0, max_steps=1)
        tr.train()
        logged[sigma0] = _last_metrics(tr)[0]
    # within float rounding: with share_prompt_prefill the branch forward is one batched 1-token step,
    # whose CPU kernels round identical rows at different batch positions differently (~1e-7 in a logit)
    assert logged[0.0]["noise/first_token_tv"] == pytest.approx(0.0, abs=1e-6)
    assert logged[0.0]["noise/agreement"] == pytest.approx(1.0, abs=1e-6)
    assert logged[0.5]["noise/first_token_tv"] < logged[4.0]["noise/first_token_tv"]
    assert logged[0.5]["noise/agreement"] > logged[4.0]["noise/agreement"]


def test_marginal_tv_is_logged_below_the_per_draw_tv_and_feeds_the_inert_warning(tmp_path) -> None:
    """``noise/first_token_marginal_tv`` (what the noisy half samples from) is logged at the final-norm
    site, is 0 without noise, and is smaller than the per-draw ``noise/first_token_tv``."""
    logged = {}
    for sigma0 in (0.0, 2.0):
        tr = tiny.trainer(tmp_path / str(sigma0), rollout_method="latent", sigma0=sigma0, max_steps=1)
        tr.train()
        logged[sigma0] = _last_metrics(tr)[0]
    assert logged[0.0]["noise/first_token_marginal_tv"] == 0.0
    m = logged[2.0]
    assert 0.0 < m["noise/first_token_marginal_tv"] < m["noise/first_token_tv"], m
    # a layer site has no q_bar through the LM head: not logged there (the per-draw TV is)
    tr = tiny.trainer(tmp_path / "layer", rollout_method="latent", sigma0=2.0, max_steps=1, noise_site="1")
    tr.train()
    m = _last_metrics(tr)[0]
    assert "noise/first_token_marginal_tv" not in m and "noise/first_token_tv" in m


def test_first_token_controls_log_their_marginal(tmp_path) -> None:
    """The temperature control's marginal is exact (its q_bar is softmax(z / T_k), the same as one draw);
    the q_bar control samples through its hook and logs the same estimator as NC-GRPO."""
    tr = tiny.trainer(
        tmp_path / "t", rollout_method="first_token_temperature", first_token_temperature=3.0, max_steps=1
    )
    tr.train()
    m = _last_metrics(tr)[0]
    assert m["noise/first_token_marginal_tv"] == pytest.approx(m["noise/first_token_tv"], rel=1e-5)
    tr = tiny.trainer(tmp_path / "m", rollout_method="first_token_marginal", sigma0=2.0, max_steps=1)
    tr.train()
    m = _last_metrics(tr)[0]
    assert m["noise/sigma_k"] > 0 and m["noise/first_token_marginal_tv"] > 0
    assert m["noise/first_token_tv"] > 0  # each row's q_hat differs from the clean q
    rows = tr.nc_history[0].rows
    assert any(r[2] for r in rows) and all((r[4] is None) == (not r[2]) for r in rows)
    assert all(x == 0.0 for x in tr.nc_history[0].rel)  # no noise in the forward


def test_first_token_temperature_auto_matches_the_noise_marginal(tmp_path) -> None:
    """T0 calibrated at the first generation: the control then moves the first-token distribution as much
    as latent noise at sigma0 does (equal noise-averaged first-token TV), and T0 survives a checkpoint."""
    kw = dict(sigma0=2.0, sigma_schedule="constant", max_steps=1)
    tr = tiny.trainer(
        tmp_path / "c", rollout_method="first_token_temperature", first_token_temperature_auto=True, **kw
    )
    tr.train()
    m = _last_metrics(tr)[0]
    assert tr.nc_state.t0 > 1.0 and m["control/first_token_temperature_t0"] == pytest.approx(tr.nc_state.t0)
    assert m["control/first_token_temperature"] == pytest.approx(tr.nc_state.t0)  # constant schedule
    lat = tiny.trainer(tmp_path / "l", rollout_method="latent", **kw)
    lat.train()
    ml = _last_metrics(lat)[0]
    assert m["noise/first_token_marginal_tv"] == pytest.approx(ml["noise/first_token_marginal_tv"], rel=0.35)
    # the calibrated T0 is part of the checkpoint state; a checkpoint without it cannot be resumed
    save_nc_state(tr, str(tmp_path / "ckpt"))
    again = tiny.trainer(
        tmp_path / "c2", rollout_method="first_token_temperature", first_token_temperature_auto=True, **kw
    )
    load_nc_state(again, str(tmp_path / "ckpt"))
    assert again.nc_state.t0 == tr.nc_state.t0
    with pytest.raises(ValueError, match="no calibrated first_token_temperature_t0"):
        load_nc_state(again, str(tmp_path / "nowhere"))


def test_proposition_2_on_real_rollouts(tmp_path) -> None:
    """Every advantage TRL trains on equals within-half + contrast of its group's rewards."""
    tr = tiny.trainer(tmp_path, rollout_method="latent")
    captured = []
    orig = tr._generate_and_score_completions

    def spy(inputs):
        out = orig(inputs)
        captured.append(out["advantages"].detach().clone())
        return out

    tr._generate_and_score_completions = spy
    tr.train()
    G = tr.num_generations
    for rec, adv_out in zip(tr.nc_history, captured, strict=True):
        r = torch.tensor(rec.rewards).view(-1, G)
        noisy = torch.tensor([row[2] for row in rec.rows]).view(-1, G)[0]
        within, contrast = decompose_advantages(r, noisy)
        torch.testing.assert_close(adv_out.cpu().float(), (within + contrast).flatten(), rtol=0, atol=1e-5)
        torch.testing.assert_close(contrast.sum(1), torch.zeros(r.shape[0]), rtol=0, atol=1e-5)
        assert rec.metrics["reward/contrast"] == pytest.approx(float(contrast[:, 0].mean()), abs=1e-5)


def test_image_method_generates_from_noisy_images_and_trains_on_clean(tmp_path) -> None:
    tr = tiny.trainer(tmp_path, rollout_method="image", image_noise_step=500, max_steps=1)
    outs, gens = [], []
    orig = tr._generate_and_score_completions

    def spy(inputs):
        out = orig(inputs)
        outs.append((inputs, out))
        gens.append(tr._nc_gen)
        return out

    tr._generate_and_score_completions = spy
    tr.train()
    (inputs, out), gen = outs[0], gens[0]
    proc = tiny.processor()
    clean = torch.as_tensor(
        proc.image_processor(images=[x["images"][0] for x in inputs], return_tensors="pt")["pixel_values"]
    )
    torch.testing.assert_close(out["pixel_values"].cpu(), clean, rtol=0, atol=0)  # the loss sees clean images
    per = clean.shape[0] // len(inputs)
    for i, p in enumerate(gen.plans):
        rows = slice(i * per, (i + 1) * per)
        same = torch.equal(gen.plan.inputs["pixel_values"][rows], clean[rows])
        assert same == (not p.noisy), f"row {i}: generation saw {'clean' if same else 'noisy'} pixels"
    noisy_rows = [i for i, p in enumerate(gen.plans) if p.noisy]  # G=4, one prompt: rows 2, 3
    a, b = (gen.plan.inputs["pixel_values"][i * per : (i + 1) * per] for i in noisy_rows)
    assert torch.equal(a, b)  # one distorted copy per prompt, shared by its noisy half (NoisyRollout)
    assert _last_metrics(tr)[0]["image_noise/t"] == 500.0  # constant schedule: t = image_noise_step


def _unpatchify(pv: torch.Tensor, grid: torch.Tensor, patch: int = 14, merge: int = 2) -> torch.Tensor:
    """Qwen-VL ``pixel_values`` of one image -> ``# [3, H, W]`` (normalised pixels; temporal copy 0)."""
    _, gh, gw = (int(v) for v in grid)
    x = pv.reshape(gh // merge, gw // merge, merge, merge, 3, -1, patch, patch)[:, :, :, :, :, 0]
    return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * patch, gw * patch)


def test_image_distortion_follows_noisyrollout_order(tmp_path) -> None:
    # NoisyRollout: RGB and resize to the processor's size first, then per-pixel noise, then the
    # processor without a second resize. Distorting the original instead interpolated the noise:
    # on these images (tiny processor, 784..3136 pixels) an upsampled 20x15 image's neighbouring
    # pixels were correlated ~0.7 and an L image had identical noise on its three channels.
    import numpy as np
    from PIL import Image

    from ncgrpo.core.image_noise import ResizePolicy, distort_images, prompt_image_seed

    tr = tiny.trainer(tmp_path, rollout_method="image", image_noise_step=500, max_steps=1)
    ip = tiny.processor().image_processor
    policy = ResizePolicy.from_image_processor(ip)
    imgs = [
        Image.new("L", (20, 15), 128),  # smaller than min_pixels: upsampled
        Image.new("RGB", (100, 70), (128, 128, 128)),  # larger than max_pixels: downsampled
        Image.new("RGBA", (56, 56), (128, 128, 128, 255)),  # within
    ]
    G = tr.num_generations
    images = [[im] for im in imgs for _ in range(G)]  # one prompt per image, G rows each
    clean = ip(images=[row[0] for row in images], return_tensors="pt")
    pids = [pid for pid in (10, 11, 12) for _ in range(G)]
    plans = plan_rows(range(len(images)), pids, num_generations=G, method=get_method("image"), seed=0, step=1)
    fields = {"pixel_values": clean["pixel_values"], "image_grid_thw": clean["image_grid_thw"]}
    out = distort_multimodal_fields(tr.processing_class, images, fields, plans, 500)
    pv, grid = out["pixel_values"], clean["image_grid_thw"]
    offsets = [0, *torch.cumsum(grid.prod(-1), 0).tolist()]
    for i, p in enumerate(plans):
        rows = slice(offsets[i], offsets[i + 1])
        if not p.noisy:
            assert torch.equal(pv[rows], clean["pixel_values"][rows])
            continue
        seed = prompt_image_seed(p.key.seed, p.key.step, p.prompt_id)
        want = ip(images=distort_images(images[i], 500, seed, policy), do_resize=False, return_tensors="pt")
        torch.testing.assert_close(pv[rows], want["pixel_values"], rtol=0, atol=0)
        d = (_unpatchify(pv[rows], grid[i]) - _unpatchify(clean["pixel_values"][rows], grid[i])).double()
        d = d * torch.tensor(ip.image_std, dtype=torch.float64)[:, None, None]  # back to [0, 1] units
        nb = np.corrcoef(d[:, :, :-1].flatten(), d[:, :, 1:].flatten())[0, 1]
        ch = np.corrcoef(d[0].flatten(), d[1].flatten())[0, 1]
        assert abs(nb) < 0.1 and abs(ch) < 0.1, (i, nb, ch)
        assert 0.3 < float(d.std()) < 0.42, (i, float(d.std()))  # clamped 0.505-std noise on mid-grey
    assert torch.equal(
        distort_multimodal_fields(tr.processing_class, images, fields, plans, 0)["pixel_values"],
        clean["pixel_values"],
    )
    # clean pixels from another size rule (a 1x2x2 grid each) cannot be matched: an error, not a mix
    wrong = dict(fields, image_grid_thw=torch.tensor([[1, 2, 2]] * len(images)))
    with pytest.raises(RuntimeError, match="patch grid"):
        distort_multimodal_fields(tr.processing_class, images, wrong, plans, 500)


def test_separate_grouping_advantages(tmp_path) -> None:
    tr = tiny.trainer(
        tmp_path,
        rollout_method="antithetic",
        antithetic_grouping="separate",
        num_generations=8,
        per_device_train_batch_size=8,
        max_steps=1,
    )
    captured = []
    orig = tr._generate_and_score_completions
    tr._generate_and_score_completions = lambda inputs: captured.append(orig(inputs)) or captured[-1]
    tr.train()
    rec = tr.nc_history[0]
    ids = torch.tensor([row[5] for row in rec.rows])
    want, _ = group_advantages(torch.tensor(rec.rewards), ids)
    torch.testing.assert_close(captured[0]["advantages"].cpu(), want, rtol=0, atol=0)
    assert len(set(ids.tolist())) == 2 * len(rec.rows) // 8
    assert list(tr._logs["advantages"])[-len(want) :] == pytest.approx(want.tolist())


def test_spsa_update_is_eq6(tmp_path) -> None:
    """One SPSA step from hand-made rewards equals eq. (6) with r_p-weighted pair gaps."""
    tr = tiny.trainer(
        tmp_path,
        rollout_method="spsa",
        num_generations=8,
        per_device_train_batch_size=8,
        spsa_lr=0.5,
        spsa_mu_max=10.0,
        spsa_max_step_ratio=None,  # eq. (6) as written
    )
    plans = plan_rows(range(8), [4] * 8, num_generations=8, method=get_method("spsa"), seed=0, step=3)
    rewards = torch.tensor([0.0, 1, 0, 1, 1.0, 0.0, 0.0, 1.0])  # pairs (+,-): (1, 0), (0, 1)
    d = tr.nc_state.mu.numel()
    get_method("spsa").update(tr, plans, rewards, 0.2, 3)
    u = nz.draw_direction(0, 3, d)
    r = [
        float(nz.draw_eps(nz.NoiseKey(0, 3, 4, j), [0], d, mode="rank_one")[0] @ u / (u @ u)) for j in (0, 1)
    ]
    g = ((1 - 0) * r[0] + (0 - 1) * r[1]) / 2 / (2 * 0.2) * u
    torch.testing.assert_close(tr.nc_state.mu, 0.5 * g, rtol=1e-5, atol=1e-6)


def test_spsa_skips_the_update_once_the_noise_has_annealed(tmp_path) -> None:
    """Below spsa_min_sigma_ratio * sigma0 eq. (6)'s 1/sigma_k step would explode: mu stays put."""
    tr = tiny.trainer(tmp_path, rollout_method="spsa", num_generations=8, per_device_train_batch_size=8)
    plans = plan_rows(range(8), [4] * 8, num_generations=8, method=get_method("spsa"), seed=0, step=3)
    rewards = torch.tensor([0.0, 1, 0, 1, 1.0, 0.0, 0.0, 1.0])
    sigma0 = tr.args.sigma0
    assert not get_method("spsa").update(tr, plans, rewards, 0.01 * sigma0, 3)
    assert torch.count_nonzero(tr.nc_state.mu) == 0
    assert get_method("spsa").update(tr, plans, rewards, 0.5 * sigma0, 3)
    assert torch.count_nonzero(tr.nc_state.mu) > 0
    # just above the threshold eq. (6)'s step is large (1 / sigma_k); it is bounded to 10% of mu_max
    tr.nc_state.mu.zero_()
    assert get_method("spsa").update(tr, plans, rewards, 0.06 * sigma0, 3)
    bound = tr.args.spsa_max_step_ratio * tr.args.spsa_mu_max
    assert float(tr.nc_state.mu.norm()) == pytest.approx(bound, rel=1e-5)


def test_schedule_counts_optimizer_steps_or_generations(tmp_path) -> None:
    """schedule_unit='generation': one rollout batch feeding m optimizer steps is one step of eq. (3)."""
    tr = tiny.trainer(tmp_path, max_steps=60)
    tr.state.max_steps = 60
    assert tr.schedule_position(0) == (1, 60) and tr.schedule_position(59) == (60, 60)
    tr = tiny.trainer(
        tmp_path / "g",
        max_steps=60,
        schedule_unit="generation",
        gradient_accumulation_steps=1,
        steps_per_generation=4,
    )
    tr.state.max_steps = 60
    assert [tr.schedule_position(s) for s in (0, 3, 4, 59)] == [(1, 15), (1, 15), (2, 15), (15, 15)]


def test_first_token_temperature_anneals_on_the_noise_schedule(tmp_path) -> None:
    tr = tiny.trainer(
        tmp_path,
        rollout_method="first_token_temperature",
        first_token_temperature=3.0,
        temperature=1.0,
        sigma_schedule="sigmoid",
        schedule_k_mid=40,
    )
    K = 60
    assert get_method("first_token_temperature").temperature_at(tr, 1, K) == pytest.approx(3.0, abs=1e-3)
    assert get_method("first_token_temperature").temperature_at(tr, 40, K) == pytest.approx(
        2.0
    )  # k_mid: half the excess
    assert get_method("first_token_temperature").temperature_at(tr, 60, K) == pytest.approx(1.0, abs=1e-3)


# ---------------------------------------------------------------------------------------------
# every method end to end (slow)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "extra", "metrics"),
    [
        ("antithetic", {}, ("noise/sigma_k", "noise/rel_perturbation")),
        (
            "antithetic",
            {"antithetic_grouping": "separate", "num_generations": 8, "per_device_train_batch_size": 8},
            ("noise/sigma_k",),
        ),
        ("spsa", {}, ("noise/sigma_k", "spsa/mu_norm")),
        ("image", {}, ("image_noise/t",)),
        ("first_token_temperature", {}, ()),
        (
            "latent",
            {"noise_site": "0,1", "noise_positions": "all"},
            ("noise/sigma_k", "noise/rel_perturbation"),
        ),
        (
            "latent",
            {"sigma_schedule": "sigmoid", "schedule_k_mid": 1.0, "schedule_gamma": 4.0},
            ("noise/sigma_k",),
        ),
    ],
)
def test_every_method_trains(tmp_path, method, extra, metrics) -> None:
    tr = tiny.trainer(tmp_path, rollout_method=method, **extra)
    _check_run(tr, (*NC_METRICS, *metrics))


@pytest.mark.slow
def test_text_model_without_question_id(tmp_path) -> None:
    """A text-only model and a dataset without question_id (prompt ids from token hashes)."""
    import datasets

    from tiny_models import build_tokenizer, tiny_text_model

    tok = build_tokenizer()
    ds = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(4)]
    )
    tr = NCGRPOTrainer(
        model=tiny_text_model("qwen2", tokenizer=tok),
        reward_funcs=[tiny.hash_reward],
        args=tiny.config(tmp_path, rollout_method="latent"),
        train_dataset=ds,
        processing_class=tok,
    )
    _check_run(tr, (*NC_METRICS, "noise/sigma_k"))
    pids = {row[4][2] for row in tr.nc_history[0].rows if row[4] is not None}
    assert len(pids) == 1  # one prompt per step here (batch 4 = one group)


# ---------------------------------------------------------------------------------------------
# use_vllm: what is refused before an engine starts, and the request seam (a fake engine; the real one
# is tests/test_trainer_vllm.py, marker vllm)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(vllm_mode="server", rollout_method="image"), "distorted images would never reach the server"),
        (dict(noise_site="1"), "propagating layer site"),
        (dict(rollout_method="first_token_marginal"), "transformers generate path only"),
    ],
)
def test_use_vllm_refusals_say_why(tmp_path, kw, match) -> None:
    with pytest.raises(NotImplementedError, match=match):
        _cfg(tmp_path, use_vllm=True, **kw)


def test_use_vllm_allowed_configs(tmp_path) -> None:
    for m in ("latent", "antithetic", "spsa", "image", "first_token_temperature"):
        assert _cfg(tmp_path, use_vllm=True, rollout_method=m).use_vllm
        # colocated TP > 1: the TP group's rows are gathered as TRL gathers its prompts (_tp_group_rows)
        assert _cfg(tmp_path, use_vllm=True, rollout_method=m, vllm_tensor_parallel_size=2).use_vllm
    _cfg(tmp_path, use_vllm=True, vllm_mode="server", rollout_method="vanilla")  # TRL's path, unchanged
    for m in ("latent", "antithetic", "spsa", "first_token_temperature"):  # server: per-row requests
        assert _cfg(
            tmp_path, use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2, rollout_method=m
        )


class _FakeParams:
    """The parts of ``vllm.SamplingParams`` the seam uses."""

    def __init__(self, n=1, extra_args=None):
        self.n, self.extra_args = n, extra_args

    def clone(self):
        return _FakeParams(self.n, dict(self.extra_args) if self.extra_args else None)


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.calls.append((prompts, sampling_params))
        return [f"out{i}" for i in range(len(prompts))]


def test_vllm_seam_sends_one_request_per_row_with_its_spec(tmp_path) -> None:
    from types import SimpleNamespace

    tr = tiny.trainer(tmp_path, rollout_method="antithetic", max_steps=1)
    llm = _FakeLLM()
    tr.vllm_generation = SimpleNamespace(llm=llm)
    plans = plan_rows(
        range(8), [5] * 4 + [6] * 4, num_generations=4, method=get_method("antithetic"), seed=3, step=2
    )
    rows = [get_method("antithetic").row_noise(p, 0.5) for p in plans]
    prompts = [[1, 2, i] for i in range(8)]
    with vllm_requests(tr, rows):
        out = llm.generate(prompts, _FakeParams(extra_args={"other": 1}), use_tqdm=False)
    assert out == [f"out{i}" for i in range(8)] and "generate" not in vars(llm)
    ((sent_prompts, params),) = llm.calls
    assert sent_prompts is prompts and len(params) == 8
    for p, sp in zip(plans, params, strict=True):
        assert sp.extra_args["other"] == 1  # TRL's own extra_args are kept
        spec = sp.extra_args.get("ncgrpo")
        if not p.noisy:
            assert spec is None
            continue
        k = p.key
        assert (spec["seed"], spec["step"], spec["prompt_id"], spec["draw"]) == (
            k.seed,
            k.step,
            k.prompt_id,
            k.draw,
        )
        assert (spec["sigma"], spec["sign"], spec["mode"]) == (0.5, int(p.sign), "antithetic")
    # a generation that does not call the engine exactly once with one request per row is an error
    with pytest.raises(RuntimeError, match="did not call"), vllm_requests(tr, rows):
        pass
    with pytest.raises(RuntimeError, match="one request per row"), vllm_requests(tr, rows):
        llm.generate(prompts[:4], _FakeParams())
    with pytest.raises(RuntimeError, match="twice"), vllm_requests(tr, rows):
        llm.generate(prompts, _FakeParams())
        llm.generate(prompts, _FakeParams())
    assert "generate" not in vars(llm)


def test_vllm_server_seam_splits_trls_n_g_call_into_per_spec_requests(tmp_path) -> None:
    """Server mode: TRL's one ``vllm_client.generate(unique prompts, n=G)`` becomes one request per noisy row
    (its spec JSON-encoded in vllm_xargs) plus one n=k request per prompt's clean half, results in row order."""
    import json
    from types import SimpleNamespace

    tr = tiny.trainer(tmp_path, rollout_method="antithetic", max_steps=1)
    tr.args.vllm_mode = "server"
    calls = []

    class Client:
        def generate(self, prompts, features=None, n=1, generation_kwargs=None, **sampling):
            calls.append((prompts, n, (generation_kwargs or {}).get("vllm_xargs")))
            return {
                "prompt_ids": prompts,
                "completion_ids": [[len(calls), c] for c in range(n)],
                "logprobs": None,
                "logprob_token_ids": None,
            }

    client = Client()
    tr.vllm_generation = SimpleNamespace(vllm_client=client, mode="server")
    G = tr.num_generations
    plans = plan_rows(
        range(8), [5] * 4 + [6] * 4, num_generations=G, method=get_method("antithetic"), seed=3, step=2
    )
    rows = [get_method("antithetic").row_noise(p, 0.5) for p in plans]
    with vllm_requests(tr, rows):
        out = client.generate(prompts=[[1, 2], [3]], n=G, temperature=1.0, generation_kwargs={})
    assert "generate" not in vars(client)
    assert [(p, n) for p, n, _ in calls] == [
        ([[1, 2]], 2),
        ([[1, 2]], 1),
        ([[1, 2]], 1),
        ([[3]], 2),
        ([[3]], 1),
        ([[3]], 1),
    ]
    sent = [None] * 2 + [json.loads(calls[i][2]["ncgrpo"]) for i in (1, 2)]
    sent += [None] * 2 + [json.loads(calls[i][2]["ncgrpo"]) for i in (4, 5)]
    for p, spec in zip(plans, sent, strict=True):
        assert (spec is None) == (not p.noisy)
        if spec is not None:
            assert (spec["prompt_id"], spec["draw"], spec["sign"]) == (
                p.key.prompt_id,
                p.key.draw,
                int(p.sign),
            )
    assert out["completion_ids"] == [[1, 0], [1, 1], [2, 0], [3, 0], [4, 0], [4, 1], [5, 0], [6, 0]]
    with pytest.raises(RuntimeError, match="n=num_generations"), vllm_requests(tr, rows):
        client.generate(prompts=[[1, 2], [3]], n=1)
    with pytest.raises(RuntimeError, match="did not call"), vllm_requests(tr, rows):
        pass


def test_vllm_seam_sends_the_controls_logit_scale_on_noisy_rows(tmp_path) -> None:
    """The first-token temperature control on vLLM: noisy rows carry logit_scale = T / T_k, clean none."""
    from types import SimpleNamespace

    tr = tiny.trainer(tmp_path, rollout_method="first_token_temperature", max_steps=1)
    llm = _FakeLLM()
    tr.vllm_generation = SimpleNamespace(llm=llm)
    plans = plan_rows(
        range(4), [5] * 4, num_generations=4, method=get_method("first_token_temperature"), seed=3, step=1
    )
    rows = [get_method("first_token_temperature").row_noise(p, 0.0) for p in plans]
    scales = [0.5 if p.noisy else None for p in plans]
    with vllm_requests(tr, rows, logit_scales=scales):
        llm.generate([[1, 2, i] for i in range(4)], _FakeParams())
    ((_, params),) = llm.calls
    got = [(sp.extra_args or {}).get("ncgrpo") for sp in params]
    assert got == [None, None, {"logit_scale": 0.5}, {"logit_scale": 0.5}]


def _generation_inputs(tr):
    """Run one real (transformers-path) training step of ``tr`` and return what its NC-GRPO generation got
    and measured: ``(prompt_ids, images, multimodal_fields, gen)``, and, taken inside the generation (the
    weights and SPSA's mu as they were then), ``measured``: the vLLM path's measurement on the same rows."""
    from ncgrpo.methods.base import Generation

    seen = []
    orig = tr._nc_generate

    def spy(generate, prompt_ids, images, fields, num_generations):
        out = orig(generate, prompt_ids, images, fields, num_generations)
        a = tr._nc_gen
        b = Generation(
            step=a.step,
            total_steps=a.total_steps,
            sigma_k=a.sigma_k,
            plans=a.plans,
            method_values=dict(a.method_values),
            plan=a.plan,
        )
        mu = None if getattr(tr.nc_state, "mu", None) is None else tr.nc_state.mu.clone()
        measure_branch_point(tr, b, a.plan, prompt_ids)
        seen.append(
            dict(
                inputs=tr._nc_inputs,
                prompt_ids=prompt_ids,
                images=images,
                fields=fields,
                gen=a,
                measured=b,
                mu=mu,
            )
        )
        return out

    tr._nc_generate = spy
    tr.train()
    del tr._nc_generate
    return seen


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("latent", dict(sigma0=2.0)),
        ("spsa", dict(sigma0=2.0, spsa_lr=1.0, max_steps=2)),
        ("image", dict(image_noise_step=500)),
        ("first_token_temperature", dict(first_token_temperature=3.0)),
    ],
)
def test_vllm_branch_point_measurement_equals_the_transformers_path(tmp_path, method, extra) -> None:
    """The vLLM path's branch-point measurement (one prompt-only forward of the trainer's model under the same
    rows) gives the numbers the transformers path reads off its own generate, row for row: rel, the argmax, the
    first-token TV and eq. (4)'s agreement (SPSA with a nonzero mu, the distorted images, the control's T_k)."""
    tr = tiny.trainer(tmp_path, rollout_method=method, max_steps=extra.pop("max_steps", 1), **extra)
    seen = _generation_inputs(tr)
    if method == "spsa":
        assert float(seen[-1]["mu"].norm()) > 0  # the second generation steered by the first update
    for s in seen:
        a, b = s["gen"], s["measured"]
        noisy = torch.tensor([p.noisy for p in a.plans])
        assert b.branch_tv is not None and b.rel is not None and b.branch_agreement is not None
        torch.testing.assert_close(b.rel, a.rel, rtol=0, atol=1e-6)
        assert torch.equal(b.branch_argmax, a.branch_argmax)
        torch.testing.assert_close(b.branch_tv, a.branch_tv, rtol=0, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(b.branch_agreement, a.branch_agreement, rtol=0, atol=1e-6, equal_nan=True)
        assert torch.isnan(b.branch_tv[~noisy]).all()
        assert (b.branch_tv[noisy] > 1e-3).all(), b.branch_tv  # every method moves the first token here
        if method in ("latent", "spsa"):
            assert (b.rel[noisy] > 0).all() and (b.rel[~noisy] == 0).all()


def test_vllm_leg_measures_the_branch_point_and_sends_distorted_images(tmp_path) -> None:
    """The image method on vLLM: the noisy rows' PIL images are NoisyRollout's distorted copies (one per
    prompt), the clean rows' the originals; the request seam is entered around TRL's generation; and the
    branch point is measured (on the distorted pixels) as the transformers path measures it."""
    from types import SimpleNamespace

    import numpy as np

    from ncgrpo.core.image_noise import ResizePolicy, distort_images, prompt_image_seed

    # learning_rate 0: the weights after the reference step are the ones it generated with
    tr = tiny.trainer(tmp_path, rollout_method="image", image_noise_step=500, max_steps=1, learning_rate=0.0)
    (ref,) = _generation_inputs(tr)  # one real step: TRL's own prompt ids, images and processed fields
    tr.state.global_step = 0  # generate again for the same step (same keys) on the vLLM leg
    llm = _FakeLLM()
    tr.vllm_generation = SimpleNamespace(llm=llm)
    tr.use_vllm = True  # the vLLM leg of _nc_generate, with the fake engine
    prompt_ids, images, fields = ref["prompt_ids"], ref["images"], ref["fields"]
    G = tr.num_generations
    seen = {}

    def generate(fields, gen_images):
        seen["images"] = gen_images
        llm.generate(prompt_ids, _FakeParams())
        return [[11, 12]] * len(prompt_ids), [[-0.1, -0.2]] * len(prompt_ids)

    tr._nc_inputs = ref["inputs"]
    tr._nc_generate(generate, prompt_ids, images, fields, G)
    gen = tr._nc_gen
    assert gen.method_values == {"image_t": 500} and gen.first_token.tolist() == [11] * len(images)
    assert [p.as_tuple() for p in gen.plans] == [p.as_tuple() for p in ref["gen"].plans]
    policy = ResizePolicy.from_image_processor(tr.processing_class.image_processor)
    for i, p in enumerate(gen.plans):
        if not p.noisy:
            assert seen["images"][i] is images[i]
            continue
        want = distort_images(images[i], 500, prompt_image_seed(p.key.seed, p.key.step, p.prompt_id), policy)
        got = seen["images"][i]
        assert [np.asarray(g).tolist() for g in got] == [np.asarray(w).tolist() for w in want]
        assert not np.array_equal(np.asarray(got[0].resize(images[i][0].size)), np.asarray(images[i][0]))
    ((_, params),) = llm.calls
    assert all(sp.extra_args is None for sp in params)  # image method: no hidden noise
    assert distorted_row_images(tr.processing_class, images, gen.plans, 0) is images
    # the branch point, measured by the trainer on the distorted pixels: the transformers path's numbers
    assert torch.equal(gen.branch_argmax, ref["gen"].branch_argmax)
    torch.testing.assert_close(gen.branch_tv, ref["gen"].branch_tv, rtol=0, atol=1e-6, equal_nan=True)
    assert (gen.branch_tv[torch.tensor([p.noisy for p in gen.plans])] > 0).all()
