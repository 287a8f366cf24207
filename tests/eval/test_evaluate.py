"""The evaluation protocol: greedy records, resumability, kill -9 safety (issue: Evaluation, part 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ncgrpo.data.prompts import build_messages
from ncgrpo.eval.evaluate import DecodingSettings, evaluate, model_id_of
from ncgrpo.eval.records import read_records
from ncgrpo.models import load_model_and_processor
from ncgrpo.runs.folder import RECORDS_FILE
from ncgrpo.toy.suite import build_suite, export_geo3k
from tiny_models import save_tiny_vl


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> Path:
    return save_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    suite = build_suite(seed=0, sizes={"train": 2, "validation": 1, "test": 4})
    export_geo3k(suite, out)
    return out


def _questions(suite_dir: Path):
    from ncgrpo.eval.questions import load_questions

    return load_questions(["synthetic"], {"synthetic": suite_dir}, "test", None)


def test_evaluate_writes_one_record_per_question_and_resumes(tiny_vl_dir, suite_dir, tmp_path) -> None:
    model, proc = load_model_and_processor(tiny_vl_dir, device="cpu")
    qs = _questions(suite_dir)
    settings = DecodingSettings(max_new_tokens=6, batch_size=3)
    mid = model_id_of(tiny_vl_dir)
    s1 = evaluate(model, proc, qs[:5], tmp_path, model_id=mid, settings=settings, progress=False, seed=3)
    assert s1.newly_recorded == 5
    s2 = evaluate(model, proc, qs, tmp_path, model_id=mid, settings=settings, progress=False, seed=3)
    assert s2.newly_recorded == len(qs) - 5
    recs = read_records(tmp_path / RECORDS_FILE)
    assert sorted(r.key for r in recs) == sorted((q.benchmark, q.question_id) for q in qs)
    lines = (tmp_path / RECORDS_FILE).read_text().splitlines()
    assert len(lines) == len(qs)  # no duplicates on disk either
    r = recs[0]
    assert r.decoding["do_sample"] is False and r.decoding["max_new_tokens"] == 6
    assert r.seed == 3 and r.model == mid and r.prompt_hash
    # correctness is the shared scorer's verdict on the recorded output
    from ncgrpo.rewards import score

    by_key = {(q.benchmark, q.question_id): q for q in qs}
    for rec in recs:
        q = by_key[rec.key]
        assert (
            rec.correct == score(rec.output, q.answer, choices=q.choices, answer_type=q.answer_type).correct
        )
    assert set(s2.accuracy) == {q.benchmark for q in qs}


def test_greedy_records_do_not_depend_on_batch_size(tiny_vl_dir, suite_dir, tmp_path) -> None:
    model, proc = load_model_and_processor(tiny_vl_dir, device="cpu")
    qs = _questions(suite_dir)[:4]
    mid = model_id_of(tiny_vl_dir)
    evaluate(
        model,
        proc,
        qs,
        tmp_path / "b1",
        model_id=mid,
        settings=DecodingSettings(max_new_tokens=6, batch_size=1),
        progress=False,
    )
    evaluate(
        model,
        proc,
        qs,
        tmp_path / "b4",
        model_id=mid,
        settings=DecodingSettings(max_new_tokens=6, batch_size=4),
        progress=False,
    )
    a = {r.key: r.output for r in read_records(tmp_path / "b1" / RECORDS_FILE)}
    b = {r.key: r.output for r in read_records(tmp_path / "b4" / RECORDS_FILE)}
    assert a == b


def test_records_of_another_model_are_refused(tiny_vl_dir, suite_dir, tmp_path) -> None:
    model, proc = load_model_and_processor(tiny_vl_dir, device="cpu")
    qs = _questions(suite_dir)[:1]
    evaluate(
        model, proc, qs, tmp_path, model_id="a", settings=DecodingSettings(max_new_tokens=2), progress=False
    )
    with pytest.raises(ValueError, match="model"):
        evaluate(
            model,
            proc,
            qs,
            tmp_path,
            model_id="b",
            settings=DecodingSettings(max_new_tokens=2),
            progress=False,
        )


def test_torn_last_line_is_repaired_and_recomputed(tiny_vl_dir, suite_dir, tmp_path) -> None:
    model, proc = load_model_and_processor(tiny_vl_dir, device="cpu")
    qs = _questions(suite_dir)[:3]
    settings = DecodingSettings(max_new_tokens=4, batch_size=1)
    evaluate(model, proc, qs[:2], tmp_path, model_id="m", settings=settings, progress=False)
    path = tmp_path / RECORDS_FILE
    with open(path, "a") as f:
        f.write('{"benchmark": "synthetic/x", "question_id": "tor')  # a write cut by a crash
    evaluate(model, proc, qs, tmp_path, model_id="m", settings=settings, progress=False)
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert all(json.loads(line) for line in lines)


def _cli(model: Path, data: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ncgrpo",
        "eval",
        "--model_name_or_path",
        str(model),
        "--benchmarks",
        "synthetic",
        "--data",
        f"synthetic={data}",
        "--split",
        "test",
        "--output_dir",
        str(out),
        "--batch-size",
        "1",
        "--max-new-tokens",
        "24",
        "--no-progress",
        "--device",
        "cpu",
    ]


def test_kill_9_during_eval_then_rerun_loses_and_duplicates_nothing(tiny_vl_dir, suite_dir, tmp_path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        _cli(tiny_vl_dir, suite_dir, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    records = out / RECORDS_FILE
    deadline = time.time() + 120
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        if records.exists() and len(records.read_bytes().splitlines()) >= 3:
            proc.send_signal(signal.SIGKILL)
            killed_at = len(records.read_bytes().splitlines())
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert killed_at is not None, (
        f"eval finished or failed before it could be killed: {proc.stderr.read()[-2000:]}"
    )
    n_total = len(_questions(suite_dir))
    assert killed_at < n_total
    done = subprocess.run(
        _cli(tiny_vl_dir, suite_dir, out), env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    raw = [json.loads(line) for line in records.read_text().splitlines()]
    keys = [(r["benchmark"], r["question_id"]) for r in raw]
    assert len(keys) == len(set(keys)) == n_total


def test_vllm_prompts_are_the_transformers_engines_prompts(tiny_vl_dir, suite_dir) -> None:
    """``--engine vllm``'s requests, built without vLLM: a vision-language model gets the rendered chat
    text the transformers engine feeds its processor plus each question's images (RGB) as
    ``multi_modal_data``; a text model gets the token ids transformers' ``generate`` is fed."""
    from ncgrpo.eval.vllm_engine import vllm_prompts
    from ncgrpo.models import load_processor
    from tiny_models import build_tokenizer

    qs = _questions(suite_dir)[:3]
    settings = DecodingSettings(system_prompt="be brief")
    proc = load_processor(tiny_vl_dir)
    got = vllm_prompts(proc, qs, settings, vision_language=True)
    for q, p in zip(qs, got, strict=True):
        msgs = build_messages(q, system_prompt="be brief", math_prompt=settings.math_prompt)
        assert p["prompt"] == proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        images = p["multi_modal_data"]["image"]
        assert len(images) == len(q.images) >= 1 and all(im.mode == "RGB" for im in images)
        assert [im.size for im in images] == [im.size for im in q.images]
        assert p["prompt"].count("<|image_pad|>") == len(q.images)  # one placeholder each: vLLM expands it
    with pytest.raises(ValueError, match="text-only"):
        vllm_prompts(build_tokenizer(), qs, settings, vision_language=False)
    from ncgrpo.data.types import Question

    text_q = [Question("b", "1", "What is 2+2?", "4"), Question("b", "2", "Name a colour.", "red")]
    tok = build_tokenizer()
    ids = [p["prompt_token_ids"] for p in vllm_prompts(tok, text_q, settings, vision_language=False)]
    for q, i in zip(text_q, ids, strict=True):
        msgs = build_messages(q, system_prompt="be brief", math_prompt=settings.math_prompt)
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert i == tok(text, add_special_tokens=False)["input_ids"] and len(i) > 5


def test_vllm_engine_refuses_a_generation_setting_it_does_not_carry_over() -> None:
    """A generation_config.json setting that changes greedy outputs in ``generate`` and that the vLLM
    engine does not mirror is refused (before the engine starts), never silently dropped."""
    from transformers import GenerationConfig

    from ncgrpo.eval.vllm_engine import check_generation_config

    check_generation_config(GenerationConfig(eos_token_id=[2, 0], repetition_penalty=1.05))  # carried over
    for setting in ({"no_repeat_ngram_size": 3}, {"min_new_tokens": 4}, {"suppress_tokens": [5]}):
        with pytest.raises(ValueError, match=f"sets {next(iter(setting))}=.*--engine transformers"):
            check_generation_config(GenerationConfig(**setting))
