"""ncgrpo.processors: the embedded base's processor is a standard transformers class, so
``AutoProcessor.from_pretrained(base)`` and ``NCGRPOTrainer(model=<base path>)`` work in a process that
never imported ncgrpo's processors, with processing bit-identical to the image-only Qwen2.5-VL processor
it was saved with."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from ncgrpo.models import load_processor
from ncgrpo.toy.pretrain import ASSET_DIR
from ncgrpo.toy.sft_data import encode_example

#: ncgrpo.processors.STANDARD_IMAGE_ONLY_PROCESSOR (spelt out: the tests import nothing new from ncgrpo at
#: module level, so on a version without it they fail on what they check, not on an import)
STANDARD_IMAGE_ONLY_PROCESSOR = "PaddleOCRVLProcessor"

_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    from PIL import Image

    base, out_dir = sys.argv[1], sys.argv[2]
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (84, 84, 3), dtype=np.uint8))
    if out_dir == "-":  # AutoProcessor alone
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(base)
        seen = sorted(m for m in sys.modules if m.split(".")[0] == "ncgrpo")
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2 + 2?"}]}]
        text = proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=[image], return_tensors="pt")
        pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        out = {"class": type(proc).__name__, "ncgrpo_modules": seen, "keys": sorted(enc),
               "image_tokens": int((enc["input_ids"] == pad).sum())}
    else:  # what a TRL user writes
        import datasets
        from ncgrpo import NCGRPOConfig, NCGRPOTrainer

        rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i} + 1?"}]}],
                 "images": [image]} for i in range(2)]
        args = NCGRPOConfig(output_dir=out_dir, per_device_train_batch_size=2, num_generations=2,
                            max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, bf16=False,
                            save_strategy="no", sigma0=1.0, sigma_schedule="constant")
        trainer = NCGRPOTrainer(model=base, reward_funcs=lambda completions, **kw: [float(len(str(c)))
                                for c in completions], args=args, train_dataset=datasets.Dataset.from_list(rows))
        trainer.train()
        out = {"class": type(trainer.processing_class).__name__, "steps": trainer.state.global_step}
    print("RESULT " + json.dumps(out))
    """
)


def _fresh_process(out_dir: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, str(ASSET_DIR), out_dir],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["class"] == STANDARD_IMAGE_ONLY_PROCESSOR
    return out


def test_autoprocessor_gives_the_embedded_base_a_vlm_processor_with_no_ncgrpo_import():
    """Fails on 894aedc: AutoProcessor gives a bare tokenizer (the saved class, TinyQwen2_5_VLProcessor, is
    known only in a process that imported ``ncgrpo.processors``)."""
    out = _fresh_process("-")
    assert out["ncgrpo_modules"] == []
    assert {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"} <= set(out["keys"])
    assert out["image_tokens"] == 9  # 84 px: 6 x 6 patches of 14 px, merged 2 x 2


@pytest.mark.slow  # a fresh process that imports TRL and trains a step (~15 s on a busy 2-core machine)
def test_ncgrpo_trainer_trains_on_the_embedded_base_from_its_path(tmp_path):
    """``NCGRPOTrainer(model=<base path>)``: TRL loads model and processor itself. Fails on 894aedc with
    ``KeyError: 'pixel_values'`` at step 0 (TRL's AutoProcessor gave a bare tokenizer)."""
    assert _fresh_process(str(tmp_path / "out"))["steps"] == 1


def _as_first_saved(folder) -> None:
    """The base's processor files as they were before they named the standard class."""
    p, t = folder / "processor_config.json", folder / "tokenizer_config.json"
    pc, tc = json.loads(p.read_text()), json.loads(t.read_text())
    pc["processor_class"] = tc["processor_class"] = "TinyQwen2_5_VLProcessor"
    tc.pop("image_token", None)
    p.write_text(json.dumps(pc, indent=2, sort_keys=True) + "\n")
    t.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def _outputs(proc) -> dict:
    """What the demo, eval and TRL ask of the processor, on the synthetic suite's prompts and images."""
    from ncgrpo.data.prompts import build_messages
    from ncgrpo.toy.suite import build_suite

    qs = build_suite(0)["validation"][:40:3]
    out = {}
    for i, q in enumerate(qs):  # pretrain's encoding (prompt + completion, one image)
        ex = encode_example(proc, q, "<think> x = 3 </think> \\boxed{3}")
        out.update({f"ex{i}.{k}": v for k, v in vars(ex).items() if torch.is_tensor(v)})
    texts = [
        proc.apply_chat_template(build_messages(q), add_generation_prompt=True, tokenize=False) for q in qs
    ]
    batch = proc(
        text=texts,
        images=[[im.convert("RGB") for im in q.images] for q in qs],
        padding=True,
        return_tensors="pt",
    )
    out.update({f"batch.{k}": v for k, v in batch.items()})
    chat = proc.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    out["chat"] = chat["input_ids"]
    out["texts"] = texts
    out["decoded"] = proc.batch_decode(batch["input_ids"], skip_special_tokens=True)
    out["decoded_raw"] = proc.batch_decode(batch["input_ids"])
    return out


def test_the_standard_processor_processes_the_base_bit_identically(tmp_path):
    """Same input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw and decoded text as
    the processor the base was saved with (weights untouched: the demo's records stay what they were)."""
    from ncgrpo.processors import name_standard_processor

    before = tmp_path / "before"
    shutil.copytree(ASSET_DIR, before)
    _as_first_saved(before)
    old, new = load_processor(before), load_processor(ASSET_DIR)
    assert (
        type(old).__name__ == "TinyQwen2_5_VLProcessor"
        and type(new).__name__ == STANDARD_IMAGE_ONLY_PROCESSOR
    )
    a, b = _outputs(old), _outputs(new)
    assert a.keys() == b.keys() and "batch.pixel_values" in a and "batch.image_grid_thw" in a
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
    # the committed folder is exactly the first one renamed: rename the copy and the files are equal
    name_standard_processor(before)
    for f in ("processor_config.json", "tokenizer_config.json"):
        assert json.loads((before / f).read_text()) == json.loads((ASSET_DIR / f).read_text()), f


def test_name_standard_processor_on_a_freshly_saved_folder(tmp_path):
    from transformers import AutoProcessor

    import tiny_models as tiny
    from ncgrpo.processors import STANDARD_IMAGE_ONLY_PROCESSOR as standard
    from ncgrpo.processors import name_standard_processor

    assert standard == STANDARD_IMAGE_ONLY_PROCESSOR

    proc = tiny.build_processor(tiny.build_tokenizer())
    proc.save_pretrained(tmp_path / "vl")
    name_standard_processor(tmp_path / "vl")
    name_standard_processor(tmp_path / "vl")  # idempotent
    again = AutoProcessor.from_pretrained(tmp_path / "vl")
    assert type(again).__name__ == STANDARD_IMAGE_ONLY_PROCESSOR
    again.save_pretrained(tmp_path / "resaved")  # a checkpoint of it keeps the standard class
    assert json.loads((tmp_path / "resaved" / "processor_config.json").read_text())["processor_class"] == (
        STANDARD_IMAGE_ONLY_PROCESSOR
    )
    assert AutoProcessor.from_pretrained(tmp_path / "resaved").image_token == "<|image_pad|>"

    tiny.build_processor(tiny.build_tokenizer(), kind="qwen3_vl").save_pretrained(tmp_path / "q3")
    with pytest.raises(ValueError, match="TinyQwen3VLProcessor"):
        name_standard_processor(tmp_path / "q3")
    with pytest.raises(FileNotFoundError, match="processor_config.json"):
        name_standard_processor(tmp_path / "missing")


def test_the_upstream_class_loads_the_embedded_base_where_torchvision_is_installed():
    """vLLM builds ``Qwen2_5_VLProcessor`` itself (never AutoProcessor) for a Qwen2.5-VL checkpoint: the
    base's processor config has the video processor section that class needs, and its text and image
    processing equal the standard class's. Here without torchvision only the section is checked (the
    upstream load was run with PyPI's torchvision beside the CPU torch, scripts/_ncgrpo_torchvision_cpu.py)."""
    from transformers import Qwen2_5_VLProcessor, utils

    video = json.loads((ASSET_DIR / "processor_config.json").read_text())["video_processor"]
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor"
    assert (video["patch_size"], video["merge_size"], video["size"]) == (
        14,
        2,
        {"longest_edge": 7056, "shortest_edge": 784},
    )
    if not utils.is_torchvision_available():
        pytest.skip("no torchvision here: the upstream class cannot be built")
    upstream, standard = Qwen2_5_VLProcessor.from_pretrained(ASSET_DIR), load_processor(ASSET_DIR)
    a, b = _outputs(upstream), _outputs(standard)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
