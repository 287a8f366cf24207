"""ncgrpo.models: a checkpoint shaped like the hub's Qwen2-VL, Qwen2.5-VL and Qwen3-VL ones loads, model and
processor, in the project's environment (CPU torch, no torchvision), and processes text and images.

The folders are built here, no download: a tiny model of each family from transformers' config classes
(``tests/tiny_models.py``), a tiny BPE tokenizer saved as transformers' ``Qwen2Tokenizer`` (the hub's
``tokenizer_class``) with the hub's ``vocab.json`` / ``merges.txt`` beside it, and the processor files
the hub repositories have, with their keys and values: ``preprocessor_config.json`` (flat, naming the
image processor and the upstream processor class), ``video_preprocessor_config.json`` (Qwen3-VL),
``chat_template.json`` and a ``tokenizer_config.json`` in the hub's (transformers 4) form.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import tiny_models as tiny
from ncgrpo.models import load_model_and_processor, load_processor
from ncgrpo.processors import IMAGE_ONLY_PROCESSORS
from ncgrpo.toy.model import CONTROL_TOKENS, EOS_TOKEN, PAD_TOKEN, QWEN_CHAT_TEMPLATE, build_tokenizer

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_QWEN2_IMAGE = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "image_processor_type": "Qwen2VLImageProcessor",
}
#: What the hub's Qwen2-VL-7B-Instruct, Qwen2.5-VL-7B-Instruct and Qwen3-VL-8B-Instruct repositories
#: hold for their processors (processor class, preprocessor_config.json, video_preprocessor_config.json).
HUB = {
    "qwen2_vl": ("Qwen2VLProcessor", _QWEN2_IMAGE, None),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", _QWEN2_IMAGE, None),
    "qwen3_vl": (
        "Qwen3VLProcessor",
        {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "Qwen2VLImageProcessorFast",
        },
        {
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
    ),
}
_MODELS = {"qwen2_vl": tiny.tiny_qwen2_vl, "qwen2_5_vl": tiny.tiny_qwen2_5_vl, "qwen3_vl": tiny.tiny_qwen3_vl}
_UPSTREAM_CLASSES = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
}


def _write(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def hub_checkpoint(kind: str, out: Path, *, layout: str = "hub", weights: bool = True) -> Path:
    """A tiny ``kind`` checkpoint in ``out`` with the files of the hub's repository (``layout="hub"``), or
    as transformers 5 saves a processor that has a video processor (``layout="saved"``: one
    ``processor_config.json`` with ``image_processor`` and ``video_processor`` sections, ``chat_template.jinja``):
    what a model fine-tuned and saved on a machine with torchvision looks like."""
    from transformers import Qwen2Tokenizer

    processor_class, image, video = HUB[kind]
    out.mkdir(parents=True, exist_ok=True)
    toy = build_tokenizer()
    bpe = json.loads(toy.backend_tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in bpe["merges"]]
    extra = [t for t in CONTROL_TOKENS if t != PAD_TOKEN]
    tok = Qwen2Tokenizer(
        vocab=bpe["vocab"],
        merges=merges,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=extra,
    )
    tok.save_pretrained(out)  # tokenizer.json
    _write(out / "vocab.json", bpe["vocab"])
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    added = {
        str(tok.convert_tokens_to_ids(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in CONTROL_TOKENS
    }
    _write(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "additional_special_tokens": extra,
            "bos_token": None,
            "chat_template": QWEN_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS_TOKEN,
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": PAD_TOKEN,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    if layout == "hub":
        _write(out / "chat_template.json", {"chat_template": QWEN_CHAT_TEMPLATE})
        _write(out / "preprocessor_config.json", {**image, "processor_class": processor_class})
        if video is not None:
            _write(out / "video_preprocessor_config.json", {**video, "processor_class": processor_class})
    else:
        video = video or {**{k: v for k, v in image.items() if k != "image_processor_type"}}
        video.setdefault("video_processor_type", "Qwen2VLVideoProcessor")
        (out / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE)
        _write(
            out / "processor_config.json",
            {"image_processor": image, "video_processor": video, "processor_class": processor_class},
        )
    model = _MODELS[kind](tokenizer=toy)  # same ids as the Qwen2Tokenizer: it is the same vocabulary
    if weights:
        model.save_pretrained(out)
    else:
        model.config.save_pretrained(out)
    return out


def _image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _check_text_and_images(processor, model=None) -> None:
    """apply_chat_template + processor(text, images): the upstream Qwen VL processing (each image's
    placeholder expanded to grid / merge**2 tokens, pixel_values from the image processor)."""
    images = [_image(60, 90, 0), _image(100, 56, 1)]
    chats = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {i} + 1?"}]}]
        for i in range(2)
    ]
    texts = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    assert (
        texts[0].startswith("<|im_start|>system\n")
        and "<|vision_start|><|image_pad|><|vision_end|>" in texts[0]
    )
    assert texts[0].endswith("<|im_start|>assistant\n")
    enc = processor(text=texts, images=[[images[0]], [images[1]]], padding=True, return_tensors="pt")
    direct = processor.image_processor(images=images, return_tensors="pt")
    assert torch.equal(enc["pixel_values"], direct["pixel_values"])
    assert torch.equal(enc["image_grid_thw"], direct["image_grid_thw"])
    merge = processor.image_processor.merge_size
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    per_row = (enc["input_ids"] == pad).sum(dim=1)
    assert per_row.tolist() == (enc["image_grid_thw"].prod(dim=1) // merge**2).tolist()
    assert processor.tokenizer.padding_side == "left" and bool((enc["attention_mask"][:, -1] == 1).all())
    plain = processor(text=["2 + 2 ="], return_tensors="pt")  # text alone
    assert processor.batch_decode(plain["input_ids"])[0] == "2 + 2 ="
    if model is not None:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=2, do_sample=False)
        assert out.shape == (2, enc["input_ids"].shape[1] + 2)


@pytest.mark.parametrize("kind", sorted(HUB))
def test_a_hub_shaped_checkpoint_loads_model_and_processor(kind, tmp_path):
    """Fails on 894aedc: "Qwen2VLVideoProcessor requires the Torchvision library" (Qwen3VLVideoProcessor)."""
    from transformers import utils

    path = hub_checkpoint(kind, tmp_path / kind)
    assert (path / "preprocessor_config.json").is_file() and not (path / "processor_config.json").exists()
    model, processor = load_model_and_processor(path, dtype="float32", device="cpu")
    upstream = getattr(__import__("transformers"), _UPSTREAM_CLASSES[kind])
    assert isinstance(processor, upstream)  # the upstream class, or its image-only subclass
    if not utils.is_torchvision_available():
        assert type(processor) is IMAGE_ONLY_PROCESSORS[kind]
        with pytest.raises(ImportError, match="[Tt]orchvision"):  # what the upstream loading does here
            upstream.from_pretrained(path)
        video = np.zeros((4, 56, 56, 3), dtype=np.uint8)  # refused, not dropped (upstream __call__ would)
        with pytest.raises(ValueError, match="no video processor.*torchvision"):
            processor(text=["<|vision_start|><|video_pad|><|vision_end|>hi"], videos=[video])
    assert processor.chat_template == QWEN_CHAT_TEMPLATE  # from chat_template.json
    ip = processor.image_processor
    want = HUB[kind][1]
    assert (ip.patch_size, ip.merge_size) == (want["patch_size"], want["merge_size"])
    lo, hi = (3136, 12845056) if kind != "qwen3_vl" else (65536, 16777216)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (lo, hi)
    _check_text_and_images(processor, model)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_checkpoint_saved_with_a_video_processor_loads(kind, tmp_path):
    """A fine-tuned model saved where torchvision was installed names its video processor too."""
    path = hub_checkpoint(kind, tmp_path / kind, layout="saved", weights=False)
    processor = load_processor(path, min_pixels=56 * 56, max_pixels=112 * 112)
    assert processor.chat_template == QWEN_CHAT_TEMPLATE
    assert (
        processor.image_processor.size["shortest_edge"],
        processor.image_processor.size["longest_edge"],
    ) == (
        56 * 56,
        112 * 112,
    )
    _check_text_and_images(processor)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_hub_checkpoints_processor_saves_as_the_hub_class(kind, tmp_path):
    """A checkpoint of a model trained here (TRL saves the processor beside the weights) names the upstream
    class and keeps the source's video processor settings, so it loads with AutoProcessor wherever
    torchvision is installed, and here with load_processor, processing as before."""
    from transformers import AutoProcessor, utils

    processor_class, image, video = HUB[kind]
    source = hub_checkpoint(kind, tmp_path / "hub", weights=False)
    processor = load_processor(source)
    processor.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "processor_config.json").read_text())
    assert saved["processor_class"] == processor_class and "video_processor" in saved
    if not utils.is_torchvision_available():  # else the upstream class saved its own video processor
        assert saved["video_processor"] == (video or image)  # what the upstream class reads from the source
    tok = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert tok["processor_class"] == processor_class
    (tmp_path / "saved" / "config.json").write_bytes((source / "config.json").read_bytes())
    again = load_processor(tmp_path / "saved")
    assert type(again) is type(processor) and again.chat_template == processor.chat_template
    _check_text_and_images(again)
    if utils.is_torchvision_available():
        upstream = AutoProcessor.from_pretrained(tmp_path / "saved")
        assert type(upstream).__name__ == processor_class and upstream.video_processor is not None


def test_saved_processor_class_reads_the_files_autoprocessor_reads(tmp_path):
    from ncgrpo.processors import saved_processor_class

    path = hub_checkpoint("qwen3_vl", tmp_path / "hub", weights=False)
    assert saved_processor_class(path) == "Qwen3VLProcessor"
    for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (path / f).unlink()
    assert saved_processor_class(path) == "Qwen3VLProcessor"  # no file names one: the model type's
    _write(path / "processor_config.json", {"processor_class": "TinyQwen3VLProcessor"})
    assert saved_processor_class(path) == "TinyQwen3VLProcessor"  # processor_config.json comes first


def test_ncgrpo_trainer_takes_a_hub_shaped_path(tmp_path):
    """NCGRPOTrainer(model=<path>): TRL loads the processor with AutoProcessor, which fails on 894aedc for
    a hub checkpoint without torchvision; the trainer gets the image-only processor instead."""
    import datasets
    from transformers import Qwen2_5_VLProcessor

    from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer

    path = hub_checkpoint("qwen2_5_vl", tmp_path / "model")
    rows = [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i} + 1?"}]}
            ],
            "images": [_image(56, 56, i)],
        }
        for i in range(2)
    ]
    args = NCGRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        sigma0=1.0,
        sigma_schedule="constant",
    )
    trainer = NCGRPOTrainer(
        model=str(path),
        reward_funcs=lambda completions, **kw: [float(len(str(c))) for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
    )
    assert isinstance(trainer.processing_class, Qwen2_5_VLProcessor)
    assert trainer.processing_class.tokenizer.truncation_side == "left"
    trainer.train()
    assert trainer.state.global_step == 1
