"""Group rollout (algorithm lines 2-7): determinism, metadata, antithetic pairing, images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ncgrpo.core.noise import NoiseKey
from ncgrpo.rollout import generate_groups
from tiny_models import build_processor, build_tokenizer, tiny_qwen2_5_vl, tiny_text_model

PROMPTS = [
    "The quick brown fox",
    [{"role": "user", "content": "Solve for x: 3x + 5 = 20."}],
    "A circle has radius r = 5, so its area is",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    # d = 256 so the measured relative perturbation concentrates near sigma (relative sd sqrt(1/(2d)) ~ 4%)
    return tiny_text_model("qwen2", tokenizer=tok, hidden_size=256, num_attention_heads=4)


# --------------------------------------------------------------------------------------------------
# rollouts
# --------------------------------------------------------------------------------------------------
def roll(model, tok, **kw):
    args = dict(n=2, sigma=0.5, step=3, seed=11, max_new_tokens=12)
    args.update(kw)
    return generate_groups(model, tok, PROMPTS, **args)


def test_rollout_is_deterministic_and_seeded(model, tok):
    a = roll(model, tok)
    b = roll(model, tok)
    assert torch.equal(a.sequences, b.sequences)
    assert a.completion_ids == b.completion_ids and a.completions == b.completions
    c = roll(model, tok, step=4)  # another step: other sampling draws and other noise
    assert not torch.equal(a.sequences, c.sequences)
    # the global RNG is left alone
    torch.manual_seed(123)
    x = torch.rand(3)
    torch.manual_seed(123)
    roll(model, tok)
    assert torch.equal(torch.rand(3), x)


def test_rollout_metadata(model, tok):
    n, sigma = 3, 0.4
    r = roll(model, tok, n=n, sigma=sigma)
    P, G = len(PROMPTS), 2 * n
    assert len(r.meta) == len(r.completion_ids) == len(r.completions) == P * G == r.sequences.shape[0]
    for i, m in enumerate(r.meta):
        p, b = divmod(i, G)
        assert (m.prompt_index, m.branch, m.prompt_id) == (p, b, r.prompt_ids[p])
        assert m.noisy == (b >= n)
        assert m.first_token == int(r.sequences[i, r.prompt_length]) == r.completion_ids[i][0]
        if m.noisy:
            assert m.sigma == sigma and m.key == NoiseKey(11, 3, r.prompt_ids[p], b - n) and m.sign == 1.0
            assert abs(m.rel / sigma - 1) < 0.2  # Prop. 1: ||delta|| / ||h|| concentrates at sigma
        else:
            assert m.sigma == 0.0 and m.key is None and m.rel == 0.0
    assert r.group(1) == slice(G, 2 * G)
    # the default prompt id is the token hash: stable across calls, distinct per prompt
    assert len(set(r.prompt_ids)) == P and roll(model, tok, n=1).prompt_ids == r.prompt_ids
    # completions stop at the first EOS
    eos = set(model.generation_config.eos_token_id)
    for ids in r.completion_ids:
        assert all(t not in eos for t in ids[:-1])


def test_clean_half_is_vanilla_sampling_and_sigma_zero_is_vanilla(model, tok):
    nc = roll(model, tok, sigma=1.0)
    vanilla = roll(model, tok, use_hook=False)
    G = 4
    clean_rows = [i for i in range(len(nc.meta)) if i % G < 2]
    noisy_rows = [i for i in range(len(nc.meta)) if i % G >= 2]
    assert torch.equal(nc.sequences[clean_rows], vanilla.sequences[clean_rows])
    assert not torch.equal(nc.sequences[noisy_rows], vanilla.sequences[noisy_rows])
    zero = roll(model, tok, sigma=0.0)
    assert torch.equal(zero.sequences, vanilla.sequences)
    assert all(m.rel == 0.0 for m in zero.meta)


def test_antithetic_rollout(model, tok):
    r = roll(model, tok, n=4, method="antithetic", sigma=0.5)
    G = 8
    rec = r.record
    for p in range(len(PROMPTS)):
        noisy = list(range(p * G + 4, p * G + 8))
        keys = [r.meta[i].key for i in noisy]
        assert keys[0] == keys[1] != keys[2] == keys[3]
        assert [r.meta[i].sign for i in noisy] == [1.0, -1.0, 1.0, -1.0]
        for a, b in ((noisy[0], noisy[1]), (noisy[2], noisy[3])):
            da = rec.noisy_last[a] - rec.clean_last[a]
            db = rec.noisy_last[b] - rec.clean_last[b]
            torch.testing.assert_close(db, -da, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="n must be even"):
        roll(model, tok, n=3, method="antithetic")


def test_explicit_prompt_ids_control_the_noise(model, tok):
    same = generate_groups(
        model,
        tok,
        [PROMPTS[0], PROMPTS[0]],
        n=1,
        sigma=2.0,
        step=0,
        seed=0,
        prompt_ids=[5, 5],
        max_new_tokens=4,
        do_sample=False,
        # bit-exact rows need one prefill per row: a shared prefill's last-token forward is a 4-row
        # GEMM whose CPU kernel rounds rows 0-1 and 2-3 differently (~5e-7), the noise is the same
        share_prompt_prefill=False,
    )
    diff = generate_groups(
        model,
        tok,
        [PROMPTS[0], PROMPTS[0]],
        n=1,
        sigma=2.0,
        step=0,
        seed=0,
        prompt_ids=[5, 6],
        max_new_tokens=4,
        do_sample=False,
        share_prompt_prefill=False,
    )
    rec_s, rec_d = same.record, diff.record
    torch.testing.assert_close(rec_s.noisy_last[1], rec_s.noisy_last[3], rtol=0, atol=0)
    assert not torch.equal(rec_d.noisy_last[1], rec_d.noisy_last[3])
    assert same.prompt_ids == [5, 5]


def test_rollout_bad_arguments(model, tok):
    with pytest.raises(ValueError, match="n must be >= 1"):
        roll(model, tok, n=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        roll(model, tok, prompt_ids=[1])


def test_rollout_with_images_qwen2_5_vl(tok):
    proc = build_processor(tok)
    vl = tiny_qwen2_5_vl(processor=proc)
    imgs = [
        Image.fromarray((np.random.RandomState(i).rand(56, 56, 3) * 255).astype("uint8")) for i in range(2)
    ]
    prompts = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
        for q in ("What is x?", "Find the area of the circle with radius 5.")
    ]
    args = dict(n=2, sigma=0.5, step=1, seed=0, max_new_tokens=8)
    a = generate_groups(vl, proc, prompts, imgs, **args)
    b = generate_groups(vl, proc, prompts, imgs, **args)
    assert torch.equal(a.sequences, b.sequences)
    assert [m.noisy for m in a.meta] == [False, False, True, True] * 2
    assert all((m.rel > 0) == m.noisy for m in a.meta)
    van = generate_groups(vl, proc, prompts, imgs, use_hook=False, **args)
    assert torch.equal(a.sequences[[0, 1, 4, 5]], van.sequences[[0, 1, 4, 5]])
    # the same question with another image is another prompt id
    c = generate_groups(vl, proc, prompts, imgs[::-1], **args)
    assert a.prompt_ids[0] != c.prompt_ids[0]
