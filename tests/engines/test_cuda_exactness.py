"""The exactness checks the GPU check (scripts/gpu_check.sh, part ``tests``) runs on the lent CUDA
machine: eq. (2) through the prefill hook in float32 and bfloat16, clean rows and the KV cache untouched,
keyed draws equal on the device and the CPU, the shared prefill equal to one prefill per row, and the
sync-free noise path (vLLM's) reading nothing back from the device.

Marked ``gpu`` (deselected by default). The device is ``cuda`` unless ``NCGRPO_GPU_CHECK_DEVICE`` names
another: the rehearsal (scripts/gpu_rehearse.sh) runs the same tests with ``cpu`` so that a broken test or
import shows here, not on the lent machine; tests that only mean something on CUDA skip there.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from ncgrpo.core.noise import NoiseKey, RowNoise, draw_eps, draw_eps_keys, perturb, perturb_selected
from ncgrpo.engines.branch_point import branch_point_capture
from ncgrpo.engines.shared_prefill import shared_prefill_generate
from ncgrpo.engines.transformers import prefill_noise
from tiny_models import (
    MIXED_TEXTS,
    build_tokenizer,
    image_prompts,
    mixed_images,
    tiny_bundle,
    tiny_text_model,
)

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("NCGRPO_GPU_CHECK_DEVICE", "cuda")
PROMPTS = ["The quick brown fox", "Solve for x: 3x + 5 = 20.", "A circle has radius r = 5"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def device():
    """The device, with TF32 off while these tests run: cuDNN's default TF32 convolutions (the vision
    tower's patch embedding) would round differently for the shared and the repeated batch shapes."""
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (NCGRPO_GPU_CHECK_DEVICE=cpu runs these on the CPU)")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device(DEVICE)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _text_model(tok, device, dtype):
    return tiny_text_model("qwen2", tokenizer=tok, num_hidden_layers=4).to(device=device, dtype=dtype).eval()


def _prefill(model, inputs, rows=None):
    """One prefill forward with an explicit cache: (per-layer (K, V), last-token logits, hook)."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    hook = None
    with torch.no_grad():
        if rows is None:
            out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with prefill_noise(model, rows) as hook:
                out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return kv, out.logits[:, -1], hook


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_eq2_exact_clean_rows_and_kv_untouched(tok, device, dtype):
    """The noisy rows' first-token logits are ``lm_head(perturb(h, draw_eps(key, [0], d), sigma))`` of the
    clean run's final-norm state, bit for bit; the clean row's logits and every layer's K and V are the
    clean run's, bit for bit."""
    model = _text_model(tok, device, DTYPES[dtype])
    tok.padding_side = "left"
    x = {k: v.to(device) for k, v in tok(PROMPTS, return_tensors="pt", padding=True).items()}
    keys = [NoiseKey(7, 3, 0, 0), NoiseKey(7, 3, 1, 0)]
    rows = [RowNoise(0.2, keys[0]), RowNoise(0.2, keys[1]), RowNoise()]
    kv0, logits0, _ = _prefill(model, x)
    kv1, logits1, hook = _prefill(model, x, rows)
    for (k0, v0), (k1, v1) in zip(kv0, kv1, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert torch.equal(logits1[2], logits0[2])
    rec = hook.last
    d = model.config.hidden_size
    h = rec.clean_last.to(device=device, dtype=DTYPES[dtype])  # [3, d] final-norm states, last token
    eps = torch.cat([draw_eps(k, [0], d, device=device) for k in keys])  # [2, d]
    want = torch.cat([perturb(h[:2], eps, 0.2), h[2:]])  # eq. (2) on the noisy rows
    assert torch.equal(rec.noisy_last.to(device=device, dtype=DTYPES[dtype]), want)
    with torch.no_grad():
        expect = model.lm_head(want[:, None, :])[:, -1]  # the shape the model's own lm_head call has
    assert torch.equal(logits1, expect), f"max |diff| {(logits1 - expect).abs().max()}"
    assert not torch.equal(logits1[0], logits0[0]) and not torch.equal(logits1[1], logits0[1])
    assert (rec.rel[:2] > 0).all() and rec.rel[2] == 0


def test_keyed_draws_equal_on_the_device_and_the_cpu(device):
    keys = [NoiseKey(1, 2, p, j) for p in range(3) for j in range(2)]
    for mode in ("independent", "rank_one"):
        cpu = draw_eps(keys[0], [0, 1, 5], 64, mode=mode)
        assert torch.equal(draw_eps(keys[0], [0, 1, 5], 64, mode=mode, device=device).cpu(), cpu)
    many = draw_eps_keys(keys, 0, 64)
    assert torch.equal(many.to(device).cpu(), many)
    for i, k in enumerate(keys):
        assert torch.equal(many[i : i + 1], draw_eps(k, [0], 64))


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5_vl"])
def test_shared_prefill_equals_one_prefill_per_row(device, kind):
    """Greedy tokens identical and first-token logits within float32 rounding, shared vs repeated, G = 4
    (2 clean + 2 noisy rows per prompt), left padding, mixed prompt lengths and image sizes."""
    model, proc = tiny_bundle(kind)
    model = model.to(device).eval()
    g = 4
    tk = getattr(proc, "tokenizer", proc)
    tk.padding_side = "left"
    if kind.endswith("_vl"):
        images = mixed_images()
        enc = proc(
            text=[m for m in image_prompts(proc, MIXED_TEXTS) for _ in range(g)],
            images=[im for im in images for _ in range(g)],
            padding=True,
            return_tensors="pt",
        )
    else:
        enc = tk([t for t in MIXED_TEXTS for _ in range(g)], padding=True, return_tensors="pt")
    inputs = {k: v.to(device) for k, v in dict(enc).items()}
    rows = [
        RowNoise(0.5, NoiseKey(3, 1, p, j - 2)) if j >= 2 else RowNoise()
        for p in range(len(MIXED_TEXTS))
        for j in range(g)
    ]

    def run(shared):
        kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        with torch.no_grad(), branch_point_capture(model) as point, prefill_noise(model, rows):
            out = shared_prefill_generate(model, **inputs, **kw) if shared else model.generate(**inputs, **kw)
        return out.sequences, point.logits

    seq_r, logits_r = run(False)
    seq_s, logits_s = run(True)
    assert model._ncgrpo_last_shared.shared
    assert torch.equal(seq_r, seq_s)
    torch.testing.assert_close(logits_s, logits_r, rtol=0, atol=1e-4)


def test_sync_free_noise_reads_nothing_back(device):
    """``perturb_selected(sync_free=True)`` (what vLLM's noise step runs) makes no host-device sync:
    CUDA's sync debug mode turns any synchronising call into an error. Equal values to the synced path."""
    if device.type != "cuda":
        pytest.skip("a host-device sync exists only on CUDA")
    h = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    draws = [(RowNoise(0.2, NoiseKey(1, 1, p, 0)), [0]) for p in range(4)]
    synced = perturb_selected(h, draws)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        free = perturb_selected(h, draws, sync_free=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    assert torch.equal(free, synced)
