"""Geometry3K loader (real and synthetic rows), chat messages and the TRL dataset form."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from PIL import Image

from ncgrpo.data.benchmarks import BenchmarkDataError
from ncgrpo.data.geometry3k import load_geometry3k, to_trl_dataset
from ncgrpo.data.prompts import build_messages, prompt_hash
from ncgrpo.data.types import MATH_PROMPT, Question

FIXTURES = Path(__file__).parent / "fixtures"


def _img(seed: int = 0) -> Image.Image:
    return Image.new("RGB", (32, 32), (seed, 0, 0))


def _q(problem: str, n_images: int) -> Question:
    return Question(
        benchmark="t", question_id="q", problem=problem, answer="1", images=[_img(k) for k in range(n_images)]
    )


# ---------------------------------------------------------------------------------------- loading


def test_geo3k_rows_follow_noisyrollout():
    qs = load_geometry3k(FIXTURES / "geo3k", "test")
    assert [q.question_id for q in qs] == ["2", "17", "40", "41"]
    q = qs[1]
    assert q.benchmark == "geo3k" and q.role == "in_domain"
    assert q.problem == "<image>Find the area of the figure. Round to the nearest tenth if necessary."
    assert (q.answer, q.answer_type, q.choices) == ("56.5", "number", None)  # free-form, gold = choice text
    assert q.metadata["choices"] == ["28.3", "42.4", "56.5", "113.1"] and q.metadata["ground_truth"] == "C"
    assert q.metadata["split"] == "test"
    assert len(load_geometry3k(FIXTURES / "geo3k", "train")) == 2


def test_synthetic_columns_are_used():
    qs = load_geometry3k(FIXTURES / "synthetic", "test")
    got = [(q.benchmark, q.role, q.answer_type, q.answer, q.choices, len(q.images)) for q in qs]
    assert got == [
        ("synthetic/angles", "in_domain", "number", "40", None, 1),
        ("synthetic/counting", "ood", "choice", "C", ["2", "3", "4", "5"], 1),
        ("synthetic/compare", "ood", "yesno", "yes", None, 2),
    ]


def _rewrite(tmp_path: Path, **changes) -> Path:
    ds = datasets.Dataset.from_parquet(str(FIXTURES / "synthetic" / "data" / "test-00000-of-00001.parquet"))
    for column, (row, value) in changes.items():
        ds = ds.map(lambda r, i, c=column, k=row, v=value: {c: v if i == k else r[c]}, with_indices=True)
    out = tmp_path / "data" / "test-00000-of-00001.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(out))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"problem": (0, "<image><image>Two marks, one image")},
            r"row 0: field 'problem' has 2 '<image>' placeholders but field 'images' has 1",
        ),
        ({"role": (1, "train")}, r"row 1: field 'role' should be one of"),
        ({"answer_type": (0, "numeric")}, r"row 0: field 'answer_type' should be one of"),
        ({"choices": (1, [])}, r"row 1: field 'choices' is empty but answer_type is 'choice'"),
        ({"answer": (2, "maybe")}, r"row 2: field 'answer' should be 'yes' or 'no'"),
        ({"images": (1, [])}, r"row 1: field 'images' is empty"),
    ],
)
def test_malformed_geo3k_rows(tmp_path, changes, message):
    folder = _rewrite(tmp_path, **changes)
    with pytest.raises(BenchmarkDataError, match=message) as info:
        load_geometry3k(folder, "test")
    assert str(folder / "data" / "test-00000-of-00001.parquet") in str(info.value)


# --------------------------------------------------------------------------------------- messages


def test_messages_without_images():
    (msg,) = build_messages(_q("What is 2 + 2?", 0))
    assert msg == {"role": "user", "content": [{"type": "text", "text": f"What is 2 + 2? {MATH_PROMPT}"}]}


def test_one_image_placeholder_at_start():
    (msg,) = build_messages(_q("<image>Find x.", 1))
    assert msg["content"] == [{"type": "image"}, {"type": "text", "text": f"Find x. {MATH_PROMPT}"}]


def test_images_without_placeholder_come_first():
    (msg,) = build_messages(_q("Compare the figures.", 2))
    assert msg["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert msg["content"][2]["text"].startswith("Compare the figures.")


def test_two_placeholders_keep_their_positions():
    (msg,) = build_messages(_q("Left: <image> right: <image> which is bigger?", 2), math_prompt="")
    assert msg["content"] == [
        {"type": "text", "text": "Left: "},
        {"type": "image"},
        {"type": "text", "text": " right: "},
        {"type": "image"},
        {"type": "text", "text": " which is bigger?"},
    ]


def test_placeholder_count_mismatch_raises():
    with pytest.raises(
        ValueError, match=r"t/q: problem has 2 '<image>' placeholder\(s\) but the question has 1"
    ):
        build_messages(_q("<image> and <image>", 1))


def test_system_prompt_is_a_text_part():
    msgs = build_messages(_q("<image>Find x.", 1), system_prompt="Be brief.", math_prompt="")
    assert msgs[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert msgs[1]["content"][-1] == {"type": "text", "text": "Find x."}


def test_prompt_hash_is_stable_and_sensitive():
    a = build_messages(_q("<image>Find x.", 1))
    assert prompt_hash(a) == prompt_hash(build_messages(_q("<image>Find x.", 1)))
    assert prompt_hash(a) != prompt_hash(build_messages(_q("<image>Find y.", 1)))
    assert len(prompt_hash(a)) == 16 and int(prompt_hash(a), 16) >= 0


# ---------------------------------------------------------------------------------------- TRL form


def test_trl_dataset_matches_grpo_trainer_expectations():
    from trl.data_utils import is_conversational, prepare_multimodal_messages

    questions = load_geometry3k(FIXTURES / "synthetic", "test")
    ds = to_trl_dataset(questions)
    assert set(ds.column_names) == {
        "prompt",
        "images",
        "answer",
        "choices",
        "answer_type",
        "question_id",
        "benchmark",
        "role",
    }
    assert ds["choices"] == [[], ["2", "3", "4", "5"], []]
    assert ds["benchmark"] == ["synthetic/angles", "synthetic/counting", "synthetic/compare"]
    for q, row in zip(questions, ds, strict=True):
        assert is_conversational(row)
        assert all(isinstance(im, Image.Image) for im in row["images"])
        # GRPOTrainer fills the {"type": "image"} parts from the `images` column; counts must agree
        filled = prepare_multimodal_messages(row["prompt"], images=row["images"])
        parts = filled[-1]["content"]
        assert [p["image"].size for p in parts if p["type"] == "image"] == [im.size for im in q.images]
        # a prompt hashes the same before and after the Arrow round trip
        assert prompt_hash(row["prompt"]) == prompt_hash(build_messages(q))


def test_trl_dataset_with_system_prompt():
    ds = to_trl_dataset(
        load_geometry3k(FIXTURES / "geo3k", "train"), system_prompt=MATH_PROMPT, math_prompt=""
    )
    prompt = ds[0]["prompt"]
    assert prompt[0]["role"] == "system" and prompt[0]["content"][0]["text"] == MATH_PROMPT
    assert prompt[1]["content"][1]["text"] == "Find x."
