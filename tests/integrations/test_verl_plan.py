"""The verl integration's pure part, without verl (default suite): the ``ncgrpo:`` block, the plan of
each verl session, the prompt id, the per-half metrics, the checks of verl's config, and the two
vLLM-plugin changes the integration needed (a patch installed on top of the armed wrapper survives;
vLLM 0.24's V2 requests have no ``prompt_len``). tests/integrations/test_verl.py runs verl's real
classes in .venv-verl.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from ncgrpo.core.advantages import decompose_advantages
from ncgrpo.core.noise import NoiseKey, RowNoise, perturb_rows
from ncgrpo.core.schedule import sigma_schedule
from ncgrpo.engines.vllm import EXTRA_ARGS_KEY, parse_noise_spec
from ncgrpo.engines.vllm_worker import _ArmedLogits
from ncgrpo.integrations.verl import config as ncv
from ncgrpo.integrations.verl.config import (
    VERL_EPS,
    NCGRPOVerlConfig,
    check_verl_config,
    half_metrics,
    plan_session,
    target_metrics,
    verl_prompt_id,
    with_noise,
)


def cfg(**kw) -> NCGRPOVerlConfig:
    return NCGRPOVerlConfig(**{"schedule_total_steps": 60, **kw})


def group(c: NCGRPOVerlConfig, G: int = 12, step: int = 5, prompt_id: int = 77, **kw):
    return [
        plan_session(c, step=step, prompt_id=prompt_id, session_id=i, group_size=G, **kw) for i in range(G)
    ]


def keys(sessions):
    out = []
    for s in sessions:
        spec = s.extra_args.get(EXTRA_ARGS_KEY)
        out.append(
            None
            if spec is None
            else (spec["seed"], spec["step"], spec["prompt_id"], spec["draw"], spec["sign"])
        )
    return out


# --------------------------------------------------------------------------------------------------
# the session plan
# --------------------------------------------------------------------------------------------------
def test_latent_gives_exactly_the_second_half_its_own_draws():
    sessions = group(cfg(), G=12, step=5, prompt_id=77)
    assert [s.noisy for s in sessions] == [False] * 6 + [True] * 6
    assert all(s.extra_args == {} for s in sessions[:6])
    k = keys(sessions)[6:]
    assert k == [(1, 5, 77, j, 1) for j in range(6)]  # NoiseKey(seed, verl step, prompt id, draw)
    sigma = sigma_schedule(5, 60, 0.2, gamma=30.0, k_mid=40.0)
    assert all(s.sigma == sigma and s.extra_args[EXTRA_ARGS_KEY]["sigma"] == sigma for s in sessions[6:])
    for s in sessions[6:]:  # every spec is one the plugin accepts, with a noisy row
        spec = parse_noise_spec(s.extra_args)
        assert spec.noisy and spec.row.mode == "independent"


def test_keys_are_unique_per_draw_across_prompts_and_steps():
    c = cfg()
    seen = [k for pid in (1, 2) for step in (3, 4) for k in keys(group(c, step=step, prompt_id=pid)) if k]
    assert len(seen) == 2 * 2 * 6 and len(set(seen)) == len(seen)


def test_antithetic_pairs_share_a_draw_with_opposite_signs():
    sessions = group(cfg(rollout_method="antithetic"), G=12)
    k = keys(sessions)
    assert k[:6] == [None] * 6
    assert [(d, sgn) for *_, d, sgn in k[6:]] == [(0, 1), (0, -1), (1, 1), (1, -1), (2, 1), (2, -1)]
    assert {parse_noise_spec(s.extra_args).row.mode for s in sessions[6:]} == {"antithetic"}


def test_validation_and_vanilla_are_clean():
    assert all(s.extra_args == {} and not s.noisy for s in group(cfg(), validate=True))
    assert all(s.extra_args == {} and not s.noisy for s in group(cfg(rollout_method="vanilla")))


def test_first_token_temperature_control_scales_the_noisy_halfs_first_token():
    c = cfg(rollout_method="first_token_temperature", first_token_temperature=2.0)
    for step in (1, 40, 60):
        sessions = group(c, step=step, temperature=1.0)
        t_k = 1.0 + (2.0 - 1.0) * sigma_schedule(step, 60, 1.0)
        assert all(s.extra_args == {} for s in sessions[:6])
        assert [s.extra_args[EXTRA_ARGS_KEY] for s in sessions[6:]] == [{"logit_scale": 1.0 / t_k}] * 6
    with pytest.raises(ValueError, match="temperature > 0"):
        group(c, temperature=0.0)


def test_sigma_follows_verls_step_and_anneals_to_zero():
    c = cfg(sigma0=0.5)
    for step in (1, 30, 40, 50, 60):
        noisy = group(c, step=step)[6:]
        assert {s.sigma for s in noisy} == {sigma_schedule(step, 60, 0.5, gamma=30.0, k_mid=40.0)}
    assert group(c, step=40)[6].sigma == pytest.approx(0.25)  # eq. (3): half way at k_mid
    assert group(c, step=60)[6].sigma < 1e-3 * 0.5
    assert group(cfg(sigma_schedule="constant"), step=59)[6].sigma == 0.2


def test_the_plan_is_a_pure_function_of_its_numbers_in_any_process():
    """Every agent-loop worker, vLLM replica and tensor-parallel rank gets the same key from the same
    numbers: here a fresh interpreter with another hash seed computes the same specs and prompt id."""
    prompt = {"raw_prompt": [{"role": "user", "content": "Find x."}], "uid": "u"}
    code = textwrap.dedent(
        """
        import json
        from ncgrpo.integrations.verl.config import NCGRPOVerlConfig, plan_session, verl_prompt_id
        c = NCGRPOVerlConfig(schedule_total_steps=60)
        pid = verl_prompt_id({"raw_prompt": [{"role": "user", "content": "Find x."}], "uid": "other"})
        print(json.dumps([pid, [dict(plan_session(c, step=7, prompt_id=pid, session_id=i, group_size=4).extra_args)
                                for i in range(4)]]))
        """
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    import json

    pid, specs = json.loads(out.stdout.strip().splitlines()[-1])
    assert pid == verl_prompt_id(prompt)
    here = [
        dict(plan_session(cfg(), step=7, prompt_id=pid, session_id=i, group_size=4).extra_args)
        for i in range(4)
    ]
    assert specs == here and specs[2] and specs[3] and not specs[0]


def test_the_package_holds_the_pure_parts_names_and_the_verl_classes_lazily():
    """``ncgrpo.integrations.verl.NCGRPOVerlConfig`` (as the verl recipe names it) and every other public name
    of the pure part resolve on the package without verl; the verl classes are named but load on access."""
    import ncgrpo.integrations.verl as package
    from ncgrpo.integrations.verl import config

    pure = [name for name in package.__all__ if name not in package._VERL_CLASSES]
    assert pure == config.__all__
    assert all(getattr(package, name) is getattr(config, name) for name in pure)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope  # noqa: B018


# --------------------------------------------------------------------------------------------------
# the prompt id
# --------------------------------------------------------------------------------------------------
def _msgs(text: str, image=None):
    content = (
        [{"type": "image", "image": image}, {"type": "text", "text": text}] if image is not None else text
    )
    return [{"role": "user", "content": content}]


def test_prompt_id_reads_content_not_uid_or_index_and_sees_image_pixels():
    a, b = Image.new("RGB", (8, 8), (0, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 0))
    b.putpixel((3, 3), (1, 0, 0))
    base = verl_prompt_id({"raw_prompt": _msgs("Find x.", a), "uid": "1", "index": 0})
    assert base == verl_prompt_id({"raw_prompt": _msgs("Find x.", a.copy()), "uid": "2", "index": 0})
    assert base != verl_prompt_id({"raw_prompt": _msgs("Find x.", b), "uid": "1", "index": 0})  # one pixel
    assert base != verl_prompt_id({"raw_prompt": _msgs("Find y.", a), "uid": "1", "index": 0})
    assert 0 <= base < 2**63
    arr = np.array([_msgs("Find x.", a)[0]], dtype=object)  # verl hands rows over as numpy object arrays
    assert verl_prompt_id({"raw_prompt": arr}) == verl_prompt_id({"raw_prompt": list(arr)})
    q = verl_prompt_id({"raw_prompt": _msgs("Find x."), "extra_info": {"question_id": "geo-17"}})
    assert q == verl_prompt_id({"raw_prompt": _msgs("other"), "extra_info": {"question_id": "geo-17"}})
    with pytest.raises(ValueError, match="raw_prompt"):
        verl_prompt_id({"uid": "1"})


def test_with_noise_merges_into_a_copy():
    sp = {"temperature": 1.0, "extra_args": {"kv_transfer_params": {"a": 1}}}
    spec = plan_session(cfg(), step=1, prompt_id=1, session_id=3, group_size=4).extra_args
    out = with_noise(sp, spec)
    assert out["extra_args"] == {"kv_transfer_params": {"a": 1}, **spec}
    assert sp == {
        "temperature": 1.0,
        "extra_args": {"kv_transfer_params": {"a": 1}},
    }  # caller's dict untouched
    assert with_noise(sp, {}) == sp


# --------------------------------------------------------------------------------------------------
# per-half metrics: eq. (5)'s contrast with verl's scale
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", [True, False])
def test_half_metrics_contrast_is_eq5s_with_verls_scale(norm):
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 2, (5, 12), generator=g).float() * 0.9 + torch.rand(5, 12, generator=g) * 0.1
    mask = torch.tensor([False] * 6 + [True] * 6)
    _, contrast = decompose_advantages(r, mask, scale="group" if norm else "none", eps=VERL_EPS)
    perm = torch.randperm(60, generator=g)  # rows arrive in any order
    uids = [f"u{i // 12}" for i in range(60)]
    m = half_metrics(
        r.flatten()[perm],
        [uids[i] for i in perm],
        mask.repeat(5)[perm],
        torch.full((60,), 0.13),
        norm_by_std=norm,
    )
    assert m["reward/clean"] == pytest.approx(float(r[:, :6].mean()))
    assert m["reward/noisy"] == pytest.approx(float(r[:, 6:].mean()))
    assert m["reward/contrast"] == pytest.approx(float(contrast[:, 0].mean()), rel=1e-5)
    assert m["noise/sigma_k"] == pytest.approx(0.13)


def test_half_metrics_skip_groups_without_both_halves():
    m = half_metrics([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], [False, True, False, False], [0, 0.2, 0, 0])
    assert m["reward/contrast"] == pytest.approx(
        (1.0 - 0.0) / (2 * (float(np.std([1, 0], ddof=1)) + VERL_EPS))
    )
    assert "reward/contrast" not in half_metrics([1.0, 0.0], ["a", "a"], [False, False], [0, 0])


# --------------------------------------------------------------------------------------------------
# the config block and verl's settings
# --------------------------------------------------------------------------------------------------
def verl_config(**over):
    c = {
        "trainer": {"use_v1": True, "v1": {"trainer_mode": "sync"}, "total_training_steps": 60},
        "actor_rollout_ref": {
            "rollout": {"name": "vllm", "n": 12, "temperature": 1.0},
            "actor": {"policy_loss": {"loss_mode": "vanilla"}},
        },
        "algorithm": {
            "adv_estimator": "grpo",
            "rollout_correction": {"rollout_is": None, "rollout_rs": None, "bypass_mode": False},
        },
        "ncgrpo": {"rollout_method": "latent", "sigma0": 0.2},
    }
    for path, value in over.items():
        node = c
        *head, last = path.split(".")
        for p in head:
            node = node[p]
        node[last] = value
    return c


def test_config_block_reads_K_from_verl_and_refuses_what_it_cannot_run():
    c = NCGRPOVerlConfig.from_verl_config(verl_config())
    assert c.schedule_total_steps == 60 and c.sigma0 == 0.2
    assert (
        NCGRPOVerlConfig.from_verl_config(
            verl_config(**{"ncgrpo.schedule_total_steps": 7})
        ).schedule_total_steps
        == 7
    )
    with pytest.raises(ValueError, match="needs K"):
        NCGRPOVerlConfig.from_verl_config(verl_config(**{"trainer.total_training_steps": None}))
    with pytest.raises(ValueError, match="did you mean 'sigma0'"):
        NCGRPOVerlConfig.from_mapping({"sigma_0": 0.2})
    for method, why in [("image", "EasyR1"), ("spsa", "steering vector"), ("first_token_marginal", "q_bar")]:
        with pytest.raises(ValueError, match=why):
            NCGRPOVerlConfig(rollout_method=method)
    with pytest.raises(ValueError, match="sigma0"):
        NCGRPOVerlConfig(sigma0=-0.1)
    with pytest.raises(ValueError, match="schedule kind"):
        NCGRPOVerlConfig(sigma_schedule="cosine")


@pytest.mark.parametrize(
    "path, value, match",
    [
        ("trainer.use_v1", False, "use_v1"),
        ("trainer.v1.trainer_mode", "colocate_async", "resume"),
        ("actor_rollout_ref.rollout.name", "sglang", "vLLM plugin"),
        ("actor_rollout_ref.rollout.n", 7, "even"),
        ("algorithm.adv_estimator", "gae", "joint-group"),
        ("algorithm.rollout_correction.rollout_is", "sequence", "reweight or drop"),
        ("algorithm.rollout_correction.rollout_rs", "seq_mean_k3", "reweight or drop"),
        ("algorithm.rollout_correction.bypass_mode", True, "PPO anchor"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "bypass_mode", "bypass_mode"),
    ],
)
def test_verl_settings_that_would_silently_break_nc_grpo_are_refused(path, value, match):
    check_verl_config(verl_config())  # the recipe's settings pass
    with pytest.raises(ValueError, match=match):
        check_verl_config(verl_config(**{path: value}))


def test_refusals_are_lifted_where_they_should_be():
    check_verl_config(verl_config(**{"ncgrpo.rollout_method": "vanilla", "trainer.use_v1": False}))
    check_verl_config(
        verl_config(
            **{
                "ncgrpo.noisy_importance_sampling": "apply",
                "algorithm.rollout_correction.rollout_is": "token",
            }
        )
    )
    with pytest.raises(ValueError, match="multiple of 4"):
        check_verl_config(
            verl_config(**{"ncgrpo.rollout_method": "antithetic", "actor_rollout_ref.rollout.n": 6})
        )


# --------------------------------------------------------------------------------------------------
# the target schedule (target_marginal_tv, target_scope prompt): solved per prompt in the vLLM engine
# --------------------------------------------------------------------------------------------------
def tcfg(**kw) -> NCGRPOVerlConfig:
    return cfg(**{"target_marginal_tv": 0.01, "target_scope": "prompt", **kw})


def test_the_target_is_accepted_per_prompt_and_refused_per_batch_with_its_reason():
    c = tcfg()
    assert (c.target_scope, c.sigma_max, c.marginal_tv_draws) == ("prompt", 2.0, 64)
    assert NCGRPOVerlConfig().target_scope == "batch"  # NCGRPOConfig's default
    with pytest.raises(
        ValueError, match="target_scope='batch' is not supported on verl.*target_scope=prompt"
    ):
        cfg(target_marginal_tv=0.01)  # the default scope, batch
    with pytest.raises(ValueError, match="asynchronous"):
        cfg(target_marginal_tv=0.01, target_scope="batch")
    with pytest.raises(ValueError, match="'batch' or 'prompt'"):
        tcfg(target_scope="group")
    # the methods whose noisy half is not set by a sigma keep their reasons (SPSA and the image method are
    # refused on verl before that: their verl_refusal)
    for method, why in [("first_token_temperature", "not by a sigma"), ("vanilla", "no noisy half")]:
        with pytest.raises(ValueError, match=why):
            tcfg(rollout_method=method)
    for method, why in [("spsa", "steering vector"), ("image", "EasyR1")]:
        with pytest.raises(ValueError, match=why):
            tcfg(rollout_method=method)
    tcfg(rollout_method="antithetic")
    for kw, match in [
        ({"target_marginal_tv": 0.0}, r"in \(0, 1\]"),
        ({"target_marginal_tv": 1.5}, r"in \(0, 1\]"),
        ({"sigma_max": 0.0}, "sigma_max"),
        ({"sigma_max": 11.0}, "sigma_max"),
        ({"sigma0": 0.0}, "first guess"),
        ({"sigma0": 3.0}, "above sigma_max"),
        ({"marginal_tv_draws": 7}, "even"),
        ({"marginal_tv_draws": 4}, ">= 6"),
    ]:
        with pytest.raises(ValueError, match=match):
            tcfg(**kw)
    with pytest.raises(ValueError, match="temperature > 0"):
        check_verl_config(
            verl_config(
                **{
                    "ncgrpo.target_marginal_tv": 0.01,
                    "ncgrpo.target_scope": "prompt",
                    "actor_rollout_ref.rollout.temperature": 0.0,
                }
            )
        )
    check_verl_config(verl_config(**{"ncgrpo.target_marginal_tv": 0.01, "ncgrpo.target_scope": "prompt"}))


def test_the_target_bounds_are_the_trainers():
    pytest.importorskip("trl")  # the trainer's config; .venv-verl has no TRL (the default suite runs this)
    from ncgrpo.trainer.config import SIGMA0_MAX, TARGET_DRAWS, NCGRPOConfig

    assert (ncv.TARGET_DRAWS, ncv.SIGMA0_MAX) == (TARGET_DRAWS, SIGMA0_MAX)
    fields = NCGRPOConfig.__dataclass_fields__
    assert ncv.NCGRPOVerlConfig().sigma_max == fields["sigma_max"].default
    assert ncv.NCGRPOVerlConfig().marginal_tv_draws == fields["marginal_tv_draws"].default
    if "target_scope" in fields:  # the lead's field (issue 46): the same default
        assert ncv.NCGRPOVerlConfig().target_scope == fields["target_scope"].default


@pytest.mark.parametrize("method, mode", [("latent", "independent"), ("antithetic", "antithetic")])
def test_the_noisy_half_asks_the_plugin_for_the_annealed_target_and_the_clean_half_for_nothing(method, mode):
    c = tcfg(rollout_method=method, sigma0=0.3, sigma_max=1.5, marginal_tv_draws=32)
    for step in (1, 40, 55):
        sessions = group(c, step=step, temperature=0.7)
        tv = 0.01 * sigma_schedule(step, 60, 1.0, gamma=30.0, k_mid=40.0)
        assert all(s.extra_args == {} and not s.noisy for s in sessions[:6])
        for s in sessions[6:]:
            spec = s.extra_args[EXTRA_ARGS_KEY]
            assert spec["target"] == {
                "tv": pytest.approx(tv),
                "draws": 32,
                "temperature": 0.7,
                "start": 0.3,
                "sigma_max": 1.5,
                "mode": mode,
                "rtol": 0.02,
            }
            assert spec["target"]["tv"] == c.target_at(step) and spec["mode"] == mode
            assert spec["sigma"] == 0.0 and spec["step"] == step and spec["prompt_id"] == 77
            assert s.target == spec["target"]["tv"] and math.isnan(s.sigma)  # the engine solves sigma
            assert s.provenance()["target"] == s.target and s.provenance()["prompt_id"] == 77
            parsed = parse_noise_spec(s.extra_args)  # the plugin's own parse: a target, the session's key
            assert parsed.target is not None and parsed.target.tv == spec["target"]["tv"]
        assert keys(sessions) == keys(group(cfg(rollout_method=method), step=step))  # the same noise keys
    with pytest.raises(ValueError, match="temperature > 0"):
        group(c, temperature=0.0)


def test_a_target_annealed_to_zero_sends_sigma_zero_without_a_solve():
    c = tcfg(sigma_schedule="linear")
    (s,) = group(c, step=60)[6:7]
    assert s.target == 0.0 and s.sigma == 0.0
    spec = s.extra_args[EXTRA_ARGS_KEY]
    assert "target" not in spec and spec["sigma"] == 0.0
    assert not parse_noise_spec(s.extra_args).row.noisy  # the plugin leaves the row exact


def _solve(pid, sigma, tv, evals=4, at_max=False, **kw):
    return {
        "seed": 1,
        "step": 5,
        "prompt_id": pid,
        "sigma": sigma,
        "tv": tv,
        "evals": evals,
        "at_max": at_max,
        **kw,
    }


def test_target_metrics_count_each_prompt_once_and_only_the_steps_prompts():
    solves = [
        _solve(1, 0.2, 0.0102, evals=3),
        _solve(1, 0.2, 0.0102, evals=3),  # the same prompt from a second replica its sessions reached
        _solve(2, 0.6, 0.0098, evals=5, target_tv=0.01),
        _solve(2, 9.9, 0.5, evals=9, target_tv=0.5),  # a solve of another target (not this run's)
        _solve(3, 2.0, 0.004, evals=2, at_max=True, error=None),
        _solve(9, 9.9, 0.9, evals=99),  # another batch's prompt
    ]
    m = target_metrics(solves, target=0.01, step=5, prompt_ids=[1, 2, 3])
    assert m == {
        "noise/target_marginal_tv": 0.01,
        "noise/sigma_k": pytest.approx((0.2 + 0.6 + 2.0) / 3),
        "noise/sigma_k_min": pytest.approx(0.2),
        "noise/sigma_k_max": pytest.approx(2.0),
        "noise/target_achieved_tv": pytest.approx((0.0102 + 0.0098 + 0.004) / 3),
        "noise/target_solver_evals": pytest.approx(10 / 3),
        "noise/sigma_at_max": pytest.approx(1 / 3),
    }
    zero = target_metrics([], target=0.0, step=60, prompt_ids=[1])
    assert zero["noise/sigma_k"] == 0.0 and zero["noise/target_marginal_tv"] == 0.0


def test_a_prompt_without_a_solve_or_with_a_failed_one_is_an_error_not_a_silent_metric():
    solves = [_solve(1, 0.2, 0.01), _solve(2, 0.0, 0.0, error="RuntimeError: the head is sharded")]
    with pytest.raises(
        RuntimeError, match=r"could not solve sigma for 1 prompt\(s\) at step 5.*generated clean.*sharded"
    ):
        target_metrics(solves, target=0.01, step=5, prompt_ids=[1, 2])
    with pytest.raises(
        RuntimeError, match=r"no solve for prompt ids \[4\] \(1 of the step's 2 noisy prompts\)"
    ):
        target_metrics(solves, target=0.01, step=5, prompt_ids=[1, 4])


def test_the_target_is_refused_at_tensor_parallel_above_one_with_the_plugins_reason():
    over = {"ncgrpo.target_marginal_tv": 0.01, "ncgrpo.target_scope": "prompt"}
    check_verl_config(verl_config(**over, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": 1}))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4.*ParallelLMHead"):
        check_verl_config(verl_config(**over, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": 4}))
    check_verl_config(verl_config(**{"actor_rollout_ref.rollout.tensor_model_parallel_size": 4}))  # no target


def test_half_metrics_leave_sigma_k_to_the_target_metrics_when_the_engine_solves_it():
    m = half_metrics([1.0, 0.0], ["a", "a"], [False, True], [0.0, math.nan])
    assert "noise/sigma_k" not in m and m["reward/noisy"] == 0.0


# --------------------------------------------------------------------------------------------------
# the vLLM plugin's two changes
# --------------------------------------------------------------------------------------------------
class _Model:
    def __init__(self, d=8, v=6):
        self.w = torch.randn(d, v, generator=torch.Generator().manual_seed(0))

    def compute_logits(self, h):
        return h @ self.w


def _wrap_on_top(model):
    """A patch like verl's monkey_patch_compute_logits: reads model.compute_logits, installs its own."""
    inner = model.compute_logits

    def compute_logits(h):
        out = inner(h)
        out[..., -1] = float("-inf")
        return out

    model.compute_logits = compute_logits


def test_a_patch_installed_on_top_of_the_armed_wrapper_survives_the_step():
    r = RowNoise(1.0, NoiseKey(1, 2, 3, 0))
    spec = parse_noise_spec({EXTRA_ARGS_KEY: {"seed": 1, "step": 2, "prompt_id": 3, "draw": 0, "sigma": 1.0}})
    h = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    model = _Model()
    with _ArmedLogits(model, lambda hs: [(1, spec)]):
        _wrap_on_top(model)  # installed while armed
        out = model.compute_logits(h)
    ref, _ = perturb_rows(h[1][None, None], [r])
    assert torch.allclose(out[1, :-1], (ref[0, 0] @ model.w)[:-1]) and out[1, -1] == float("-inf")
    assert torch.allclose(out[0, :-1], (h[0] @ model.w)[:-1])
    after = model.compute_logits(h)  # the patch is still there; the wrapper below it is a pass-through
    assert torch.allclose(after[:, :-1], (h @ model.w)[:, :-1]) and (after[:, -1] == float("-inf")).all()
    model2 = _Model()  # the old behaviour would have dropped the patch: a plain step restores the original
    with _ArmedLogits(model2, lambda hs: []):
        pass
    assert "compute_logits" not in vars(model2)


def test_v2_add_requests_reads_vllm_024_requests_without_prompt_len():
    from ncgrpo.engines.vllm_worker import _wrap_v2_add_requests

    class Runner:
        def add_requests(self, scheduler_output):
            pass

    Runner.add_requests = _wrap_v2_add_requests(Runner.add_requests)
    extra = {EXTRA_ARGS_KEY: {"seed": 1, "step": 2, "prompt_id": 3, "draw": 0, "sigma": 1.0}}
    req = SimpleNamespace(  # vLLM 0.24's NewRequestData: prompt_token_ids, no prompt_len
        req_id="a",
        prompt_token_ids=[5, 6, 7],
        prefill_token_ids=[5, 6, 7],
        sampling_params=SimpleNamespace(extra_args=extra),
    )
    resumed = SimpleNamespace(
        req_id="b",
        prompt_token_ids=[5, 6],
        prefill_token_ids=[5, 6, 9],
        sampling_params=SimpleNamespace(extra_args=extra),
    )
    runner = Runner()
    runner.add_requests(SimpleNamespace(scheduled_new_reqs=[req, resumed]))
    assert set(runner._ncgrpo_specs) == {"a"} and runner._ncgrpo_specs["a"][1] == 3
