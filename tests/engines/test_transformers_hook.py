"""The transformers prefill hook (paper section 3.1, "Where the perturbation acts").

Tiny random models on the CPU in float32; exactness is asserted with greedy decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from ncgrpo.core.noise import NoiseKey, RowNoise
from ncgrpo.engines.branch_point import find_text_stack
from ncgrpo.engines.transformers import prefill_noise
from tiny_models import build_tokenizer, tiny_qwen2_5_vl, tiny_qwen2_vl, tiny_qwen3_vl, tiny_text_model

PROMPTS = ["The quick brown fox", "Solve for x: 3x + 5 = 20.", "A circle has radius r = 5"]
GREEDY = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen2(tok):
    # 4 layers so the propagating site can be checked above and below l
    return tiny_text_model("qwen2", tokenizer=tok, num_hidden_layers=4)


def enc(tok, prompts):
    return tok(list(prompts), return_tensors="pt", padding=True)


def key(prompt_id, draw=0, seed=7, step=3):
    return NoiseKey(seed=seed, step=step, prompt_id=prompt_id, draw=draw)


def noisy(prompt_id, sigma=1.0, draw=0, sign=1.0):
    return RowNoise(sigma=sigma, key=key(prompt_id, draw), sign=sign)


def gen(model, inputs, rows=None, **kw):
    args = {**GREEDY, **kw}
    if rows is None:
        return model.generate(**inputs, **args)
    with prefill_noise(model, rows, **{k: v for k, v in kw.items() if k in ("site", "positions")}) as hook:
        out = model.generate(**inputs, **{k: v for k, v in args.items() if k not in ("site", "positions")})
    return out, hook


def prefill_cache(model, inputs, rows=None, **hook_kw):
    """Run one prefill forward with an explicit cache; returns (per-layer (K, V), last logits, hook)."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    hook = None
    with torch.no_grad():
        if rows is None:
            out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with prefill_noise(model, rows, **hook_kw) as hook:
                out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return kv, out.logits[:, -1], hook


def hook_state(model):
    """Every module's hook dicts (keys), to check the model is restored exactly."""
    names = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_backward_hooks",
    )
    return {(n, a): tuple(getattr(m, a).keys()) for n, m in model.named_modules() for a in names}


# --------------------------------------------------------------------------------------------------
# final-norm site: what changes and what does not
# --------------------------------------------------------------------------------------------------
def test_sigma_zero_is_bit_identical_to_no_hook(tok, qwen2):
    x = enc(tok, PROMPTS)
    base = gen(qwen2, x)
    out, hook = gen(qwen2, x, [RowNoise(0.0, key(i)) for i in range(3)])
    assert torch.equal(out.sequences, base.sequences)
    for a, b in zip(out.scores, base.scores, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(hook.last.rel, torch.zeros(3))


def test_clean_rows_untouched_noisy_rows_move_first_logits(tok, qwen2):
    x = enc(tok, PROMPTS)
    base = gen(qwen2, x)
    out, hook = gen(qwen2, x, [RowNoise(), noisy(1, sigma=2.0), RowNoise()])
    # clean rows: bit-identical sequences and scores at every step, in the same batch as a noisy row
    for r in (0, 2):
        assert torch.equal(out.sequences[r], base.sequences[r])
        for a, b in zip(out.scores, base.scores, strict=True):
            assert torch.equal(a[r], b[r])
    # the noisy row's first-token logits moved
    assert (out.scores[0][1] - base.scores[0][1]).abs().max() > 1e-3
    rel = hook.last.rel
    assert rel[0] == 0 and rel[2] == 0 and 1.0 < rel[1] < 3.0  # sigma=2, d=32: ||eps||/sqrt(d) ~ 1 +- 0.25


def test_final_norm_leaves_every_kv_layer_bit_identical(tok, qwen2):
    x = enc(tok, PROMPTS)
    kv0, logits0, _ = prefill_cache(qwen2, x)
    kv1, logits1, hook = prefill_cache(qwen2, x, [noisy(0), noisy(1), RowNoise()])
    assert len(kv0) == 4
    for (k0, v0), (k1, v1) in zip(kv0, kv1, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert not torch.equal(logits0[0], logits1[0]) and not torch.equal(logits0[1], logits1[1])
    assert torch.equal(logits0[2], logits1[2])
    # the recorded states: clean = what a clean run returns; noisy differs only on noisy rows
    rec = hook.last
    assert torch.equal(rec.clean_last[2], rec.noisy_last[2])
    assert not torch.equal(rec.clean_last[0], rec.noisy_last[0])
    assert torch.equal(rec.final_last, rec.noisy_last)


class ForceFirst(LogitsProcessor):
    """Force the first generated token of each row (step 0 only)."""

    def __init__(self, prompt_len: int, tokens: torch.Tensor):
        self.prompt_len, self.tokens = prompt_len, tokens

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] != self.prompt_len:
            return scores
        forced = torch.full_like(scores, -float("inf"))
        forced[torch.arange(scores.shape[0]), self.tokens] = 0.0
        return forced


def test_noisy_branch_forced_to_clean_first_token_continues_like_clean(tok, qwen2):
    x = enc(tok, PROMPTS)
    base = gen(qwen2, x, max_new_tokens=12)
    T = x["input_ids"].shape[1]
    rows = [noisy(i, sigma=3.0) for i in range(3)]
    free, _ = gen(qwen2, x, rows, max_new_tokens=12)
    assert not torch.equal(free.sequences[:, T], base.sequences[:, T])  # the noise does change a first token
    forced = LogitsProcessorList([ForceFirst(T, base.sequences[:, T])])
    out, _ = gen(qwen2, x, rows, max_new_tokens=12, logits_processor=forced)
    assert torch.equal(out.sequences, base.sequences)  # the cache is clean: decoding is the clean decode


# --------------------------------------------------------------------------------------------------
# propagating site
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("site", [1, 2, [1, 3]])
def test_layer_site_changes_kv_from_layer_l_up_only(tok, qwen2, site):
    x = enc(tok, PROMPTS)
    kv0, _, _ = prefill_cache(qwen2, x)
    kv1, _, hook = prefill_cache(qwen2, x, [noisy(0), RowNoise(), noisy(2)], site=site)
    lowest = min(site) if isinstance(site, list) else site
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(kv0, kv1, strict=True)):
        if layer < lowest:
            assert torch.equal(k0, k1) and torch.equal(v0, v1), layer
        else:
            # noisy rows change, the clean row does not
            assert not torch.equal(k0[0], k1[0]) and not torch.equal(v0[2], v1[2]), layer
            assert torch.equal(k0[1], k1[1]) and torch.equal(v0[1], v1[1]), layer
    rec = hook.last
    if isinstance(site, list):
        assert rec.primary == 3 and set(rec.sites) == {1, 3}
        # depth-decayed: layer 1 gets half of layer 3's sigma
        assert 0.3 < rec.sites[1].rel[0] / rec.sites[3].rel[0] < 0.8
    assert rec.rel[1] == 0 and rec.rel[0] > 0


def test_layer_site_out_of_range(tok, qwen2):
    with pytest.raises(ValueError, match="out of range"):
        with prefill_noise(qwen2, [RowNoise()], site=4):
            pass


# --------------------------------------------------------------------------------------------------
# keyed noise: layout invariance and antithetic pairs
# --------------------------------------------------------------------------------------------------
def recovered_eps(rec, row, sigma):
    """eps = (h~ - h) / (sigma ||h|| / sqrt(d)) at the last prompt token."""
    h, ht = rec.clean_last[row].double(), rec.noisy_last[row].double()
    scale = sigma * h.norm() / h.numel() ** 0.5
    return (ht - h) / scale


def test_same_key_same_noise_across_batch_position_and_padding(tok, qwen2):
    short = "The quick brown fox"
    # alone (no padding), first in a batch with a longer prompt (left-padded), last in another batch
    layouts = [
        ([short], 0),
        ([short, "Solve for x: 3x + 5 = 20. Subtract 5 from both sides."], 0),
        (["A circle has radius r = 5, so its area is 25 pi", "2 + 2", short], 2),
    ]
    eps, pads = [], []
    for prompts, row in layouts:
        x = enc(tok, prompts)
        pads.append(int((x["attention_mask"][row] == 0).sum()))
        rows = [RowNoise()] * len(prompts)
        rows[row] = noisy(42, sigma=0.5)
        _, _, hook = prefill_cache(qwen2, x, rows)
        eps.append(recovered_eps(hook.last, row, 0.5))
    assert pads[0] == 0 and pads[1] > 0 and pads[2] != pads[1]  # the layouts really differ
    for e in eps[1:]:
        torch.testing.assert_close(e, eps[0], rtol=0, atol=1e-4)
    # a different draw index is a different draw
    x = enc(tok, [short])
    _, _, hook = prefill_cache(qwen2, x, [noisy(42, sigma=0.5, draw=1)])
    assert (recovered_eps(hook.last, 0, 0.5) - eps[0]).abs().max() > 0.1


def test_antithetic_partners_are_exact_negations(tok, qwen2):
    x = enc(tok, [PROMPTS[1], PROMPTS[1], PROMPTS[0]])
    rows = [noisy(5, sigma=0.7), noisy(5, sigma=0.7, sign=-1.0), noisy(5, sigma=0.7, draw=1)]
    _, _, hook = prefill_cache(qwen2, x, rows, positions="all")
    rec = hook.last
    d_plus = rec.noisy_last[0] - rec.clean_last[0]
    d_minus = rec.noisy_last[1] - rec.clean_last[1]
    assert torch.equal(rec.clean_last[0], rec.clean_last[1])
    torch.testing.assert_close(d_minus, -d_plus, rtol=0, atol=1e-5)
    assert d_plus.abs().max() > 0.1
    torch.testing.assert_close(rec.rel[0], rec.rel[1], rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------------
# positions="auto" (fast path) == positions="all" (every prompt token, as the paper writes it)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("do_sample", [False, True])
def test_auto_positions_bit_identical_to_all(tok, qwen2, do_sample):
    x = enc(tok, PROMPTS)
    rows = [noisy(0, sigma=2.0), RowNoise(), noisy(2, sigma=2.0)]
    outs = []
    for positions in ("auto", "all"):
        torch.manual_seed(0)
        out, hook = gen(qwen2, x, rows, positions=positions, do_sample=do_sample, max_new_tokens=10)
        outs.append((out, hook.last))
    (a, ra), (b, rb) = outs
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores, strict=True):
        assert torch.equal(sa, sb)
    assert torch.equal(ra.noisy_last, rb.noisy_last)


# --------------------------------------------------------------------------------------------------
# lifecycle
# --------------------------------------------------------------------------------------------------
def test_hooks_removed_on_exit_and_on_exception_and_reentry(tok, qwen2):
    before = hook_state(qwen2)
    x = enc(tok, PROMPTS)
    base = gen(qwen2, x)
    with prefill_noise(qwen2, [noisy(0), RowNoise(), RowNoise()], site=[0, 2]):
        assert hook_state(qwen2) != before
    assert hook_state(qwen2) == before
    with pytest.raises(RuntimeError, match="boom"):
        with prefill_noise(qwen2, [noisy(0)] * 3):
            raise RuntimeError("boom")
    assert hook_state(qwen2) == before
    # an error raised inside the hook (wrong number of rows) also restores the model
    with pytest.raises(ValueError, match="2 RowNoise entries but the prefill batch has 3 rows"):
        with prefill_noise(qwen2, [noisy(0), RowNoise()]):
            qwen2.generate(**x, max_new_tokens=2)
    assert hook_state(qwen2) == before
    # entering twice in a row gives the same result; two generate calls inside one context both perturb
    rows = [noisy(0, sigma=2.0), RowNoise(), RowNoise()]
    first, _ = gen(qwen2, x, rows)
    with prefill_noise(qwen2, rows) as hook:
        a = qwen2.generate(**x, **GREEDY)
        b = qwen2.generate(**x, **GREEDY)
    assert len(hook.records) == 2
    assert torch.equal(a.sequences, first.sequences) and torch.equal(b.sequences, first.sequences)
    assert torch.equal(gen(qwen2, x).sequences, base.sequences)
    assert hook_state(qwen2) == before


def test_use_cache_false_is_refused(tok, qwen2):
    x = enc(tok, PROMPTS)
    with pytest.raises(RuntimeError, match="use_cache=True"):
        with prefill_noise(qwen2, [noisy(0)] * 3):
            qwen2.generate(**x, max_new_tokens=2, use_cache=False)


def test_unsupported_architecture_names_the_paths():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(
        NotImplementedError, match=r"model\.model\.language_model\.norm or model\.model\.norm"
    ):
        with prefill_noise(gpt2, [RowNoise()]):
            pass
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        find_text_stack(gpt2)


def test_wrapped_model_ddp_style(tok, qwen2):
    class Wrapper(torch.nn.Module):  # what DDP / DataParallel look like: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    x = enc(tok, PROMPTS)
    rows = [noisy(0, sigma=2.0), RowNoise(), RowNoise()]
    direct, _ = gen(qwen2, x, rows)
    with prefill_noise(Wrapper(qwen2), rows) as hook:
        out = qwen2.generate(**x, **GREEDY)
    assert torch.equal(out.sequences, direct.sequences) and len(hook.records) == 1


# --------------------------------------------------------------------------------------------------
# architectures
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_text_architectures(tok, arch):
    model = tiny_text_model(arch, tokenizer=tok, hidden_size=64, num_attention_heads=4)
    x = enc(tok, PROMPTS)
    base = gen(model, x)
    out, hook = gen(model, x, [RowNoise(), noisy(1, sigma=2.0), RowNoise()])
    assert torch.equal(out.sequences[0], base.sequences[0]) and torch.equal(
        out.sequences[2], base.sequences[2]
    )
    assert not torch.equal(out.scores[0][1], base.scores[0][1])
    kv0, _, _ = prefill_cache(model, x)
    kv1, _, _ = prefill_cache(model, x, [noisy(0), noisy(1), noisy(2)])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv0, kv1, strict=True))


def vl_inputs(tok, questions, patch_size=14, seeds=(0, 1)):
    """Qwen-VL inputs built by hand: the PIL image processor plus the right number of <|image_pad|>."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ip = Qwen2VLImageProcessorPil(
        min_pixels=(2 * patch_size) ** 2,
        max_pixels=(4 * patch_size) ** 2,
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=2,
    )
    imgs = [Image.fromarray((np.random.RandomState(s).rand(56, 56, 3) * 255).astype("uint8")) for s in seeds]
    px = ip(images=imgs[: len(questions)], return_tensors="pt")
    n = [int(g.prod()) // 4 for g in px["image_grid_thw"]]
    texts = [
        f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * k}<|vision_end|>{q}<|im_end|>\n<|im_start|>assistant\n"
        for k, q in zip(n, questions, strict=True)
    ]
    x = tok(texts, return_tensors="pt", padding=True)
    x["mm_token_type_ids"] = (x["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).int()
    x["pixel_values"], x["image_grid_thw"] = px["pixel_values"], px["image_grid_thw"]
    return x


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_vl_architectures_with_images(tok, kind):
    make = {"qwen2_5_vl": tiny_qwen2_5_vl, "qwen2_vl": tiny_qwen2_vl, "qwen3_vl": tiny_qwen3_vl}[kind]
    ps = 16 if kind == "qwen3_vl" else 14
    model = make(tokenizer=tok, patch_size=ps)
    x = vl_inputs(tok, ["What is x?", "Find the area of the circle."], patch_size=ps)
    before = hook_state(model)
    base = gen(model, x)
    out, hook = gen(model, x, [RowNoise(), noisy(1, sigma=2.0)])
    assert torch.equal(out.sequences[0], base.sequences[0])
    assert not torch.equal(out.scores[0][1], base.scores[0][1])
    assert hook.last.rel[0] == 0 and hook.last.rel[1] > 0
    # the propagating site works through the VL stack too, and KV below the site stays clean
    kv0, _, _ = prefill_cache(model, x)
    kv1, _, _ = prefill_cache(model, x, [noisy(0), noisy(1)], site=1)
    assert torch.equal(kv0[0][0], kv1[0][0]) and not torch.equal(kv0[1][0], kv1[1][0])
    assert hook_state(model) == before


def test_timing_records_hook_and_prefill_seconds(tok, qwen2):
    before = hook_state(qwen2)
    x = enc(tok, PROMPTS)
    with prefill_noise(qwen2, [noisy(0), RowNoise(), noisy(2)], timing=True) as hook:
        qwen2.generate(**x, max_new_tokens=3, do_sample=False)
    rec = hook.last
    assert len(hook.records) == 1
    assert 0 < rec.hook_s < rec.prefill_s < 60
    assert hook_state(qwen2) == before
    _, _, untimed = prefill_cache(qwen2, x, [noisy(0), RowNoise(), noisy(2)])
    assert untimed.last.hook_s != untimed.last.hook_s  # NaN when timing is off


# --------------------------------------------------------------------------------------------------
# right padding: an error on noisy rows, not silence
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hook_kw", [{}, {"positions": "all"}, {"site": 2}])
def test_right_padded_noisy_row_is_an_error(tok, qwen2, hook_kw):
    # the short prompt is right-padded: its last position is padding, so the position whose state
    # reaches the first-token logits got no noise (rel 0) without any message
    x = tok([PROMPTS[0], PROMPTS[1]], return_tensors="pt", padding=True, padding_side="right")
    m = x["attention_mask"]
    assert m[0, -1] == 0 and m[0, 0] == 1 and bool(m[1].all())
    with pytest.raises(ValueError, match=r'padding_side = "left"') as err:
        prefill_cache(qwen2, x, [noisy(0), RowNoise()], **hook_kw)
    assert "noisy row 0" in str(err.value)
    with pytest.raises(ValueError, match="right-padded"):
        with prefill_noise(qwen2, [noisy(0), noisy(1)], **hook_kw):
            qwen2.generate(**x, max_new_tokens=2, do_sample=False)
    # a right-padded CLEAN row gets no noise by design; the full-length noisy row is perturbed
    _, _, hook = prefill_cache(qwen2, x, [RowNoise(), noisy(1)], **hook_kw)
    assert hook.last.rel[0] == 0 and hook.last.rel[1] > 0.1
    # the same prompts left-padded: both noisy rows are perturbed
    _, _, hook = prefill_cache(qwen2, enc(tok, [PROMPTS[0], PROMPTS[1]]), [noisy(0), noisy(1)], **hook_kw)
    assert bool((hook.last.rel > 0.1).all())
