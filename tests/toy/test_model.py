"""Tiny local models, tokenizer and processor: real transformers / TRL code paths with no hub access."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from PIL import Image

import tiny_models as tiny
from tiny_models import (
    CONTROL_TOKENS,
    SPECIAL_TOKENS,
    build_processor,
    build_tokenizer,
    save_tiny,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
    tiny_qwen3_vl,
    tiny_text_model,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def proc(tok):
    return build_processor(tok)


@pytest.fixture(scope="module")
def vl_model(proc):
    return tiny_qwen2_5_vl(processor=proc)


def _img(seed: int, size: int = 64) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr)


def _msgs(n_images: int, text: str = "Find x. 3x + 5 = 20") -> list[dict]:
    content = [{"type": "image", "image": _img(i)} for i in range(n_images)]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_deterministic_and_special_tokens(tok):
    again = build_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    # control tokens take ids 0..6, in order; <think>, </think> the last two; all are single tokens
    assert tok.convert_tokens_to_ids(list(CONTROL_TOKENS)) == list(range(len(CONTROL_TOKENS)))
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [len(tok) - 2, len(tok) - 1]
    assert set(CONTROL_TOKENS) <= set(tok.all_special_tokens)
    assert "<think>" not in tok.all_special_tokens
    for t in SPECIAL_TOKENS:
        assert tok.encode(f"a {t} b", add_special_tokens=False).count(tok.convert_tokens_to_ids(t)) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert len(tok) == 512
    # a different corpus gives a different vocabulary
    other = build_tokenizer(["zebra quagga " * 50, "xylophone"], vocab_size=300)
    assert other.get_vocab() != tok.get_vocab()
    assert len(other) <= 300


def test_tokenizer_roundtrip_and_think_survives_decode(tok):
    text = "<think> 2 + 2 = 4, é ∑ 漢 </think> \\boxed{4}"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # <think> tags must survive skip_special_tokens (the format reward looks for them); chat tokens must not
    decoded = tok.decode(tok.encode(text + "<|im_end|>", add_special_tokens=False), skip_special_tokens=True)
    assert decoded == text


def test_tokenizer_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=100)


# ------------------------------------------------------------------------------------------ chat template


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_chat_template_images(tok, n_images):
    msgs = _msgs(n_images)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        + "<|vision_start|><|image_pad|><|vision_end|>" * n_images
        + "Find x. 3x + 5 = 20<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected


def test_chat_template_turns(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>easy</think> \\boxed{2}"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>easy</think> \\boxed{2}<|im_end|>\n"
    )
    assert not text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------- processor


def test_processor_has_no_torchvision_dependency(proc):
    from transformers import Qwen2_5_VLProcessor

    assert isinstance(proc, Qwen2_5_VLProcessor)
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert proc.chat_template == tiny.QWEN_CHAT_TEMPLATE


@pytest.mark.parametrize("n_images", [0, 1, 2])
@pytest.mark.parametrize("size", [56, 64, 200])
def test_processor_image_tokens_match_grid(proc, n_images, size):
    msgs = _msgs(n_images)
    for m in msgs[0]["content"][:-1]:
        m["image"] = m["image"].resize((size, size + 8))
    enc = proc.apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
    )
    n_pad = int((enc["input_ids"] == proc.image_token_id).sum())
    if n_images == 0:
        assert n_pad == 0 and "pixel_values" not in enc
        return
    merge = proc.image_processor.merge_size
    assert enc["image_grid_thw"].shape == (n_images, 3)
    assert n_pad == int(enc["image_grid_thw"].prod(-1).sum()) // merge**2
    assert enc["pixel_values"].shape[0] == int(enc["image_grid_thw"].prod(-1).sum())
    # a handful of tokens per image: area capped at 56*56 -> at most 4 merged tokens
    assert n_pad <= 4 * n_images


def test_processor_call_text_and_images(proc, tok):
    text = tok.apply_chat_template(_msgs(1), tokenize=False, add_generation_prompt=True)
    texts = [text, text.replace("Find x", "Find the value of y")]
    enc = proc(text=texts, images=[[_img(0)], [_img(1)]], return_tensors="pt", padding=True)
    assert enc["input_ids"].shape[0] == 2
    assert tok.padding_side == "left"
    assert (enc["input_ids"] == proc.image_token_id).sum(-1).tolist() == [4, 4]
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]


# -------------------------------------------------------------------------------------------------- models


def _vl_batch(proc, n: int = 2):
    texts, images = [], []
    for i in range(n):
        texts.append(
            proc.apply_chat_template(
                _msgs(1, f"Question {i}: what is {i} + {i}?" + " and then" * i), add_generation_prompt=True
            )
        )
        images.append([_img(10 + i)])
    return proc(text=texts, images=images, return_tensors="pt", padding=True)


def test_vl_config_fields(vl_model, tok):
    cfg = vl_model.config
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    tc = cfg.get_text_config()
    assert tc.vocab_size == len(tok)
    assert tc.eos_token_id == tok.eos_token_id and tc.pad_token_id == tok.pad_token_id
    tiny._check_mrope(cfg)
    assert vl_model.generation_config.pad_token_id == tok.pad_token_id
    assert tok.eos_token_id in vl_model.generation_config.eos_token_id
    assert vl_model.dtype == torch.float32
    # the sites the noise hook uses
    assert vl_model.model.language_model.norm is not None and vl_model.lm_head is not None


def test_vl_seed_controls_weights(proc):
    a = tiny_qwen2_5_vl(processor=proc, seed=0)
    b = tiny_qwen2_5_vl(processor=proc, seed=0)
    c = tiny_qwen2_5_vl(processor=proc, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_vl_generate_greedy_deterministic(vl_model, proc):
    enc = _vl_batch(proc, 2)
    with torch.no_grad():
        out1 = vl_model.generate(**enc, max_new_tokens=12, do_sample=False)
        out2 = vl_model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert out1.shape[0] == 2 and out1.shape[1] > enc["input_ids"].shape[1]
    assert torch.equal(out1, out2)
    # the image matters: a different image changes the logits
    enc2 = dict(enc)
    enc2["pixel_values"] = enc["pixel_values"].flip(0)
    with torch.no_grad():
        l1 = vl_model(**enc).logits[:, -1]
        l2 = vl_model(**enc2).logits[:, -1]
    assert not torch.allclose(l1, l2)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_other_vl_models_generate(tok, kind):
    p = build_processor(tok, kind=kind)
    make = {"qwen2_vl": tiny_qwen2_vl, "qwen3_vl": tiny_qwen3_vl}[kind]
    m = make(processor=p)
    enc = p.apply_chat_template(
        _msgs(1), tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
    )
    n_pad = int((enc["input_ids"] == p.image_token_id).sum())
    assert n_pad == int(enc["image_grid_thw"].prod()) // p.image_processor.merge_size**2 == 4
    with torch.no_grad():
        out1 = m.generate(**enc, max_new_tokens=6, do_sample=False)
        out2 = m.generate(**enc, max_new_tokens=6, do_sample=False)
    assert torch.equal(out1, out2) and out1.shape[1] > enc["input_ids"].shape[1]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_text_models_generate(tok, arch):
    m = tiny_text_model(arch, tokenizer=tok)
    assert m.config.vocab_size == len(tok)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is 2 + 2?", "Solve 3x = 9.")
    ]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out1 = m.generate(**enc, max_new_tokens=8, do_sample=False)
        out2 = m.generate(**enc, max_new_tokens=8, do_sample=False)
    assert torch.equal(out1, out2) and out1.shape[1] > enc["input_ids"].shape[1]
    assert m.model.norm is not None


# ------------------------------------------------------------------------------------------- save / load


def test_vl_save_load_roundtrip(vl_model, proc, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    save_tiny(vl_model, proc, tmp_path)
    model2 = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    proc2 = AutoProcessor.from_pretrained(tmp_path)
    assert type(model2) is type(vl_model)
    assert type(proc2) is type(proc)
    assert proc2.tokenizer.get_vocab() == proc.tokenizer.get_vocab()
    assert proc2.chat_template == proc.chat_template
    msgs = _msgs(2)
    kw = dict(tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True)
    enc, enc2 = proc.apply_chat_template(msgs, **kw), proc2.apply_chat_template(msgs, **kw)
    assert enc.keys() == enc2.keys() and all(torch.equal(enc[k], enc2[k]) for k in enc)
    with torch.no_grad():
        assert torch.equal(vl_model(**enc).logits, model2(**enc).logits)
    assert model2.generation_config.eos_token_id == vl_model.generation_config.eos_token_id


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llama"])
def test_bundle_and_load_tiny(kind, tmp_path):
    from transformers import ProcessorMixin

    model, proc = tiny.tiny_bundle(kind, seed=3)
    save_tiny(model, proc, tmp_path)
    model2, proc2 = tiny.load_tiny(tmp_path)
    assert type(model2) is type(model) and type(proc2) is type(proc)
    assert isinstance(proc2, ProcessorMixin) == (kind == "qwen2_5_vl")
    sd, sd2 = model.state_dict(), model2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_text_save_load_roundtrip(tok, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = tiny_text_model("qwen3", tokenizer=tok)
    save_tiny(m, tok, tmp_path)
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2.get_vocab() == tok.get_vocab() and tok2.chat_template == tok.chat_template
    assert tok2.eos_token == tok.eos_token and tok2.pad_token == tok.pad_token
    enc = tok(["hello world", "2 + 2 = 4"], return_tensors="pt", padding=True)
    enc2 = tok2(["hello world", "2 + 2 = 4"], return_tensors="pt", padding=True)
    assert torch.equal(enc["input_ids"], enc2["input_ids"])
    with torch.no_grad():
        assert torch.equal(m(**enc).logits, m2(**enc).logits)


# ----------------------------------------------------------------------------------------------------- TRL


def test_trl_grpo_trainer_accepts_processor(tmp_path):
    """TRL 1.16 GRPOTrainer with the tiny processor as `processing_class`: one real training step on CPU."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = build_tokenizer()
    proc = build_processor(tok)
    model = tiny_qwen2_5_vl(processor=proc)
    before = {k: v.clone() for k, v in model.named_parameters()}
    ds = Dataset.from_list(
        [
            {
                # conversational prompt with an image placeholder part; the PIL images go in `images`
                "prompt": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is x?"}]}
                ],
                "images": [_img(0)],
                "answer": "5",
            }
        ]
    )
    seen = {}

    def reward(completions, answer, **kwargs):
        seen["answer"] = answer
        return [float(len(c[0]["content"])) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        use_vllm=False,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=proc
    )
    out = trainer.train()
    assert out.global_step == 1
    assert seen["answer"] == ["5", "5"]
    log = trainer.state.log_history[0]
    # prompt (with its 4 image tokens) + completion tokens were counted for both generations
    assert log["num_tokens"] > 2 * 8
    changed = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    assert changed, "one optimizer step should move some weights"
