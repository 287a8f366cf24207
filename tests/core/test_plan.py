"""The one row plan (algorithm lines 2-4): clean/noisy layout, keys, pairs, process independence."""

from __future__ import annotations

import pytest
from PIL import Image

from ncgrpo.core.noise import NoiseKey, RowNoise
from ncgrpo.core.plan import (
    plan_group,
    plan_rows,
    prompt_id_for,
    prompt_noise_id,
    sampling_seed,
)
from ncgrpo.methods import get_method, method_names

LATENT = get_method("latent")


def test_plan_group_latent():
    rows = plan_group(3, 0.2, seed=1, step=5, prompt_id=9, method=LATENT)
    assert rows[:3] == [RowNoise()] * 3
    assert [r.key for r in rows[3:]] == [NoiseKey(1, 5, 9, j) for j in range(3)]
    assert all(r.sigma == 0.2 and r.sign == 1.0 and r.noisy and r.mode == "independent" for r in rows[3:])
    assert not any(r.noisy for r in rows[:3])


def test_plan_group_antithetic_spsa_and_errors():
    for method, mode in (("antithetic", "antithetic"), ("spsa", "rank_one")):
        noisy = plan_group(4, 0.5, seed=1, step=5, prompt_id=9, method=get_method(method))[4:]
        assert [r.key.draw for r in noisy] == [0, 0, 1, 1]
        assert [r.sign for r in noisy] == [1.0, -1.0, 1.0, -1.0]
        assert {r.mode for r in noisy} == {mode}
    with pytest.raises(ValueError, match="even"):
        plan_group(3, 0.5, 1, 5, 9, method=get_method("antithetic"))
    with pytest.raises(ValueError, match="rollout_method='gaussian' is unknown"):
        get_method("gaussian")
    with pytest.raises(TypeError, match=r"not its name: method=ncgrpo.methods.get_method\('latent'\)"):
        plan_group(1, 0.5, 1, 5, 9, "latent")
    with pytest.raises(ValueError, match="sigma"):
        plan_group(1, -0.1, 1, 5, 9, LATENT)


@pytest.mark.parametrize("method", ["image", "first_token_temperature", "vanilla"])
def test_methods_without_hidden_noise_leave_every_row_clean(method):
    assert all(not r.noisy for r in plan_group(2, 0.5, 1, 5, 9, method=get_method(method)))


def test_plan_rows_layout_per_method():
    G, pids = 8, [11, 22]
    glob = [p for p in pids for _ in range(G)]
    for method in method_names():
        plans = plan_rows(
            range(len(glob)), glob, num_generations=G, method=get_method(method), seed=5, step=3
        )
        noisy = [b >= G // 2 and method != "vanilla" for _ in pids for b in range(G)]
        assert [p.noisy for p in plans] == noisy
        assert [p.branch for p in plans] == list(range(G)) * 2
        keys = [p.key for p in plans if p.noisy]
        if method == "image":  # one distorted image per prompt, shared by its noisy half
            assert keys == [NoiseKey(5, 3, pid, 0) for pid in pids for _ in range(G // 2)]
        elif method == "first_token_temperature":
            assert keys == [None] * G
    # the transformers rollout's group plan is this plan, turned into hook instructions
    plans = plan_rows(range(G), [11] * G, num_generations=G, method=get_method("latent"), seed=5, step=3)
    assert [get_method("latent").row_noise(p, 0.3) for p in plans] == plan_group(
        G // 2, 0.3, 5, 3, 11, LATENT
    )


def test_plan_rows_independent_of_process_split() -> None:
    """A group spanning processes: planning each process's slice = planning the global batch."""
    G, L = 4, 2  # per-device batch 2, group of 4 -> every group spans two processes
    glob = [7, 7, 7, 7, 9, 9, 9, 9]
    for method in ("latent", "antithetic", "spsa", "image", "first_token_temperature"):
        whole = plan_rows(range(8), glob, num_generations=G, method=get_method(method), seed=0, step=1)
        parts = []
        for p in range(4):
            rows = range(p * L, (p + 1) * L)
            parts += plan_rows(
                rows, [glob[r] for r in rows], num_generations=G, method=get_method(method), seed=0, step=1
            )
        assert parts == whole


def test_plan_rows_separate_grouping() -> None:
    G = 8
    plans = plan_rows(
        range(16),
        [1] * 8 + [2] * 8,
        num_generations=G,
        method=get_method("antithetic"),
        seed=0,
        step=1,
        antithetic_grouping="separate",
    )
    for g in range(4):
        members = [p for p in plans if p.adv_group == g]
        assert len(members) == G // 2
        assert sum(p.noisy for p in members) == G // 4  # still a 50/50 mix
        assert len({p.sign for p in members if p.noisy}) == 1  # no (+eps, -eps) pair shares a group
        assert len({p.group for p in members}) == 1


def test_plan_rows_rejects_bad_groups():
    with pytest.raises(ValueError, match="num_generations must be even"):
        plan_rows(range(3), [1] * 3, num_generations=3, method=get_method("latent"), seed=0, step=1)
    with pytest.raises(ValueError, match="n must be even"):
        plan_rows(range(6), [1] * 6, num_generations=6, method=get_method("spsa"), seed=0, step=1)
    with pytest.raises(ValueError, match="one prompt id per row"):
        plan_rows(range(4), [1] * 3, num_generations=4, method=get_method("latent"), seed=0, step=1)


def test_sampling_seed_depends_on_seed_and_step():
    assert sampling_seed(0, 1) == sampling_seed(0, 1)
    assert len({sampling_seed(0, 1), sampling_seed(0, 2), sampling_seed(1, 1)}) == 3


def test_prompt_ids_stable_and_image_sensitive():
    a = Image.new("RGB", (8, 8), (10, 20, 30))
    b = Image.new("RGB", (8, 8), (10, 20, 31))
    assert prompt_noise_id([1, 2, 3]) == prompt_noise_id([1, 2, 3]) != prompt_noise_id([1, 2, 4])
    assert prompt_noise_id([1, 2], [a]) == prompt_noise_id([1, 2], [a.copy()]) != prompt_noise_id([1, 2], [b])
    assert prompt_id_for("q1") == prompt_id_for("q1") != prompt_id_for("q2")
    assert prompt_id_for(None, [1, 2, 3]) == prompt_noise_id([1, 2, 3])
