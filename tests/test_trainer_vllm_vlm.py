"""NCGRPOTrainer with ``use_vllm=True`` (colocate) on a tiny Qwen2.5-VL in vllm-cpu (marker ``vllm``; run in
.venv-vllm, built by scripts/setup_vllm.sh with torchvision). One training step per method, TRL's own
``VLLMGeneration`` building the requests.

TRL 1.16 sends vLLM the processor's prompt ids, image placeholders already expanded; vLLM 0.31 expands
the first placeholder of each run again (``ncgrpo.engines.vllm_multimodal``), so without the trainer's
collapse every row was generated from a prompt with 2N - 1 image pads (measured: 76 tokens for the
trainer's 61) and TRL's importance ratios on clean rows ranged to 1.6. Checked here: the prompt vLLM
generated from is the trainer's, for vanilla too (the baseline must get the same prompts), and the clean
rows' importance ratios are 1 within the engine's float32 round-off.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from ncgrpo.engines.vllm_cpu import cpu_weight_sync  # noqa: E402
from ncgrpo.trainer import NCGRPOTrainer  # noqa: E402
from tiny_models import image_chat, length_reward, vllm_trainer_config  # noqa: E402
from vlm_fixtures import N_IMAGE_TOKENS, random_image, save_vllm_qwen2_5_vl  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_vllm_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl")))


@pytest.mark.parametrize("method", ["vanilla", "image"])
def test_vlm_rows_reach_vllm_as_the_trainers_prompt(model_dir, tmp_path, method):
    import datasets
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    ds = datasets.Dataset.from_list(
        [
            {"prompt": image_chat(f"What is {i} + 1?"), "images": [random_image(i)], "question_id": f"q{i}"}
            for i in range(2)
        ]
    )
    extra = {"image_noise_step": 300} if method == "image" else {}
    args = vllm_trainer_config(tmp_path, rollout_method=method, max_steps=1, bf16=False, **extra)
    sent = []
    orig = vllm.LLM.generate

    def spy(self, prompts, *a, **k):  # below the trainer's collapse, at vLLM's own generate
        outs = orig(self, prompts, *a, **k)
        sent.extend(list(o.prompt_token_ids) for o in outs)
        return outs

    vllm.LLM.generate = spy
    try:
        with cpu_weight_sync():
            tr = NCGRPOTrainer(
                model=model_dir,
                reward_funcs=length_reward,
                args=args,
                train_dataset=ds,
                processing_class=proc,
            )
            tr.train()
    finally:
        vllm.LLM.generate = orig
    G = args.num_generations
    assert len(sent) == G  # one prompt x G rows
    expected = {
        tuple(
            proc(
                text=[
                    proc.apply_chat_template(
                        image_chat(f"What is {i} + 1?"), add_generation_prompt=True, tokenize=False
                    )
                ],
                images=[random_image(i)],
            )["input_ids"][0]
        )
        for i in range(2)
    }
    for ids in sent:
        assert ids.count(proc.image_token_id) == N_IMAGE_TOKENS
        assert tuple(ids) in expected  # the trainer's prompt, as its processor tokenises it
    # the engine's and the trainer's logprobs agree on the clean rows (float32 both sides)
    logs = tr.state.log_history[0]
    if method == "vanilla":
        lo, hi = (
            logs["sampling/importance_sampling_ratio/min"],
            logs["sampling/importance_sampling_ratio/max"],
        )
    else:  # the noisy rows saw distorted images; their ratios are set to 1 (noisy_importance_sampling="exclude")
        m = tr.nc_history[0].metrics
        lo, hi = (
            m["sampling/importance_sampling_ratio_used/min"],
            m["sampling/importance_sampling_ratio_used/max"],
        )
    assert 0.98 < lo <= hi < 1.02, (lo, hi)
