"""The images vLLM gets are the trainer processor's size (:mod:`ncgrpo.trainer.images`), so vLLM's processor
gives every image the token count the trainer's prompt ids and loss use.

TRL 1.16 tokenises with the trainer's processor (the recipe's ``min_pixels`` / ``max_pixels``) but hands vLLM
the original PIL images, which vLLM's processor resizes by the checkpoint's own limits. Checked here without
vLLM: (1) the size rule both processors apply (transformers' ``smart_resize``, which vLLM 0.31 imports for
Qwen2/2.5/3-VL) maps the trainer's target to itself, for the recipes' budget against the checkpoints' limits;
(2) real Qwen-VL image processors give the sent image the trainer's grid and pixels; (3) through the trainer
(every method that runs on vLLM, colocate and server), with TRL's own ``VLLMGeneration.generate`` and a fake
engine at vLLM's boundary (``LLM.generate``, ``VLLMClient.image_features`` / ``generate``), the images that
reach the engine have that size, and the engine-side processor counts the image tokens the prompt holds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from ncgrpo.core.image_noise import ResizePolicy
from ncgrpo.trainer.images import engine_images

if "tiny_grpo" in sys.modules:
    tiny = sys.modules["tiny_grpo"]
else:
    _spec = importlib.util.spec_from_file_location(
        "tiny_grpo", Path(__file__).parent / "scripts" / "tiny_grpo.py"
    )
    tiny = importlib.util.module_from_spec(_spec)
    sys.modules["tiny_grpo"] = tiny
    _spec.loader.exec_module(tiny)

#: NoisyRollout's budget, the recipes' min_pixels / max_pixels (recipes/base/geo3k_qwen2_5_vl_7b.yaml)
RECIPE = (262144, 1_000_000)
#: the checkpoints' preprocessor_config.json limits: Qwen2.5-VL (factor 14 * 2), Qwen3-VL (factor 16 * 2)
QWEN2_5_VL = (3136, 12845056)
QWEN3_VL = (65536, 16777216)

# (factor, the trainer's budget, the engine's limits)
CASES = [
    pytest.param(28, RECIPE, QWEN2_5_VL, id="qwen2.5-vl-recipe"),
    pytest.param(28, QWEN2_5_VL, QWEN2_5_VL, id="qwen2.5-vl-default"),
    pytest.param(32, RECIPE, QWEN3_VL, id="qwen3-vl-recipe"),
    pytest.param(32, QWEN3_VL, QWEN3_VL, id="qwen3-vl-default"),
]

_side = st.one_of(st.integers(1, 64), st.integers(1, 2048), st.integers(1, 8000))


@pytest.mark.parametrize(("factor", "budget", "engine"), CASES)
@settings(max_examples=500, deadline=None, derandomize=True)
@given(height=_side, width=_side)
@example(height=100, width=19999)  # floors past 200:1 under max_pixels 1e6: refused, named
@example(height=1, width=1)
@example(height=15, width=2999)
def test_smart_resize_of_the_target_is_the_target(factor, budget, engine, height, width) -> None:
    if max(height, width) / min(height, width) > 200:  # both processors refuse these
        with pytest.raises(ValueError, match="aspect ratio"):
            ResizePolicy(*budget, factor).target(height, width)
        return
    target = smart_resize(height, width, factor, *budget)  # the trainer's processor
    assert ResizePolicy(*budget, factor).target(height, width) == target
    th, tw = target
    if max(th, tw) / min(th, tw) > 200:  # rounding pushed it past 200:1: vLLM would refuse it; so do we
        with pytest.raises(ValueError, match="aspect ratio over 200"):
            engine_images([Image.new("L", (width, height))], ResizePolicy(*budget, factor))
        return
    assert th % factor == 0 and tw % factor == 0
    assert engine[0] <= th * tw <= engine[1]
    # vLLM's processor (the checkpoint's limits), given the target, keeps it: the same image-token count
    assert smart_resize(th, tw, factor, *engine) == target
    assert smart_resize(th, tw, factor, *budget) == target  # and so does a second pass of the trainer's


def _image_processor(factor: int, pixels: tuple[int, int]) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        min_pixels=pixels[0],
        max_pixels=pixels[1],
        patch_size=factor // 2,
        merge_size=2,
        temporal_patch_size=2,
    )


def _images(factor: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    side = factor * 20  # 560 x 560 (28) / 640 x 640 (32): inside the recipe's budget, at its own target
    return [
        Image.fromarray(rng.integers(0, 255, (300, 220), dtype=np.uint8)),  # L, below min_pixels: upsampled
        Image.fromarray(rng.integers(0, 255, (1200, 1600, 3), dtype=np.uint8)),  # above max_pixels
        Image.fromarray(rng.integers(0, 255, (500, 700, 4), dtype=np.uint8), "RGBA"),  # within, rounded
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)),  # at the target already
    ]


@pytest.mark.parametrize(
    ("factor", "engine"),
    [pytest.param(28, QWEN2_5_VL, id="qwen2.5-vl"), pytest.param(32, QWEN3_VL, id="qwen3-vl")],
)
def test_engine_processor_sees_the_trainers_grid_and_pixels(factor, engine) -> None:
    trainer_ip, engine_ip = _image_processor(factor, RECIPE), _image_processor(factor, engine)
    policy = ResizePolicy.from_image_processor(trainer_ip)
    assert policy == ResizePolicy(*RECIPE, factor)
    originals = _images(factor)
    sent = engine_images(originals, policy)
    for k, (original, image) in enumerate(zip(originals, sent, strict=True)):
        h, w = policy.target(original.height, original.width)
        assert (image.height, image.width) == (h, w)
        assert (image is original) == ((h, w) == (original.height, original.width))  # at target: untouched
        want = trainer_ip(images=[original], return_tensors="pt")
        got = engine_ip(images=[image], return_tensors="pt")
        assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
        # the PIL backends resize alike (RGB first, then bicubic): the engine sees the trainer's very pixels
        assert torch.equal(got["pixel_values"], want["pixel_values"])
        if k < 2:  # outside the recipe's budget: the engine, given the original, made another token count
            raw = engine_ip(images=[original], return_tensors="pt")["image_grid_thw"]
            assert not torch.equal(raw, want["image_grid_thw"])


def test_engine_images_refuse_what_they_cannot_resize() -> None:
    policy = ResizePolicy(*RECIPE, 28)
    with pytest.raises(TypeError, match="image 1: a ndarray, not a PIL image"):
        engine_images([Image.new("RGB", (560, 560)), np.zeros((4, 4, 3), np.uint8)], policy)
    assert engine_images([None], policy) == [None]


def test_rows_share_one_resized_copy_and_a_bad_image_names_its_row() -> None:
    from ncgrpo.trainer.images import engine_row_images

    host = SimpleNamespace(processing_class=SimpleNamespace(image_processor=_image_processor(28, RECIPE)))
    small, exact = Image.new("L", (300, 220), 7), Image.new("RGB", (560, 560))
    rows = [[small], [small, exact], None]
    out = engine_row_images(host, rows)
    assert out[0][0].size[::-1] == smart_resize(220, 300, 28, *RECIPE) and out[0][0].mode == "RGB"
    assert out[1][0] is out[0][0] and out[1][1] is exact and out[2] is None  # one copy per shared image
    assert rows[0][0] is small  # the caller's rows are not modified
    at_target = [[exact], [exact]]
    assert engine_row_images(host, at_target) is at_target
    with pytest.raises(TypeError, match="row 1, image 0: a ndarray, not a PIL image"):
        engine_row_images(host, [[small], [np.zeros((4, 4, 3), np.uint8)]])
    host.processing_class = SimpleNamespace(
        image_processor=SimpleNamespace(size={"height": 224, "width": 224})
    )
    assert engine_row_images(host, rows) is rows  # a fixed-size processor: vLLM resizes alike, nothing to do


def test_the_resize_policy_is_built_once_per_processor(monkeypatch) -> None:
    import ncgrpo.trainer.images as images_module
    from ncgrpo.core.plan import RowPlan
    from ncgrpo.methods.image import distorted_row_images
    from ncgrpo.trainer.images import engine_row_images

    built = []
    real = images_module.engine_policy
    monkeypatch.setattr(images_module, "engine_policy", lambda pc: built.append(pc) or real(pc))

    processor = SimpleNamespace(image_processor=_image_processor(28, RECIPE))
    host, small = SimpleNamespace(processing_class=processor), Image.new("L", (300, 220), 7)
    clean = [RowPlan(global_row=0, group=0, branch=0, noisy=False, prompt_id=0)]
    for _ in range(3):  # three generations
        engine_row_images(host, [[small]])
        distorted_row_images(host.processing_class, [[small]], clean, t=5)
    assert built == [processor]
    host.processing_class = SimpleNamespace(
        image_processor=SimpleNamespace(size={"height": 224, "width": 224})
    )
    assert (
        engine_row_images(host, [[small]]) == [[small]] and len(built) == 2
    )  # another processor: its own rule
    with pytest.raises(ValueError, match="does not expose min/max pixels"):  # the image method needs the rule
        distorted_row_images(host.processing_class, [[small]], clean, t=5)


# --------------------------------------------------------------------------------------------------
# through the trainer: TRL's VLLMGeneration.generate, a fake engine at vLLM's boundary
# --------------------------------------------------------------------------------------------------
#: the engine's processor: the tiny checkpoint's, with wider limits than the trainer's 784..3136 budget
ENGINE_PIXELS = (784, 12845056)


class _Params:
    """The parts of ``vllm.SamplingParams`` TRL and ncgrpo's adapter use."""

    def __init__(self, n=1, extra_args=None, **kwargs):
        self.n, self.extra_args, self.kwargs = n, extra_args, kwargs

    def clone(self):
        return _Params(self.n, dict(self.extra_args) if self.extra_args else None, **self.kwargs)


def _token(tid, logprob):
    return {tid: SimpleNamespace(logprob=logprob, rank=1)}


class _LLM:
    def __init__(self):
        self.prompts = []

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.prompts.extend(prompts)
        out = SimpleNamespace(token_ids=[11, 12], logprobs=[_token(11, -0.1), _token(12, -0.2)])
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[out]) for p in prompts]


class _Client:
    def __init__(self, image_token_id):
        self.image_token_id, self.images = image_token_id, []

    def image_features(self, images):
        self.images.extend(images)
        return [
            None if not imgs else {"mm_placeholders": {"image": [{"offset": 0, "length": 1}] * len(imgs)}}
            for imgs in images
        ]

    def generate(self, prompts, features=None, n=1, **sampling):
        k = len(prompts) * n
        return {
            "prompt_ids": list(prompts),
            "completion_ids": [[11, 12]] * k,
            "logprobs": [[[-0.1], [-0.2]]] * k,
            "logprob_token_ids": [[[11], [12]]] * k,
        }


def _trl_vllm(tr, mode: str, monkeypatch):
    """TRL's ``VLLMGeneration`` (its real ``generate``) over a fake engine, without starting vLLM."""
    import trl.generation.vllm_generation as vg

    monkeypatch.setattr(vg, "SamplingParams", _Params, raising=False)
    gen = object.__new__(vg.VLLMGeneration)
    a = tr.args
    vars(gen).update(
        mode=mode, model=tr.model, accelerator=tr.accelerator, processing_class=tr.processing_class,
        structured_outputs_regex=None, tensor_parallel_size=1, enable_sleep_mode=False,
        _llm_weights_sleeping=False, repetition_penalty=1.0, temperature=a.temperature, top_p=1.0, top_k=0,
        min_p=None, max_completion_length=a.max_completion_length, logprobs=0, generation_kwargs={},
    )  # fmt: skip
    if mode == "colocate":
        gen.llm = _LLM()
    else:
        gen.vllm_client = _Client(tr.processing_class.image_token_id)
    return gen


def _prompts():
    rng = np.random.default_rng(1)
    small = Image.fromarray(rng.integers(0, 255, (15, 20), dtype=np.uint8))  # L, below the budget
    large = Image.fromarray(rng.integers(0, 255, (70, 100, 4), dtype=np.uint8), "RGBA")  # above it
    exact = Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))  # at the target
    text = {"type": "text", "text": "What is 1 + 1?"}
    a = [{"role": "user", "content": [{"type": "image", "image": small}, text]}]
    b = [
        {
            "role": "user",
            "content": [{"type": "image", "image": large}, {"type": "image", "image": exact}, text],
        }
    ]
    return [a, b], exact


def _image_runs(ids, image_token_id) -> list[int]:
    runs, prev = [], None
    for t in ids:
        if t == image_token_id:
            if prev == image_token_id:
                runs[-1] += 1
            else:
                runs.append(1)
        prev = t
    return runs


@pytest.mark.parametrize(
    ("method", "mode"),
    [
        ("vanilla", "colocate"),
        ("latent", "colocate"),
        ("image", "colocate"),
        ("vanilla", "server"),
        ("latent", "server"),
    ],
)
def test_images_reaching_vllm_have_the_trainers_size(tmp_path, monkeypatch, method, mode) -> None:
    from ncgrpo.trainer import NCGRPOTrainer

    G = 4
    (a, b), exact = _prompts()
    messages = [a] * G + [b] * G  # TRL's batch: each prompt repeated num_generations times
    kw = dict(image_noise_step=500) if method == "image" else {}
    tr = NCGRPOTrainer(
        model=tiny.model(),
        reward_funcs=[tiny.hash_reward],
        args=tiny.config(
            tmp_path, rollout_method=method, num_generations=G, per_device_train_batch_size=2 * G, **kw
        ),
        train_dataset=tiny.dataset(2),
        processing_class=tiny.processor(),
    )
    prompt_ids, images, fields = tr._tokenize_prompts(messages)
    trainer_ip = tr.processing_class.image_processor
    policy = ResizePolicy.from_image_processor(trainer_ip)
    engine_ip = _image_processor(policy.factor, ENGINE_PIXELS)
    assert all(
        policy.target(im.height, im.width) != (im.height, im.width) for im in images[0] + images[G][:1]
    )
    tr.args.vllm_mode = mode
    tr.use_vllm = True
    tr._last_loaded_step = tr.state.global_step  # no weight sync
    tr.vllm_generation = _trl_vllm(tr, mode, monkeypatch)
    if method != "vanilla":  # NC-GRPO's generation (vanilla: TRL's path, ncgrpo's hooks off)
        tr._nc_inputs, tr._nc_gen = [{"question_id": f"q{i // G}"} for i in range(2 * G)], None
    completion_ids, _ = tr._generate_single_turn(prompt_ids, images, fields, G)
    assert completion_ids == [[11, 12]] * (2 * G)

    if mode == "colocate":
        sent = []
        for p in tr.vllm_generation.llm.prompts:
            im = p["multi_modal_data"]["image"]
            sent.append(im if isinstance(im, list) else [im])
        rows = range(2 * G)
    else:  # the server processes each prompt's images once (TRL sends the first row's)
        sent, rows = tr.vllm_generation.vllm_client.images, range(0, 2 * G, G)
    assert len(sent) == len(rows)
    noisy = [p.noisy for p in tr._nc_gen.plans] if method == "image" else [False] * (2 * G)
    for i, row_images in zip(rows, sent, strict=True):
        originals = images[i]
        assert len(row_images) == len(originals)
        runs = _image_runs(prompt_ids[i], tr.processing_class.image_token_id)  # the trainer's prompt
        for original, image, run in zip(originals, row_images, runs, strict=True):
            h, w = policy.target(original.height, original.width)
            assert (image.height, image.width) == (h, w), f"row {i}: vLLM got {image.size}"
            grid = engine_ip(images=[image], return_tensors="pt")["image_grid_thw"]
            assert torch.equal(grid, trainer_ip(images=[original], return_tensors="pt")["image_grid_thw"])
            assert int(grid.prod()) // 4 == run  # vLLM's processor expands the image to the prompt's run
            if noisy[i]:  # the image method's distorted copy, made at the target
                continue
            if original is exact:
                assert image is exact  # already at the target: passed through untouched
            else:
                want = trainer_ip(images=[original], return_tensors="pt")["pixel_values"]
                assert torch.equal(engine_ip(images=[image], return_tensors="pt")["pixel_values"], want)
    assert images[0][0].size == (20, 15)  # the trainer's own images (prompt ids, loss inputs) unchanged


def test_transformers_path_gets_the_original_images(tmp_path, monkeypatch) -> None:
    """Without vLLM the hook does nothing: TRL's transformers generation gets the images it was given."""
    from trl import GRPOTrainer

    tr = tiny.trainer(tmp_path, rollout_method="vanilla", max_steps=1)
    seen = []
    monkeypatch.setattr(
        GRPOTrainer, "_generate_single_turn", lambda self, p, images, *a, **k: seen.append(images) or ([], [])
    )
    (a, _), _ = _prompts()
    images = [[a[0]["content"][0]["image"]]]
    tr._generate_single_turn([[1, 2]], images, {}, 1)
    assert seen == [images] and seen[0] is images


# --------------------------------------------------------------------------------------------------
# a real vLLM engine (marker vllm; .venv-vllm, with the torchvision scripts/setup_vllm.sh installs)
# --------------------------------------------------------------------------------------------------
def _collapsed(ids, image_token_id) -> list[int]:
    """``ids`` with each run of image tokens cut to one: the form vLLM 0.31 expands itself."""
    return [t for k, t in enumerate(ids) if t != image_token_id or k == 0 or ids[k - 1] != image_token_id]


@pytest.mark.vllm
def test_real_engine_expands_the_sent_image_to_the_trainers_token_count(tmp_path) -> None:
    """vLLM's own processor on the checkpoint's limits (784..12544 pixels here) against a trainer whose
    processor has a narrower budget (5000..8000): given the original 20 x 15 image the engine's prompt
    holds 1 image token where the trainer's holds 9; given :func:`engine_images`' copy (84 x 84) it
    holds the trainer's 9, and its prompt ids are the trainer's, token for token."""
    pytest.importorskip("vllm")
    import os

    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from tiny_models import image_chat
    from vlm_fixtures import save_vllm_qwen2_5_vl  # a missing torchvision is an error there

    model_dir = save_vllm_qwen2_5_vl(tmp_path / "model")
    trainer = AutoProcessor.from_pretrained(model_dir, min_pixels=5000, max_pixels=8000)
    policy = ResizePolicy.from_image_processor(trainer.image_processor)
    assert policy == ResizePolicy(5000, 8000, 28)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (15, 20, 3), dtype=np.uint8))
    text = trainer.apply_chat_template(image_chat("What?"), add_generation_prompt=True, tokenize=False)
    ids = trainer(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    tid = trainer.image_token_id
    assert ids.count(tid) == 9  # 84 x 84 pixels: 3 x 3 merged patches
    kv = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    llm = None
    try:
        llm = LLM(
            model=str(model_dir), dtype="float32", seed=0, max_model_len=512, max_num_seqs=2,
            enforce_eager=True, kv_cache_memory_bytes=2 << 20, block_size=32,
            limit_mm_per_prompt={"image": 1, "video": 0},
        )  # fmt: skip
        got = {}
        for name, im in (("original", image), ("sent", engine_images([image], policy)[0])):
            prompt = {"prompt_token_ids": _collapsed(ids, tid), "multi_modal_data": {"image": im}}
            (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            got[name] = list(out.prompt_token_ids)
    finally:
        if kv is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
    assert got["original"].count(tid) == 1  # the bug: another prompt than the one the trainer scores
    assert got["sent"] == ids
