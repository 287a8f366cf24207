"""The embedded base model: SFT warm-up (ncgrpo.toy.pretrain), its CLI, the committed checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from ncgrpo.data.prompts import render_prompt
from ncgrpo.toy import base_model, sft_data, vision_warmup
from ncgrpo.toy import pretrain as pt
from ncgrpo.toy.suite import build_suite
from ncgrpo.toy.traces import corpus, warmup_trace
from tiny_models import EOS_TOKEN, build_processor, build_tokenizer

# A miniature of the real recipe: small suite, small pool, the "micro" model.
SMALL = dict(
    size="micro",
    suite_sizes={"train": 16, "validation": 4, "test": 4},
    pool={"geometry": 24, "counting": 4, "pope": 4},
    batch_size=8,
    vision_warmup_steps=3,
    focus_families=("pope",),
    focus_steps=2,
    final_steps=1,
)


def _weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain") / "a"
    report = pt.pretrain(out, seed=3, steps=5, run_eval=True, eval_limit=2, group_size=2, **SMALL)
    return out, report


# ------------------------------------------------------------------------------------------ pool


def test_sft_pool_is_disjoint_from_the_suite_and_deterministic():
    suite = build_suite(0, {"train": 30, "validation": 8, "test": 8})
    hashes = {q.metadata["hash"] for qs in suite.values() for q in qs}
    counts = {"geometry": 12, "compare": 6, "pope": 6}
    a = sft_data.sft_pool(0, counts, exclude=hashes)
    b = sft_data.sft_pool(0, counts, exclude=hashes)
    assert [q.metadata["hash"] for q in a] == [q.metadata["hash"] for q in b]
    assert {q.metadata["family"] for q in a} == set(counts)
    assert len(a) == sum(counts.values())
    assert not hashes & {q.metadata["hash"] for q in a}
    assert len({q.metadata["hash"] for q in a}) == len(a)
    # A hash in `exclude` is never drawn: excluding the first item of a pool skips exactly that item.
    c = sft_data.sft_pool(0, {"geometry": 3}, exclude={a[0].metadata["hash"]})
    assert a[0].metadata["hash"] not in {q.metadata["hash"] for q in c}


def test_sft_pool_rejects_unknown_families_and_negative_counts():
    with pytest.raises(ValueError, match="unknown families.*'geometri'"):
        sft_data.sft_pool(0, {"geometri": 3})
    with pytest.raises(ValueError, match="'pope' must be >= 0"):
        sft_data.sft_pool(0, {"pope": -1})


def test_encode_example_masks_the_prompt_and_uses_the_generation_prompt():
    suite = build_suite(0, {"train": 4, "validation": 2, "test": 2})
    proc = build_processor(build_tokenizer(corpus(suite), vocab_size=512), image_size=84)
    q = suite["validation"][0]
    ex = sft_data.encode_example(proc, q)
    prompt = render_prompt(proc, q)
    enc = proc(text=[prompt], images=[q.images], return_tensors="pt")
    # The prompt part is exactly what generation feeds the model (image pads expanded).
    assert torch.equal(ex.input_ids[: ex.prompt_len], enc["input_ids"][0])
    assert torch.equal(ex.pixel_values, enc["pixel_values"])
    tok = proc.tokenizer
    assert tok.decode(ex.input_ids[ex.prompt_len :]) == warmup_trace(q) + EOS_TOKEN  # its opening

    batch = sft_data.collate([ex, sft_data.encode_example(proc, suite["validation"][1])], tok.pad_token_id)
    labels, ids, mask = batch["labels"], batch["input_ids"], batch["attention_mask"]
    assert labels.shape == ids.shape == mask.shape
    row = labels[0]
    assert (row[: ex.prompt_len] == -100).all()
    n = int(ex.input_ids.shape[0])
    assert torch.equal(row[ex.prompt_len : n], ex.input_ids[ex.prompt_len :])
    assert (row[n:] == -100).all() and (mask[0, n:] == 0).all()
    assert batch["image_grid_thw"].shape == (2, 3)
    # 84 px images: a 6 x 6 patch grid merged 2 x 2 -> 9 image tokens per row, marked for M-RoPE.
    assert batch["mm_token_type_ids"].sum(dim=1).tolist() == [9, 9]


def test_sft_forward_sees_the_positions_generation_uses():
    """Training must use Qwen2.5-VL's 3-D M-RoPE positions, as ``generate`` does with the processor's
    output; dropping ``mm_token_type_ids`` silently falls back to 1-D positions (a real bug we hit)."""
    from tiny_models import tiny_qwen2_5_vl

    suite = build_suite(0, {"train": 4, "validation": 2, "test": 2})
    proc = build_processor(build_tokenizer(corpus(suite), vocab_size=512), image_size=84)
    model = tiny_qwen2_5_vl(
        processor=proc, seed=0, **{k: v for k, v in pt.SIZES["micro"].items() if k != "vocab_size"}
    )
    q = suite["validation"][0]
    ex = sft_data.encode_example(proc, q)
    batch = sft_data.collate([ex], proc.tokenizer.pad_token_id)
    gen_inputs = proc(text=[render_prompt(proc, q)], images=[q.images], return_tensors="pt")
    with torch.no_grad():
        train_logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # (1, L, V)
        gen_logits = model(**gen_inputs).logits  # (1, prompt_len, V)
        flat = {k: v for k, v in batch.items() if k not in ("labels", "mm_token_type_ids")}
        flat_logits = model(**flat).logits
    last = ex.prompt_len - 1
    torch.testing.assert_close(train_logits[0, last], gen_logits[0, last], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(flat_logits[0, last], gen_logits[0, last], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------- training


def test_same_seed_gives_identical_weights(small_run, tmp_path):
    out_a, _ = small_run
    out_b = tmp_path / "b"
    pt.pretrain(out_b, seed=3, steps=5, run_eval=False, **SMALL)
    wa, wb = _weights(out_a), _weights(out_b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # ... and a different seed gives different weights.
    out_c = tmp_path / "c"
    pt.pretrain(out_c, seed=4, steps=5, run_eval=False, **SMALL)
    wc = _weights(out_c)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_saved_folder_loads_and_generates(small_run):
    from ncgrpo.eval.evaluate import DecodingSettings, generate_greedy
    from ncgrpo.models import load_model_and_processor

    out, report = small_run
    model, proc = load_model_and_processor(out, dtype="float32", device="cpu")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.config.text_config.hidden_size == pt.SIZES["micro"]["hidden_size"]
    assert len(proc.tokenizer) == report.dims["vocab_size"]
    assert type(proc).__name__ == "PaddleOCRVLProcessor"  # as the committed base (no ncgrpo import needed)
    qs = build_suite(0, SMALL["suite_sizes"])["validation"][:2]
    outs = generate_greedy(model, proc, qs, DecodingSettings(max_new_tokens=6, batch_size=2))
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)


def test_pretrain_json_records_the_run(small_run):
    out, report = small_run
    data = json.loads((out / pt.PRETRAIN_FILE).read_text())
    assert data["seed"] == 3 and data["steps"] == 5 and data["size"] == "micro"
    assert (data["focus_families"], data["focus_steps"], data["final_steps"]) == (["pope"], 2, 1)
    assert data["late_lr"] == pt.DEFAULT_LATE_LR
    assert len(data["losses"]) == 5 + 2 + 1 and all(x > 0 for x in data["losses"])
    assert data["pool"] == SMALL["pool"]
    assert data["dims"]["hidden_size"] == pt.SIZES["micro"]["hidden_size"]
    from ncgrpo import __version__

    assert data["ncgrpo_version"] == __version__
    assert data["parameters"]["total"] == sum(p.numel() for p in _weights(out).values())
    # eval_limit=2: two validation questions per family, every family evaluated.
    assert data["eval_questions"] == {f: 2 for f in data["accuracy"]}
    assert len(data["accuracy"]) == 6 and all(0 <= v <= 1 for v in data["accuracy"].values())
    assert set(data["mixed_share"]) == {"geometry"} and data["group_size"] == 2
    assert len(data["eval_correct"]) == 12
    lo, hi = data["target_band"]
    assert data["in_band"] == (lo <= data["accuracy"]["geometry"] <= hi)
    assert data["checkpoint_bytes"] > 0 and data["wall_time_s"] >= data["train_time_s"] > 0
    assert pt.PretrainReport.load(out).to_dict() == report.to_dict()


def test_loss_decreases(tmp_path):
    r = pt.pretrain(tmp_path / "m", seed=0, steps=24, lr=3e-3, warmup=4, run_eval=False, **SMALL)
    first, last = sum(r.losses[:4]) / 4, sum(r.losses[-4:]) / 4
    assert last < 0.7 * first, r.losses


def test_focused_phase_draws_only_its_families_then_the_mix_resumes(tmp_path, monkeypatch):
    """The schedule: ``steps`` mixed steps at ``lr`` (after its warm-up), ``focus_steps`` on the focus
    families' items at ``late_lr``, ``final_steps`` mixed at ``late_lr``."""
    seen: list[tuple[list[str], float]] = []
    real_collate, real_step = sft_data.collate, pt._sft_step
    batches: list[list[str]] = []

    def collate(examples, pad_id):
        batches.append([e.family for e in examples])
        return real_collate(examples, pad_id)

    def step(model, opt, batch):
        seen.append((batches[-1], opt.param_groups[0]["lr"]))
        return real_step(model, opt, batch)

    monkeypatch.setattr(pt, "collate", collate)
    monkeypatch.setattr(pt, "_sft_step", step)
    kw = {**SMALL, "focus_steps": 5, "final_steps": 4, "vision_warmup_steps": 0}
    r = pt.pretrain(tmp_path / "m", seed=0, steps=6, lr=2e-3, warmup=2, late_lr=5e-4, run_eval=False, **kw)
    assert len(seen) == len(r.losses) == 6 + 5 + 4
    mixed, focus, final = seen[:6], seen[6:11], seen[11:]
    assert [lr for _, lr in mixed] == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3])
    assert all(fams == ["pope"] * len(fams) and lr == 5e-4 for fams, lr in focus)
    assert {f for fams, _ in focus for f in fams} == {"pope"}
    assert all(lr == 5e-4 for _, lr in final)
    for phase in (mixed, final):  # the mixed phases see the whole pool, geometry most of all
        assert {f for fams, _ in phase for f in fams} >= {"geometry"}
        assert any(len(set(fams)) > 1 for fams, _ in phase)


def test_the_mixed_phase_does_not_depend_on_what_follows(tmp_path):
    """The first ``steps`` steps of a run with later phases ARE ``pretrain(steps=...)`` without them
    (one run with ``on_step`` snapshots measures every mixed budget)."""
    snaps: dict[str, dict[int, dict[str, torch.Tensor]]] = {"long": {}, "short": {}}

    def run(name, **kw):
        def on_step(step, model, processor):
            snaps[name][step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

        pt.pretrain(tmp_path / name, seed=2, steps=4, run_eval=False, on_step=on_step, **{**SMALL, **kw})

    run("long")
    run("short", focus_steps=0, final_steps=0)
    long_, short = snaps["long"], snaps["short"]
    assert sorted(short) == [1, 2, 3, 4] and sorted(long_) == list(range(1, 4 + 2 + 1 + 1))
    assert all(torch.equal(short[4][k], long_[4][k]) for k in short[4])
    assert any(not torch.equal(short[4][k], long_[7][k]) for k in short[4] if "visual" not in k)


def test_vision_lr_scale_zero_freezes_the_vision_tower_during_sft(tmp_path):
    """The warm-up's colour-to-shape binding does not survive SFT with a trainable tower (measured:
    a probe reads the asked shape's colour 71% right after the warm-up, 22% after SFT at 0.3x the
    learning rate), so the default recipe freezes it: SFT then changes only the language model."""

    def run(name, steps, scale):
        pt.pretrain(tmp_path / name, seed=1, steps=steps, run_eval=False,
                    **{**SMALL, "vision_warmup_steps": 2, "vision_lr_scale": scale})  # fmt: skip
        return _weights(tmp_path / name)

    a, b, c = run("a", 1, 0.0), run("b", 4, 0.0), run("c", 4, 1.0)
    visual = [k for k in a if "visual" in k]
    assert visual and all(torch.equal(a[k], b[k]) for k in visual)
    assert any(not torch.equal(a[k], b[k]) for k in a if "visual" not in k)
    assert any(not torch.equal(b[k], c[k]) for k in visual)  # a trainable tower does move


def test_pretrain_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        pt.pretrain(tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="steps must be >= 1"):
        pt.pretrain(tmp_path / "x", steps=0)
    small = {**SMALL, "suite_sizes": {"train": 2, "validation": 1, "test": 1}, "pool": {"geometry": 2}}
    with pytest.raises(ValueError, match="vision_warmup_steps must be >= 0"):
        pt.pretrain(tmp_path / "x", steps=1, run_eval=False, **{**small, "vision_warmup_steps": -1})
    with pytest.raises(ValueError, match=r"vision_lr_scale must be >= 0 \(0 freezes the vision tower\)"):
        pt.pretrain(tmp_path / "x", steps=1, run_eval=False, vision_lr_scale=-0.5, **small)
    with pytest.raises(ValueError, match=r"focus families \['pope'\] have no items in the SFT pool"):
        pt.pretrain(tmp_path / "x", steps=1, run_eval=False, **small)
    with pytest.raises(ValueError, match="focus_steps and final_steps must be >= 0"):
        pt.pretrain(tmp_path / "x", steps=1, run_eval=False, **{**small, "final_steps": -1})
    assert not (tmp_path / "x").exists()  # refused before any work


# -------------------------------------------------------------------------------- vision warm-up


def test_scene_targets_read_every_family_off_the_spec():
    from ncgrpo.toy.synthetic import BAR_MAX, COLOURS, SHAPES

    layout = vision_warmup._target_layout()
    colours, shapes = list(COLOURS), list(SHAPES)
    items = sft_data.sft_pool(
        0, {"geometry": 40, "counting": 10, "bar_chart": 10, "compare": 10, "colour_choice": 10, "pope": 10}
    )
    seen_corners = set()
    for q in items:
        spec = q.metadata["spec"]
        scene, kind = spec["scene"], spec["ask"]["kind"]
        t, m = vision_warmup.scene_targets(spec)

        def part(name, t=t):
            a, b = layout[name]
            return t[a:b]

        applies = {name for name, (a, b) in layout.items() if bool(m[a:b].all())}
        assert all(not m[a:b].any() for name, (a, b) in layout.items() if name not in applies)
        if scene["type"] == "figure":
            assert applies == {"corners", "labels"}
            assert int(part("corners").argmax()) == len(scene["vertices"]) - 3 and part("corners").sum() == 1
            seen_corners.add(len(scene["vertices"]))
            written = {vision_warmup.LABEL_VALUES[j] for j in part("labels").nonzero().flatten().tolist()}
            assert written == {lab["text"] for lab in scene["labels"]}
            if kind in ("sides", "angle_sum"):
                assert not written
        elif scene["type"] == "objects":
            assert applies == (
                {"objects", "counts", "left_bigger"} if kind == "compare" else {"objects", "counts"}
            )
            present = {(colours[j // 3], shapes[j % 3]) for j in part("objects").nonzero().flatten().tolist()}
            assert present == {(ob["colour"], ob["shape"]) for ob in scene["objects"]}
            counts = part("counts").view(len(shapes), -1)
            assert counts.sum(1).tolist() == [1.0] * len(shapes)
            for k, shape in enumerate(shapes):
                assert int(counts[k].argmax()) == sum(ob["shape"] == shape for ob in scene["objects"])
            if kind == "compare":
                left, right = sorted(scene["objects"], key=lambda ob: ob["x"])
                assert bool(part("left_bigger")[0]) == (left["r"] > right["r"])
        else:
            assert applies == {"bar_heights", "bar_colours"}
            bars = sorted(scene["bars"], key=lambda b: b["x0"])
            heights = part("bar_heights").view(4, BAR_MAX).argmax(1) + 1
            assert heights.tolist() == [b["height"] for b in bars]
            assert [colours[j] for j in part("bar_colours").view(4, -1).argmax(1).tolist()] == [
                b["colour"] for b in bars
            ]
    assert seen_corners == {3, 4, 5, 6}
    with pytest.raises(ValueError, match="no vision targets for scene type 'pie'"):
        vision_warmup.scene_targets({"scene": {"type": "pie"}, "ask": {}})


def test_vision_warmup_draws_fresh_scenes_outside_the_suite():
    suite = build_suite(0, {"train": 4, "validation": 2, "test": 30})
    hashes = pt._suite_hashes(suite)
    stream = vision_warmup._scene_stream(0, "compare", hashes)
    drawn = [next(stream) for _ in range(50)]
    from ncgrpo.toy.suite import content_hash

    keys = [content_hash("compare", it.problem, it.spec) for it in drawn]
    assert not set(keys) & hashes and len(set(keys)) == 50  # fresh, and never a suite item
    assert all(it.image is not None for it in drawn)
    again = vision_warmup._scene_stream(0, "compare", hashes)
    assert [content_hash("compare", it.problem, it.spec) for it in (next(again) for _ in range(50))] == keys
    # the stream really skips excluded items: exclude its own first draw
    first = next(vision_warmup._scene_stream(0, "compare", {keys[0]}))
    assert content_hash("compare", first.problem, first.spec) == keys[1]


def test_vision_warmup_trains_only_the_vision_tower_and_lowers_its_loss():
    suite = build_suite(0, {"train": 4, "validation": 2, "test": 2})
    proc = build_processor(build_tokenizer(corpus(suite), vocab_size=512), image_size=84)
    from tiny_models import tiny_qwen2_5_vl

    dims = dict(pt.SIZES["micro"])
    dims.pop("vocab_size")
    model = tiny_qwen2_5_vl(processor=proc, seed=0, **dims)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(123)
    losses = vision_warmup._vision_warmup(model, proc, steps=30, lr=3e-3, batch_size=14, seed=0)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("model.visual.") for n in changed), sorted(changed)
    assert any("merger" in n for n in changed) and any("patch_embed" in n for n in changed)
    assert vision_warmup._vision_warmup(model, proc, steps=0, lr=1e-3, batch_size=8, seed=0) == []


# ------------------------------------------------------------------------------ ensure_base_model


def test_ensure_base_model_builds_once_into_the_cache(tmp_path, monkeypatch):
    calls = []
    real = functools.partial(pt.pretrain, steps=2, run_eval=False, **SMALL)

    def fake_pretrain(out, **kw):
        calls.append(out)
        return real(out, **kw)

    monkeypatch.setattr(base_model, "pretrain", fake_pretrain)
    results: list = []
    threads = [
        threading.Thread(
            target=lambda: results.append(base_model.ensure_base_model(tmp_path, use_asset=False))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1  # the second caller waited on the lock and found the finished build
    assert results[0] == results[1] and results[0].parent == tmp_path
    assert results[0].name.startswith("base-") and base_model._is_complete(results[0])
    assert not list(tmp_path.glob(".base-build-*"))  # the temporary folder was renamed away
    assert base_model.ensure_base_model(tmp_path, use_asset=False) == results[0] and len(calls) == 1


# ----------------------------------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    from ncgrpo.cli import main

    return main(["pretrain", *argv])


def test_cli_trains_saves_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = _cli(["--output_dir", str(out), "--size", "micro", "--max_steps", "2", "--pool", "geometry=8", "pope=4",
               "--eval-limit", "1", "--group-size", "2", "--vision-warmup-steps", "2",
               "--focus-families", "pope", "--focus-steps", "2", "--final-steps", "1", "--late-lr", "2e-3",
               "--no-progress"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "geometry" in text and "mixed groups" in text and "pope" in text
    data = json.loads((out / pt.PRETRAIN_FILE).read_text())
    assert data["steps"] == 2 and data["pool"] == {"geometry": 8, "pope": 4}
    assert data["vision_warmup_steps"] == 2 and len(data["vision_losses"]) == 2
    assert data["vision_lr_scale"] == pt.DEFAULT_VISION_LR_SCALE
    assert (data["focus_families"], data["focus_steps"], data["final_steps"], data["late_lr"]) == (
        ["pope"], 2, 1, 2e-3)  # fmt: skip
    assert len(data["losses"]) == 2 + 2 + 1
    # a non-empty --output_dir is refused, and so are a malformed --pool and bad values, as `ncgrpo pretrain: error:`
    capsys.readouterr()
    assert _cli(["--output_dir", str(out), "--size", "micro", "--max_steps", "1"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--pool", "geometry:3"]) == 2
    assert "pool: expected FAMILY=N, got 'geometry:3'" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--vision-warmup-steps", "-1"]) == 2
    assert "ncgrpo pretrain: error: vision_warmup_steps must be >= 0" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--vision-lr-scale", "-1"]) == 2
    assert "ncgrpo pretrain: error: vision_lr_scale must be >= 0" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--pool", "geometry=3"]) == 2
    assert "focus families ['colour_choice', 'pope'] have no items in the SFT pool" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--focus-families", "colour"]) == 2
    assert "focus_families: unknown ['colour']" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--final-steps", "-2"]) == 2
    assert "final_steps must be >= 0 (0 skips that phase)" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--late-lr", "0"]) == 2
    assert "late_lr must be > 0" in capsys.readouterr().err
    assert _cli(["--output_dir", str(tmp_path / "new"), "--size", "huge"]) == 2
    assert "argument --size: invalid choice: 'huge'" in capsys.readouterr().err
    assert _cli(["--size", "micro"]) == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err
    # the same settings from a config file, a flag overriding it
    conf = tmp_path / "pretrain.yaml"
    conf.write_text(f"out: {tmp_path / 'new'}\npool: [geometry=3]\nsteps: 5\nfocus_steps: 0\n")
    from ncgrpo.commands.parser import ConfigParser

    (cfg,) = ConfigParser([base_model.PretrainConfig]).parse_args_and_config(
        ["--config", str(conf), "--steps", "7"]
    )
    assert (cfg.output_dir, cfg.pool_counts(), cfg.max_steps) == (tmp_path / "new", {"geometry": 3}, 7)


# ------------------------------------------------------------------------ committed checkpoint

committed = pytest.mark.skipif(
    not base_model._is_complete(pt.ASSET_DIR), reason="no committed base checkpoint"
)


@committed
def test_committed_checkpoint_matches_the_recipe_and_the_band():
    report = pt.PretrainReport.load(pt.ASSET_DIR)
    assert report.size == "tiny" and report.steps == pt.DEFAULT_STEPS and report.pool == pt.DEFAULT_POOL
    assert report.vision_warmup_steps == pt.DEFAULT_VISION_WARMUP
    assert report.vision_lr_scale == pt.DEFAULT_VISION_LR_SCALE
    assert tuple(report.focus_families) == pt.DEFAULT_FOCUS_FAMILIES
    assert (report.focus_steps, report.final_steps, report.late_lr) == (
        pt.DEFAULT_FOCUS_STEPS, pt.DEFAULT_FINAL_STEPS, pt.DEFAULT_LATE_LR)  # fmt: skip
    assert len(report.losses) == pt.DEFAULT_STEPS + pt.DEFAULT_FOCUS_STEPS + pt.DEFAULT_FINAL_STEPS
    assert len(report.vision_losses) == pt.DEFAULT_VISION_WARMUP
    # The BPE trainer stops when the corpus runs out of merges, so the vocabulary may be smaller
    # than asked; every other dimension is the recipe's.
    wanted = dict(pt.SIZES["tiny"])
    assert report.dims.pop("vocab_size") <= wanted.pop("vocab_size")
    assert report.dims == wanted
    lo, hi = pt.TARGET_BAND
    assert lo <= report.accuracy["geometry"] <= hi and report.in_band
    assert report.mixed_share["geometry"] >= pt.MIXED_GROUP_TARGET and report.mixed_ok
    assert base_model.ensure_base_model() == pt.ASSET_DIR
    size = sum(f.stat().st_size for f in pt.ASSET_DIR.rglob("*") if f.is_file())
    assert size <= 10 * 2**20
    cfg = json.loads((pt.ASSET_DIR / "config.json").read_text())
    dims = pt.SIZES["tiny"]
    assert cfg["text_config"]["hidden_size"] == dims["hidden_size"]
    assert cfg["text_config"]["num_hidden_layers"] == dims["num_hidden_layers"]
    assert cfg["vision_config"]["depth"] == dims["vision_depth"]
    assert cfg["text_config"]["vocab_size"] == pt.PretrainReport.load(pt.ASSET_DIR).dims["vocab_size"]


@committed
def test_committed_checkpoint_reproduces_its_recorded_greedy_answers():
    """The first 16 in-domain validation questions, in one batch as pretrain evaluated them."""
    from ncgrpo.eval.evaluate import DecodingSettings, generate_greedy
    from ncgrpo.models import load_model_and_processor
    from ncgrpo.rewards import score

    report = pt.PretrainReport.load(pt.ASSET_DIR)
    model, proc = load_model_and_processor(pt.ASSET_DIR, dtype="float32", device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(report.num_threads)  # the thread count pretrain evaluated with
    suite = build_suite(report.suite_seed)
    geo = [q for q in suite["validation"] if q.metadata["family"] == "geometry"][:16]
    try:
        outs = generate_greedy(model, proc, geo, DecodingSettings(max_new_tokens=64, batch_size=16))
    finally:
        torch.set_num_threads(threads)
    got = {
        q.uid: score(o, q.answer, answer_type=q.answer_type).correct for q, o in zip(geo, outs, strict=True)
    }
    want = {q.uid: report.eval_correct[q.uid] for q in geo}
    assert got == want


@committed
def test_committed_checkpoint_reads_the_image():
    """The failure the vision warm-up fixes: a base model whose loss does not care which image it sees.

    On held-out in-domain questions, the teacher-forced loss of the correct derivations must rise
    when the batch's images are shuffled across questions (same question text, another figure), and
    greedy answers opened with a derivation (``<think>the``; the unprompted greedy answer is the
    image-blind shortcut, ncgrpo.toy.traces.shortcut_trace) must be right more often with the real
    figures (measured on the shipped checkpoint: loss 0.364 vs 0.373, +2.6%; 14 vs 9 of 64 right)."""
    from ncgrpo.models import load_model_and_processor
    from ncgrpo.toy.traces import reasoning_trace
    from ncgrpo.trainer.prefix import with_branch_prefix

    report = pt.PretrainReport.load(pt.ASSET_DIR)
    model, proc = load_model_and_processor(pt.ASSET_DIR, dtype="float32", device="cpu")
    suite = build_suite(report.suite_seed)
    geo = [q for q in suite["validation"] if q.metadata["family"] == "geometry"][:32]
    examples = [sft_data.encode_example(proc, q, reasoning_trace(q, i)) for i, q in enumerate(geo)]
    batch = sft_data.collate(examples, proc.tokenizer.pad_token_id)
    per_image = batch["pixel_values"].shape[0] // len(geo)  # same grid for every image
    shuffled = dict(batch)
    perm = torch.roll(torch.arange(len(geo)), 1)  # every question gets its neighbour's image
    shuffled["pixel_values"] = batch["pixel_values"].view(len(geo), per_image, -1)[perm].flatten(0, 1)
    with torch.no_grad():
        real = float(model(**batch).loss)
        other = float(model(**shuffled).loss)
    assert other > real * 1.02, (real, other)
    from ncgrpo.eval.evaluate import DecodingSettings, generate_greedy
    from ncgrpo.rewards import score

    geo64 = [q for q in suite["validation"] if q.metadata["family"] == "geometry"][:64]
    swapped = [dataclasses.replace(q, images=geo64[(i + 1) % 64].images) for i, q in enumerate(geo64)]
    derive = with_branch_prefix(proc, "<think>the")

    def right(qs):
        outs = generate_greedy(model, derive, qs, DecodingSettings(max_new_tokens=64, batch_size=64))
        return sum(
            score(o, q.answer, answer_type=q.answer_type).correct for q, o in zip(qs, outs, strict=True)
        )

    assert right(geo64) > right(swapped), (right(geo64), right(swapped))
