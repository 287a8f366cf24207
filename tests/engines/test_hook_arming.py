"""The noise hook's stack hooks run at the prefill only: removed for the decode steps of a top-level
``generate``, re-registered (in their place) by the next branch point, kept for direct stack callers
and where other hooks share the modules (so the order hooks run in never changes)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from ncgrpo.core.noise import NoiseKey, RowNoise
from ncgrpo.engines.branch_point import find_text_stack
from ncgrpo.engines.shared_prefill import shared_prefill_generate
from ncgrpo.engines.transformers import prefill_noise
from tiny_models import build_tokenizer, tiny_text_model

PROMPTS = ["The quick brown fox", "Solve for x: 3x + 5 = 20.", "A circle has radius r = 5"]
GREEDY = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_text_model("qwen2", tokenizer=tok, num_hidden_layers=3)


def rows():
    return [RowNoise(), RowNoise(2.0, NoiseKey(7, 3, 1, 0)), RowNoise(2.0, NoiseKey(7, 3, 2, 0))]


def enc(tok):
    return tok(PROMPTS, return_tensors="pt", padding=True)


def stack_calls(stack):
    """Counts the stack's forwards that ran with at least one forward hook on it."""
    seen = []
    orig = stack.forward

    def forward(*a, **k):
        seen.append(bool(stack._forward_pre_hooks or stack._forward_hooks))
        return orig(*a, **k)

    return seen, forward


def test_decode_steps_run_without_stack_hooks_and_every_prefill_is_perturbed(tok, model):
    x = enc(tok)
    _, stack, _ = find_text_stack(model)
    seen, forward = stack_calls(stack)
    with prefill_noise(model, rows()) as hook:
        stack.forward = forward
        try:
            a = model.generate(**x, **GREEDY)
            b = model.generate(**x, **GREEDY)  # re-armed by the second prefill
        finally:
            del stack.forward
    # hooks at each prefill, none at the 5 decode steps of each call
    assert seen == [True] + [False] * 5 + [True] + [False] * 5
    assert len(hook.records) == 2 and torch.equal(a.sequences, b.sequences)
    assert torch.equal(hook.records[0].rel, hook.records[1].rel) and bool((hook.records[0].rel[1:] > 0).all())
    for s, t in zip(a.scores, b.scores, strict=True):
        assert torch.equal(s, t)
    # the shared-prefill path: the prefix pass runs on the stack directly, unperturbed; its branch
    # forward re-arms; a third record, the same first-token scores
    with prefill_noise(model, rows()) as hook:
        model.generate(**x, **GREEDY)
        c = shared_prefill_generate(model, **x, **GREEDY)
    assert len(hook.records) == 2 and torch.allclose(c.scores[0], a.scores[0], atol=1e-5)
    assert torch.equal(c.sequences, a.sequences)


def test_direct_stack_callers_keep_the_hooks(tok, model):
    x = enc(tok)
    _, stack, _ = find_text_stack(model)

    def prefill():
        cache = DynamicCache(config=model.config)
        return stack(**x, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]

    with torch.no_grad():
        clean = prefill()
        with prefill_noise(model, rows()) as hook:
            h1, h2 = prefill(), prefill()
    assert len(hook.records) == 2 and torch.equal(h1, h2)
    assert torch.equal(h1[0], clean[0]) and not torch.equal(h1[1], clean[1])


@pytest.mark.parametrize("when", ["before_first_prefill", "while_disarmed"])
def test_other_hooks_on_the_stack_keep_their_order(tok, model, when):
    """A forward hook registered on the stack after the noise hook runs after it at every prefill (it
    sees the perturbed state), whether it came before the first prefill (nothing is removed then) or
    while the stack's hooks were removed (they come back in front of it)."""
    x = enc(tok)
    _, stack, _ = find_text_stack(model)
    seen: list[torch.Tensor] = []

    def late(module, args, output):
        h = output.last_hidden_state
        if h.shape[1] > 1:  # the prefill
            seen.append(h[:, -1].detach().clone())

    with torch.no_grad(), prefill_noise(model, rows()) as hook:
        handle = None
        if when == "before_first_prefill":
            handle = stack.register_forward_hook(late)
        model.generate(**x, **GREEDY)
        if handle is None:
            handle = stack.register_forward_hook(late)
        model.generate(**x, **GREEDY)
        handle.remove()
    assert len(hook.records) == 2
    assert len(seen) == (2 if when == "before_first_prefill" else 1)
    assert torch.equal(seen[-1], hook.records[1].final_last)
    assert not torch.equal(seen[-1][1], hook.records[1].clean_last[1])
