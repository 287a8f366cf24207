"""One prefill per group (``share_prompt_prefill``): the vision tower and the prompt minus its last
token computed once per prompt, the cache expanded to the group's rows, the branch at the last
prompt token. Checked against the repeated path (one prefill per row, what TRL does): greedy tokens
identical, sampled tokens identical under the same seed, first-token logits within float32
rounding, for a text model, Qwen2.5-VL and Qwen3-VL, with left padding and mixed prompt lengths.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ncgrpo.core.noise import NoiseKey, RowNoise
from ncgrpo.engines.branch_point import at_branch_point, branch_point_capture
from ncgrpo.engines.controls import first_token_marginal, first_token_temperature
from ncgrpo.engines.shared_prefill import share_prompt_prefill, shared_prefill_generate
from ncgrpo.engines.transformers import prefill_noise
from ncgrpo.rollout import generate_groups
from tiny_models import MIXED_TEXTS, image_prompts, mixed_images, tiny_bundle

G = 4  # rows per prompt: 2 clean + 2 noisy
TEXTS = MIXED_TEXTS  # prompts of different lengths; images of different patch counts: mixed_images
ATOL = 1e-5  # float32 rounding of a 1-token forward against the last row of a T-token forward


@pytest.fixture(scope="module", params=["qwen2", "qwen2_5_vl", "qwen3_vl"])
def bundle(request):
    model, proc = tiny_bundle(request.param)
    return request.param, model.eval(), proc


def repeated_inputs(kind, proc, images=None, g=G):
    """The prompts repeated ``g`` times, prompt-major, left-padded (TRL's layout)."""
    tok = getattr(proc, "tokenizer", proc)
    tok.padding_side = "left"
    if kind.endswith("_vl"):
        images = images or mixed_images()
        msgs = image_prompts(proc, TEXTS)
        enc = proc(
            text=[m for m in msgs for _ in range(g)],
            images=[im for im in images for _ in range(g)],
            padding=True,
            return_tensors="pt",
        )
    else:
        enc = tok([t for t in TEXTS for _ in range(g)], padding=True, return_tensors="pt")
    enc = dict(enc)
    assert (enc["attention_mask"] == 0).any(), "the prompts must need left padding"
    return enc


def noise_rows(sigma=0.5):
    return [
        RowNoise(sigma, NoiseKey(3, 1, p, j - 2)) if j >= 2 else RowNoise()
        for p in range(len(TEXTS))
        for j in range(G)
    ]


def run(model, inputs, *, shared, sample=False, rows=None, site="final_norm", seed=0):
    kw = dict(max_new_tokens=6, do_sample=sample, return_dict_in_generate=True)
    if sample:
        kw.update(temperature=1.0, top_k=0, top_p=1.0)
    rows = noise_rows() if rows is None else rows
    torch.manual_seed(seed)
    with torch.no_grad(), branch_point_capture(model) as point, prefill_noise(model, rows, site=site) as hook:
        if shared:
            out = shared_prefill_generate(model, **inputs, **kw)
        else:
            out = model.generate(**inputs, **kw)
    return out.sequences, point.logits, hook.last


def test_shared_prefill_equals_the_repeated_path(bundle):
    kind, model, proc = bundle
    inputs = repeated_inputs(kind, proc)
    seen = []  # patches through the vision tower per run: G copies repeated, one per prompt shared
    visual = getattr(model.model, "visual", None)
    handle = visual.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0])) if visual else None
    try:
        seq_r, logits_r, rec_r = run(model, inputs, shared=False)
        repeated_patches = sum(seen)
        seen.clear()
        seq_s, logits_s, rec_s = run(model, inputs, shared=True)
        shared_patches = sum(seen)
    finally:
        if handle is not None:
            handle.remove()
    if visual is not None:
        assert repeated_patches == inputs["pixel_values"].shape[0] == G * shared_patches
    info = model._ncgrpo_last_shared
    assert info.shared and (info.rows, info.unique) == (len(TEXTS) * G, len(TEXTS))
    assert torch.equal(seq_r, seq_s)  # greedy tokens identical
    torch.testing.assert_close(logits_s, logits_r, rtol=0, atol=ATOL)
    torch.testing.assert_close(rec_s.rel, rec_r.rel, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rec_s.final_last, rec_r.final_last, rtol=0, atol=ATOL)
    # the noise acted in the shared path: noisy rows left their clean partner, clean rows did not
    noisy = torch.tensor([j >= 2 for _ in TEXTS for j in range(G)])
    assert (rec_s.rel[noisy] > 0.3).all() and (rec_s.rel[~noisy] == 0).all()
    moved = (logits_s - logits_s[[(r // G) * G for r in range(len(noisy))]]).abs().amax(-1)
    assert (moved[noisy] > 1e-3).all() and (moved[~noisy] < ATOL).all()
    # sampled tokens: the same seed gives the same tokens (the prefix pass draws no random numbers)
    a, _, _ = run(model, inputs, shared=False, sample=True, seed=1)
    b, _, _ = run(model, inputs, shared=True, sample=True, seed=1)
    assert torch.equal(a, b)


def test_image_method_shares_within_each_half():
    """NoisyRollout's noisy half has other pixels: the batch splits into two runs per prompt."""
    model, proc = tiny_bundle("qwen2_5_vl")
    model.eval()
    clean, dist = mixed_images(0), mixed_images(1)
    half = G // 2
    images = [im for c, d in zip(clean, dist, strict=True) for im in [c] * half + [d] * half]
    tok = proc.tokenizer
    msgs = image_prompts(proc, TEXTS)
    tok.padding_side = "left"
    inputs = dict(
        proc(text=[m for m in msgs for _ in range(G)], images=images, padding=True, return_tensors="pt")
    )
    rows = [RowNoise()] * (len(TEXTS) * G)
    seq_r, logits_r, _ = run(model, inputs, shared=False, rows=rows)
    seq_s, logits_s, _ = run(model, inputs, shared=True, rows=rows)
    info = model._ncgrpo_last_shared
    assert info.shared and info.unique == 2 * len(TEXTS)
    assert torch.equal(seq_r, seq_s)
    torch.testing.assert_close(logits_s, logits_r, rtol=0, atol=ATOL)


@pytest.mark.parametrize("control", ["temperature", "marginal"])
def test_first_token_controls_act_at_the_shared_branch_point(control):
    model, tok = tiny_bundle("qwen2")
    model.eval()
    inputs = repeated_inputs("qwen2", tok)
    flags = [j >= 2 for _ in TEXTS for j in range(G)]

    def go(shared):
        if control == "temperature":
            ctx = first_token_temperature(model, flags, temperature=1.0, first_token_temperature=3.0)
        else:
            keys = [NoiseKey(3, 1, r // G, r % G) if f else None for r, f in enumerate(flags)]
            ctx = first_token_marginal(model, keys, sigma=2.0, temperature=1.0, draws=8)
        torch.manual_seed(0)
        with torch.no_grad(), ctx as hook, branch_point_capture(model) as point:
            kw = dict(max_new_tokens=5, do_sample=True, top_k=0, top_p=1.0, return_dict_in_generate=True)
            out = shared_prefill_generate(model, **inputs, **kw) if shared else model.generate(**inputs, **kw)
        return out.sequences, point.logits, hook.calls

    seq_r, logits_r, calls_r = go(False)
    seq_s, logits_s, calls_s = go(True)
    assert calls_r == calls_s == 1  # rewritten once: at the branch forward, not in the prefix pass
    assert torch.equal(seq_r, seq_s)
    torch.testing.assert_close(logits_s, logits_r, rtol=0, atol=ATOL)
    clean = torch.tensor(flags).logical_not()
    changed = (logits_s - logits_s[[(r // G) * G for r in range(len(flags))]]).abs().amax(-1)
    assert (changed[~clean] > 1e-3).all()


def test_layer_sites_fall_back_to_one_prefill_per_row(monkeypatch):
    """A layer site writes the noise into the cache: no sharing, said once, same output as generate."""
    # the reason is said once per process: forget an earlier test's (e.g. the probe's) saying of it
    monkeypatch.setattr("ncgrpo.engines.shared_prefill._WARNED", set())
    model, tok = tiny_bundle("qwen2")
    model.eval()
    inputs = repeated_inputs("qwen2", tok)
    seq_r, logits_r, _ = run(model, inputs, shared=False, site=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq_s, logits_s, _ = run(model, inputs, shared=True, site=1)
    info = model._ncgrpo_last_shared
    assert not info.shared and "layer noise site" in info.reason
    assert any("layer noise site" in str(w.message) for w in caught)
    assert torch.equal(seq_r, seq_s) and torch.equal(logits_r, logits_s)  # the very same call


def test_branch_point_detection_and_the_generate_patch():
    from transformers import DynamicCache

    model, tok = tiny_bundle("qwen2")
    assert at_branch_point(None)
    cache = DynamicCache(config=model.config)
    assert at_branch_point(cache)
    cache._ncgrpo_prefix_pass = True
    assert not at_branch_point(cache)  # the shared prefix pass: every hook stays inert
    # share_prompt_prefill routes model.generate and restores the class method on exit
    inputs = repeated_inputs("qwen2", tok)
    with share_prompt_prefill(model) as calls, torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        model.generate(**{k: v[::G] for k, v in inputs.items()}, max_new_tokens=2, do_sample=False)
    assert "generate" not in model.__dict__
    assert [(c.shared, c.unique) for c in calls] == [(True, len(TEXTS)), (False, len(TEXTS))]
    assert "no two consecutive rows" in calls[1].reason
    # more positional arguments than input_ids: the plain generate, with every keyword argument kept
    from transformers import GenerationConfig

    with share_prompt_prefill(model) as calls, torch.no_grad():
        out = model.generate(
            inputs["input_ids"], GenerationConfig(do_sample=False), attention_mask=inputs["attention_mask"],
            max_new_tokens=3,
        )  # fmt: skip
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3 and calls == []
    with share_prompt_prefill(model, enabled=False) as calls:
        assert "generate" not in model.__dict__
    assert calls == []


def test_generate_groups_shares_by_default_and_matches_the_repeated_path():
    model, tok = tiny_bundle("qwen2")
    args = dict(n=2, sigma=0.5, step=1, seed=0, max_new_tokens=6)
    a = generate_groups(model, tok, TEXTS, **args)
    b = generate_groups(model, tok, TEXTS, share_prompt_prefill=False, **args)
    assert a.extra["shared_prefill"].unique == len(TEXTS) and b.extra["shared_prefill"] is None
    assert a.completion_ids == b.completion_ids
    torch.testing.assert_close(a.record.rel, b.record.rel, rtol=1e-5, atol=1e-7)


def _tiny_grpo():
    import importlib.util
    import sys
    from pathlib import Path

    if "tiny_grpo" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / "tiny_grpo.py"
        spec = importlib.util.spec_from_file_location("tiny_grpo", path)
        sys.modules["tiny_grpo"] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules["tiny_grpo"]


@pytest.mark.parametrize("method", [pytest.param("latent", marks=pytest.mark.slow), "image"])
def test_trainer_generation_seam_shares_and_matches_one_prefill_per_row(tmp_path, method):
    """NCGRPOTrainer (TRL's own generate, Qwen2.5-VL images, G = 4, 2 prompts a step): the same
    completions with and without sharing; the image method shares within each half."""
    tiny = _tiny_grpo()
    got = {}
    for share in (True, False):
        tr = tiny.trainer(
            tmp_path / str(share),
            rollout_method=method,
            share_prompt_prefill=share,
            max_steps=1,
            per_device_train_batch_size=8,
            image_noise_step=500,
        )
        seen = []
        orig = tr._generate_and_score_completions

        def spy(inputs, orig=orig, seen=seen):
            out = orig(inputs)
            seen.append(out["completion_ids"].clone())
            return out

        tr._generate_and_score_completions = spy
        tr.train()
        got[share] = (seen[0], list(tr.nc_shared_prefill))
    (ids_on, calls_on), (ids_off, calls_off) = got[True], got[False]
    assert torch.equal(ids_on, ids_off)
    assert calls_off == []
    assert [(c.shared, c.rows, c.unique) for c in calls_on] == [(True, 8, 2 if method == "latent" else 4)]
