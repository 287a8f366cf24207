"""The loss side with each prompt forwarded once per set of rows that share it (``share_prompt_loss``):
per-token log-probabilities, entropies, a GRPO-shaped loss and every parameter's gradient equal TRL's
repeated path (``GRPOTrainer._get_per_token_logps_and_entropies``) within float32 rounding, for a text
Qwen2, Qwen2.5-VL and Qwen3-VL with images, left padding and mixed prompt lengths, micro-batches that
split and shuffle groups, eager attention and gradient checkpointing. In bf16 (weights and autocast) its
error against a float32 reference is no larger than TRL's own bf16 pass's.
"""

from __future__ import annotations

import copy
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from ncgrpo.trainer import shared_loss
from tiny_models import MIXED_TEXTS, image_prompts, mixed_images, tiny_bundle

G = 4
TEXTS = MIXED_TEXTS  # prompts of different lengths (left padding); images: mixed_images
C = 7  # completion columns
TEMPERATURE = 0.7
LOGP_ATOL = 2e-5  # float32 rounding of log-probs ~ -6 (vocab 512)
GRAD_RTOL = 2e-5  # relative (norm) difference of each parameter's gradient


def repeated(model, inputs, batch_size=None, compute_entropy=True):
    """TRL 1.16's own method (the path share_prompt_loss replaces)."""
    ns = SimpleNamespace(accelerator=SimpleNamespace(autocast=lambda: torch.autocast("cpu", enabled=False)))
    logps, ent, _ = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__(
        ns, model, inputs["input_ids"], inputs["attention_mask"], C, batch_size=batch_size,
        compute_entropy=compute_entropy, **inputs["mm"],
    )  # fmt: skip
    return logps, ent


def trl_rows(model, ids, am, c, compute_entropy, **mm):
    """TRL's method as shared_loss's ``repeated`` fallback (what the trainer passes)."""
    ns = SimpleNamespace(accelerator=SimpleNamespace(autocast=lambda: torch.autocast("cpu", enabled=False)))
    fn = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__
    return fn(ns, model, ids, am, c, compute_entropy=compute_entropy, **mm)[:2]


def shared(model, inputs, batch_size=None, compute_entropy=True, stats=None, pack_rows=None, fallback=False):
    return shared_loss.per_token_logps_and_entropies(
        model, inputs["input_ids"], inputs["attention_mask"], C, batch_size=batch_size,
        compute_entropy=compute_entropy, stats=stats, pack_rows=pack_rows,
        repeated=trl_rows if fallback else None, **inputs["mm"],
    )  # fmt: skip


def make_inputs(kind, proc, vocab, *, perm=None, seed=0):
    """TRL's loss inputs: ``prompt | completion`` rows, prompts repeated G times and left-padded (mixed
    lengths), completions right-padded after a random length (>= 1), in ``perm`` order."""
    tok = getattr(proc, "tokenizer", proc)
    tok.padding_side = "left"
    if kind.endswith("_vl"):
        msgs = image_prompts(proc, TEXTS)
        enc = dict(proc(text=msgs, images=mixed_images(), padding=True, return_tensors="pt"))
    else:
        enc = dict(tok(TEXTS, padding=True, return_tensors="pt"))
    assert (enc["attention_mask"] == 0).any(), "the prompts must need left padding"
    g = torch.Generator().manual_seed(seed)
    rows = [p for p in range(len(TEXTS)) for _ in range(G)]
    if perm is not None:
        rows = [rows[i] for i in perm]
    n = len(rows)
    comp = torch.randint(10, vocab, (n, C), generator=g)
    lengths = torch.randint(1, C + 1, (n,), generator=g)
    lengths[0] = C
    cmask = (torch.arange(C)[None] < lengths[:, None]).long()
    comp = comp.masked_fill(cmask == 0, tok.pad_token_id)
    r = torch.tensor(rows)
    input_ids = torch.cat([enc["input_ids"][r], comp], 1)
    attention_mask = torch.cat([enc["attention_mask"][r], cmask], 1)
    mm = {}
    if kind.endswith("_vl"):
        per_img = enc["image_grid_thw"].prod(-1)
        cum = [0, *per_img.cumsum(0).tolist()]
        mm["pixel_values"] = torch.cat([enc["pixel_values"][cum[p] : cum[p + 1]] for p in rows])
        mm["image_grid_thw"] = enc["image_grid_thw"][r]
        mm["num_images"] = [1] * n
        mm["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"][r], torch.zeros_like(comp)], 1)
    adv = torch.randn(n, generator=g)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "mm": mm, "adv": adv, "cmask": cmask}


def loss_of(logps, ent, inputs):
    """A GRPO-shaped scalar: advantage-weighted log-probs plus an entropy term, over the completion mask."""
    m = inputs["cmask"].float()
    return -((inputs["adv"][:, None] * logps + 0.01 * ent) * m).sum() / m.sum()


def grads(model, fn, inputs, **kw):
    model.zero_grad(set_to_none=True)
    logps, ent = fn(model, inputs, **kw)
    loss = loss_of(logps, ent, inputs)
    loss.backward()
    g = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), ent.detach(), loss.detach(), g


def assert_same(a, b):
    la, ea, lossa, ga = a
    lb, eb, lossb, gb = b
    torch.testing.assert_close(lb, la, rtol=0, atol=LOGP_ATOL)
    torch.testing.assert_close(eb, ea, rtol=0, atol=LOGP_ATOL)
    torch.testing.assert_close(lossb, lossa, rtol=0, atol=LOGP_ATOL)
    assert sorted(ga) == sorted(gb)
    for k in ga:
        rel = float((ga[k] - gb[k]).norm() / ga[k].norm().clamp_min(1e-12))
        assert rel < GRAD_RTOL, f"{k}: relative gradient difference {rel:.2e}"


def _bundle(kind, attn="sdpa"):
    model, proc = tiny_bundle(kind, attn_implementation=attn)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model.train(), proc


@pytest.fixture(scope="module", params=["qwen2", "qwen2_5_vl", "qwen3_vl"])
def bundle(request):
    model, proc = _bundle(request.param)
    return request.param, model, proc


def _vision_patches(model):
    seen = []
    visual = getattr(getattr(model, "model", None), "visual", None)
    handle = visual.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0])) if visual else None
    return seen, handle


def test_shared_loss_equals_the_repeated_path(bundle):
    kind, model, proc = bundle
    inputs = make_inputs(kind, proc, model.config.get_text_config().vocab_size)
    seen, handle = _vision_patches(model)
    try:
        a = grads(model, repeated, inputs)
        repeated_patches, _ = sum(seen), seen.clear()
        stats = {}
        b = grads(model, shared, inputs, stats=stats)
        shared_patches = sum(seen)
    finally:
        if handle is not None:
            handle.remove()
    assert_same(a, b)
    # the prompt really ran once per set: 3 sets, P - 1 + sum(k_i + 1) tokens, vision once per prompt
    assert (stats["rows"], stats["sets"], stats["packs"]) == (len(TEXTS) * G, len(TEXTS), len(TEXTS))
    assert stats["tokens"] < inputs["input_ids"].numel()
    if handle is not None:
        assert repeated_patches == G * shared_patches > 0
    # a zero log-prob where the completion mask is 0, as in TRL
    assert (b[0][inputs["cmask"] == 0] == 0).all()


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5_vl"])
def test_split_and_shuffled_micro_batches(kind):
    """Micro-batches of 5 rows cut groups (and rows shuffled, as with steps_per_generation > 1): each
    micro-batch shares what it holds and the result is still the repeated path's."""
    model, proc = _bundle(kind)
    perm = torch.randperm(len(TEXTS) * G, generator=torch.Generator().manual_seed(3)).tolist()
    inputs = make_inputs(kind, proc, model.config.get_text_config().vocab_size, perm=perm, seed=1)
    a = grads(model, repeated, inputs, batch_size=5)
    stats = {}
    b = grads(model, shared, inputs, batch_size=5, stats=stats)
    assert_same(a, b)
    assert stats["rows"] == len(TEXTS) * G and len(TEXTS) < stats["sets"] < len(TEXTS) * G
    # with TRL's method as the fallback, rows alone in their micro-batch go through it: still exact
    stats = {}
    b = grads(model, partial(shared, fallback=True), inputs, batch_size=5, stats=stats)
    assert_same(a, b)
    assert stats["solo"] > 0 and stats["packs"] > 0


def test_packs_of_a_few_rows():
    """A set split into packs of 3 rows (as the cost model does for long completions) is exact too."""
    model, proc = _bundle("qwen2_5_vl")
    inputs = make_inputs("qwen2_5_vl", proc, model.config.get_text_config().vocab_size, seed=5)
    a = grads(model, repeated, inputs)
    stats = {}
    b = grads(model, partial(shared, pack_rows=3), inputs, stats=stats)
    assert_same(a, b)
    assert (stats["sets"], stats["packs"]) == (len(TEXTS), 2 * len(TEXTS))
    stats = {}  # one row per pack, TRL's method for each: the repeated path itself
    b = grads(model, partial(shared, pack_rows=1, fallback=True), inputs, stats=stats)
    assert_same(a, b)
    assert (stats["packs"], stats["solo"]) == (0, len(TEXTS) * G)


def test_the_cost_model_splits_only_long_completions():
    costs = shared_loss.pack_costs(tiny_bundle("qwen2")[0].config)  # hidden 32: attention is relatively dear
    rows = list(range(8))
    assert len(shared_loss.split_set(rows, 20, [7] * 8, costs)) == 1  # short completions: one pack
    long = shared_loss.split_set(rows, 20, [400] * 8, costs)
    assert 1 < len(long) <= 8 and sorted(r for p in long for r in p) == rows
    assert shared_loss.split_set(rows, 20, [7] * 8, costs, pack_rows=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_eager_attention_and_gradient_checkpointing():
    """Eager attention gets a float mask; under gradient checkpointing (layers recomputed in the backward)
    the cache-free packed forward gives the same gradients as the repeated path without checkpointing."""
    model, proc = _bundle("qwen2", attn="eager")
    inputs = make_inputs("qwen2", proc, model.config.vocab_size, seed=2)
    a = grads(model, repeated, inputs)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        assert model.model.gradient_checkpointing
        b = grads(model, shared, inputs)
    finally:
        model.activation_checkpointing_disable()
    assert_same(a, b)


def test_vl_gradient_checkpointing():
    model, proc = _bundle("qwen2_5_vl")
    inputs = make_inputs("qwen2_5_vl", proc, model.config.get_text_config().vocab_size, seed=4)
    a = grads(model, repeated, inputs)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        b = grads(model, shared, inputs, batch_size=6)
    finally:
        model.activation_checkpointing_disable()
    assert_same(a, b)


def test_a_wrong_mask_is_caught():
    """The comparison can fail: letting block i see block i-1 (no block mask) changes the log-probs."""
    model, proc = _bundle("qwen2")
    inputs = make_inputs("qwen2", proc, model.config.vocab_size)
    a = repeated(model, inputs)[0].detach()
    with torch.no_grad():
        b = shared(model, inputs)[0]
        torch.testing.assert_close(b, a, rtol=0, atol=LOGP_ATOL)
        ids, am = inputs["input_ids"], inputs["attention_mask"]
        # a plain causal mask over a packed set shows what the block mask prevents
        P = ids.shape[1] - C
        r0, r1 = 0, 1
        keep0 = am[r0].bool()
        seq = torch.cat([ids[r0][keep0], ids[r1, P - 1 :]])
        logits = model(input_ids=seq[None], use_cache=False).logits[0]
        lp = torch.log_softmax(logits[-C - 1 : -1] / TEMPERATURE, -1).gather(-1, ids[r1, P:, None])[:, 0]
        m = am[r1, P:].bool()
        assert (lp[m] - a[r1][m]).abs().max() > 1e-3


def test_refuses_what_it_cannot_share_exactly():
    model, _ = tiny_bundle("qwen2", attn_implementation="sdpa")
    shared_loss.check_supported(model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        shared_loss.check_supported(model)
    model, _ = tiny_bundle("qwen2", layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                           sliding_window=4)  # fmt: skip
    with pytest.raises(ValueError, match="sliding-window"):
        shared_loss.check_supported(model)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        shared_loss.check_supported(tiny_bundle("qwen2")[0], aux_loss=True)


def _tiny_grpo():
    import importlib.util
    import sys
    from pathlib import Path

    if "tiny_grpo" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "tiny_grpo", Path(__file__).parents[1] / "scripts" / "tiny_grpo.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["tiny_grpo"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["tiny_grpo"]


def test_trainer_steps_equal_with_share_prompt_loss_on_and_off(tmp_path, monkeypatch):
    """Two NCGRPOTrainer steps (tiny Qwen2.5-VL with images, gradient checkpointing as TRL's default, a
    reference model with beta > 0, steps_per_generation = 2 so the old-log-prob pass runs and the
    micro-batches are shuffled): the same losses, grad norms and weights with share_prompt_loss on and
    off, and the shared path really ran, with fewer tokens than the rows hold."""
    tiny = _tiny_grpo()
    calls = []
    real = shared_loss.per_token_logps_and_entropies

    def spy(*args, **kw):
        kw["stats"] = st = {}
        out = real(*args, **kw)
        calls.append(st)
        return out

    monkeypatch.setattr(shared_loss, "per_token_logps_and_entropies", spy)
    kw = dict(rollout_method="latent", max_steps=2, per_device_train_batch_size=8, steps_per_generation=2,
              beta=0.04, temperature=0.9, optim="sgd", learning_rate=0.1)  # fmt: skip
    from ncgrpo.toy.model import save_tiny
    from ncgrpo.trainer import NCGRPOTrainer

    path = save_tiny(tiny.model(), tiny.processor(), tmp_path / "model")  # a path: TRL loads the reference
    runs = {}
    for on in (False, True):
        tr = NCGRPOTrainer(
            model=str(path), reward_funcs=[tiny.hash_reward], args=tiny.config(tmp_path / str(on),
            share_prompt_loss=on, **kw), train_dataset=tiny.dataset(8), processing_class=tiny.processor(),
        )  # fmt: skip
        assert tr.args.gradient_checkpointing and tr.ref_model is not None
        tr.train()
        hist = [h for h in tr.state.log_history if "loss" in h]
        runs[on] = (hist, {k: v.detach().clone() for k, v in tr.model.named_parameters()})
    (ha, pa), (hb, pb) = runs[False], runs[True]
    assert len(ha) == len(hb) == 2 and "reward" in ha[0]
    for a, b in zip(ha, hb, strict=True):
        assert a.get("reward") == b.get("reward")  # same rollouts (logged on the generating step)
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6), (a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])
        assert math.isclose(a["kl"], b["kl"], rel_tol=1e-3, abs_tol=1e-7)
        assert math.isclose(a["entropy"], b["entropy"], rel_tol=1e-5)
    # SGD (Adam would divide a ~0 gradient element by its own ~0 scale and blow its rounding up to ~lr)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=0, atol=1e-6)
    # old-log-prob, reference and loss passes all went through the shared path, each sharing prompts
    assert len(calls) >= 4 and all(c["sets"] < c["rows"] for c in calls)


def test_config_field_is_checked():
    from ncgrpo.trainer import NCGRPOConfig

    with pytest.raises(ValueError, match="share_prompt_loss must be true or false"):
        NCGRPOConfig(output_dir="unused", use_cpu=True, share_prompt_loss="yes")


def test_the_trainer_refuses_at_start_up(tmp_path):
    """share_prompt_loss with an attention implementation that takes no 4-D mask: a ValueError naming the
    setting before any step, not a silent fallback."""
    from ncgrpo.trainer import NCGRPOTrainer

    tiny = _tiny_grpo()
    model = tiny.model()
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'.*share_prompt_loss=False"):
        NCGRPOTrainer(
            model=model, reward_funcs=[tiny.hash_reward], args=tiny.config(tmp_path, share_prompt_loss=True),
            train_dataset=tiny.dataset(4), processing_class=tiny.processor(),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# bf16: the shared path's error against float32 is TRL's own (issue 42; benchmarks/bench_loss_bf16.py)
# ---------------------------------------------------------------------------------------------------
BF16_K = 1.5  # the shared path's bf16 error may be at most this times TRL's own (measured: ~0.8-1.2x)


def _bf16_errors(ref, got):
    """Max |log-prob| and |entropy| error and the global relative gradient error of ``got`` vs ``ref``."""
    (lr, er, _, gr), (lg, eg, _, gg) = ref, got
    assert sorted(gr) == sorted(gg)
    num = sum(float((gg[k].float() - gr[k]).pow(2).sum()) for k in gr)
    den = sum(float(gr[k].pow(2).sum()) for k in gr)
    return {
        "logp": float((lg.float() - lr).abs().max()),
        "ent": float((eg.float() - er).abs().max()),
        "grad": (num / den) ** 0.5,
    }


def _bf16_case(kind):
    model32, proc = _bundle(kind)
    inputs = make_inputs(kind, proc, model32.get_input_embeddings().num_embeddings)
    ref = grads(model32, repeated, inputs)
    model = copy.deepcopy(model32).to(torch.bfloat16)  # the recipes' dtype: bfloat16
    mm = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v)
          for k, v in inputs["mm"].items()}  # fmt: skip
    x = {**inputs, "mm": mm}
    ac = partial(torch.autocast, "cpu", dtype=torch.bfloat16)  # TRL's bf16=True: accelerator.autocast()

    def trl(model, inputs, batch_size=None, compute_entropy=True):
        ns = SimpleNamespace(accelerator=SimpleNamespace(autocast=ac))
        fn = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__
        return fn(ns, model, inputs["input_ids"], inputs["attention_mask"], C, batch_size=batch_size,
                  compute_entropy=compute_entropy, **inputs["mm"])[:2]  # fmt: skip

    def packed(model, inputs):
        return shared_loss.per_token_logps_and_entropies(
            model, inputs["input_ids"], inputs["attention_mask"], C, compute_entropy=True, autocast=ac,
            **inputs["mm"],
        )  # fmt: skip

    return ref, model, x, trl, packed


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5_vl"])
def test_bf16_error_against_float32_is_trls_own(kind):
    """In bf16 (weights and autocast, as the recipes train), the shared path's log-probs, entropies and
    gradients are no further from the float32 reference than BF16_K x TRL's own bf16 pass; TRL's pass
    in two micro-batches is there for scale."""
    ref, model, x, trl, packed = _bf16_case(kind)
    e_trl = _bf16_errors(ref, grads(model, trl, x))
    e_trl2 = _bf16_errors(ref, grads(model, trl, x, batch_size=len(x["input_ids"]) // 2))
    e_shared = _bf16_errors(ref, grads(model, packed, x))
    assert e_trl["logp"] > 1e-4 and e_trl["grad"] > 1e-4, f"bf16 shows no rounding at all: {e_trl}"
    for k in e_trl:
        bound = BF16_K * max(e_trl[k], e_trl2[k])
        assert e_shared[k] <= bound, (
            f"{kind}: shared bf16 {k} error {e_shared[k]:.3g} > {bound:.3g} ({e_trl})"
        )


def test_bf16_comparison_catches_a_precision_fault(monkeypatch):
    """The bound above can fail: the packs' log-probs and entropies rounded to bf16 (a float32 -> bf16 cast
    in the pack; TRL's fused head returns them in float32) push the shared path's error past it."""
    ref, model, x, trl, packed = _bf16_case("qwen2")
    e_trl = _bf16_errors(ref, grads(model, trl, x))
    real = shared_loss._packed_forward

    def rounded(*a, **kw):
        out = real(*a, **kw)
        out.log_probs = out.log_probs.to(torch.bfloat16).float()
        out.entropy = out.entropy.to(torch.bfloat16).float()
        return out

    monkeypatch.setattr(shared_loss, "_packed_forward", rounded)
    e_bad = _bf16_errors(ref, grads(model, packed, x))
    assert e_bad["logp"] > BF16_K * e_trl["logp"], (e_bad, e_trl)
