"""ncgrpo.engines.vllm_multimodal without vLLM (default suite): image prompts' placeholder runs collapsed
to the form vLLM 0.31 expands (the engine side is tests/engines/test_vllm_vlm.py)."""

from __future__ import annotations

import pytest

from ncgrpo.engines.vllm_multimodal import (
    collapse_image_placeholders,
    collapse_vllm_image_prompts,
    image_token_id_of,
    install_image_prompt_collapse,
)
from tiny_models import build_processor, build_tokenizer

PAD = 5  # <|image_pad|> in the tiny tokenizer (CONTROL_TOKENS order)


def test_each_run_becomes_one_placeholder_and_other_tokens_stay():
    ids = [1, 9, 3, PAD, PAD, PAD, PAD, 4, 7, 3, PAD, PAD, 4, 8]
    assert collapse_image_placeholders(ids, PAD, 2) == [1, 9, 3, PAD, 4, 7, 3, PAD, 4, 8]
    assert collapse_image_placeholders([1, 3, PAD, 4], PAD, 1) == [1, 3, PAD, 4]  # already collapsed


@pytest.mark.parametrize("ids, n", [([1, 3, PAD, PAD, 4], 2), ([1, 2, 4], 1), ([PAD, 4, PAD], 1)])
def test_runs_must_match_the_images(ids, n):
    with pytest.raises(ValueError, match=r"run\(s\) of image tokens .* one run per image"):
        collapse_image_placeholders(ids, PAD, n)


def test_prompts_with_images_are_collapsed_copies_and_the_rest_pass_through():
    img = object()
    with_image = {"prompt_token_ids": [1, PAD, PAD, PAD, 4], "multi_modal_data": {"image": img}}
    two = {"prompt_token_ids": [PAD, PAD, 4, PAD, PAD], "multi_modal_data": {"image": [img, img]}}
    text_ids = {"prompt_token_ids": [1, 2, 3]}
    as_text = {"prompt": "hi <|image_pad|>", "multi_modal_data": {"image": img}}
    out = collapse_vllm_image_prompts([with_image, two, text_ids, as_text], PAD)
    assert out[0] == {"prompt_token_ids": [1, PAD, 4], "multi_modal_data": {"image": img}}
    assert out[1]["prompt_token_ids"] == [PAD, 4, PAD]
    assert out[2] is text_ids and out[3] is as_text
    assert with_image["prompt_token_ids"] == [1, PAD, PAD, PAD, 4]  # the caller's row is not modified
    assert collapse_vllm_image_prompts([with_image], None) == [with_image]  # a text-only model


def test_image_token_id_of_a_processor_and_a_tokenizer():
    tok = build_tokenizer()
    assert image_token_id_of(build_processor(tok)) == tok.convert_tokens_to_ids("<|image_pad|>") == PAD
    assert image_token_id_of(tok) is None  # a tokenizer has no .tokenizer / image_token_id


class _FakeLLM:
    """``vllm.LLM.generate``'s signature; records the prompts it gets."""

    def __init__(self):
        self.seen = []

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.seen.append(prompts)
        return "out"


def test_install_collapses_every_generate_call_of_that_engine_only():
    proc = build_processor(build_tokenizer())
    llm, other = _FakeLLM(), _FakeLLM()
    row = {"prompt_token_ids": [1, PAD, PAD, PAD, 4], "multi_modal_data": {"image": object()}}
    assert install_image_prompt_collapse(llm, proc) and install_image_prompt_collapse(llm, proc)  # idempotent
    assert isinstance(llm, _FakeLLM) and type(llm).__bases__ == (_FakeLLM,)  # one subclass, not two
    assert llm.generate([row], sampling_params="sp", use_tqdm=False) == "out"
    assert llm.seen[-1][0]["prompt_token_ids"] == [1, PAD, 4]
    llm.generate(row)  # one prompt, not a list
    assert llm.seen[-1]["prompt_token_ids"] == [1, PAD, 4]
    # a temporary instance-level wrapper, set and deleted (ncgrpo.trainer.vllm.vllm_requests), keeps it
    orig = llm.generate
    llm.generate = lambda prompts, *a, **k: orig(prompts, *a, **k)
    llm.generate([row])
    del llm.generate
    llm.generate([row])
    assert [s[0]["prompt_token_ids"] for s in llm.seen[-2:]] == [[1, PAD, 4]] * 2
    other.generate([row])  # another engine is untouched
    assert other.seen[-1][0]["prompt_token_ids"] == [1, PAD, PAD, PAD, 4]
    assert not install_image_prompt_collapse(_FakeLLM(), build_tokenizer())  # a text model: nothing to do
