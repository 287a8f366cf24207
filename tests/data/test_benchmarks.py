"""Benchmark loaders on tiny fixtures in each benchmark's hub schema (tests/data/fixtures/make_fixtures.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
from own_benchmark import write_own_benchmark
from PIL import Image
from published import PUBLISHED_ROWS

from ncgrpo.data.benchmarks import (
    BENCHMARKS,
    CHOICE_INSTRUCTION,
    YESNO_INSTRUCTION,
    BenchmarkDataError,
    RowContext,
    custom_benchmark,
    load_benchmark,
    parse_role,
)
from ncgrpo.data.benchmarks.rows import (
    gold_letter,
    infer_answer_type,
    split_inline_options,
    split_option_lines,
)

FIXTURES = Path(__file__).parent / "fixtures"

# name -> (rows in the default split, {question_id: (answer, answer_type, choices or None)} for some rows)
EXPECTED: dict[str, tuple[int, dict[str, tuple[str, str, list[str] | None]]]] = {
    "geo3k": (4, {"2": ("3", "number", None), "41": ("2\\sqrt{3}", "free", None)}),
    # default split "image_paper": NoisyRollout's ids set_figure_question (distinct in the fixture)
    "hallusionbench": (3, {"0_0_0": ("yes", "yesno", None), "0_1_0": ("no", "yesno", None)}),
    "mathvista": (
        4,
        {
            "1": ("B", "choice", ["True", "False"]),
            "2": ("1000", "number", None),
            "3": ("7.5", "number", None),
            "4": ("C", "choice", ["2", "4", "6", "8"]),
        },
    ),
    "mathverse": (
        3,
        {
            "1": ("D", "choice", ["40°", "60°", "120°", "140°"]),
            "5": ("D", "choice", None),
            "6": ("8", "number", None),
        },
    ),
    "mathvision": (
        3,
        {"1": ("60", "number", None), "3": ("C", "choice", ["10°", "20°", "30°", "40°", "50°"])},
    ),
    "wemath": (3, {"1@1step": ("B", "choice", ["3cm", "6cm", "9cm", "12cm", "No correct answer"])}),
    "pope": (3, {"adversarial_1": ("yes", "yesno", None), "adversarial_2": ("no", "yesno", None)}),
    "mmstar": (3, {"2": ("B", "choice", ["2", "3", "4", "5"])}),
    "ai2d": (3, {"0": ("B", "choice", ["c", "D", "b", "a"]), "2": ("B", "choice", ["4", "6", "8"])}),
    "realworldqa": (
        3,
        {
            "0": ("A", "choice", ["Left", "Right", "Straight ahead"]),
            "1": ("2", "number", None),
            "2": ("no", "yesno", None),
        },
    ),
    "chartqa": (
        4,
        {
            "0": ("14", "number", None),
            "1": ("yes", "yesno", None),
            "2": ("Germany", "free", None),
            "3": ("23%", "number", None),
        },
    ),
    # the gold is the number after "#### ", commas removed (GSM8K's own extract_answer)
    "gsm8k": (3, {"0": ("13", "number", None), "1": ("130000", "number", None), "2": ("-3", "number", None)}),
    "math500": (
        4,
        {
            "test/precalculus/807.json": ("\\left( 3, \\frac{\\pi}{2} \\right)", "free", None),
            "test/algebra/2584.json": ("\\frac{14}{3}", "free", None),
            "test/algebra/1.json": ("2", "number", None),
        },
    ),
}
#: Benchmarks whose questions have no image.
TEXT_ONLY = {"gsm8k", "math500"}

# name -> (row, field) of the defect make_fixtures.py planted in malformed/<name>.parquet
MALFORMED = {
    "geo3k": (1, "answer"),
    "hallusionbench": (0, "gt_answer"),
    "mathvista": (1, "decoded_image"),
    "mathverse": (2, "answer"),
    "mathvision": (0, "decoded_image"),
    "wemath": (0, "option"),
    "pope": (1, "answer"),
    "mmstar": (1, "image"),
    "ai2d": (0, "options"),
    "realworldqa": (2, "image"),
    "chartqa": (1, "label"),
    "gsm8k": (1, "answer"),
    "math500": (2, "answer"),
}


def test_every_benchmark_has_a_fixture_and_a_malformed_case():
    assert set(EXPECTED) == set(BENCHMARKS) == set(MALFORMED)
    assert {"geo3k", "hallusionbench", "mathvista", "mathverse", "mathvision", "wemath"} <= set(BENCHMARKS)


def test_registry_entries_are_consistent():
    roles = {name: spec.role for name, spec in BENCHMARKS.items()}
    assert roles["geo3k"] == "in_domain"
    assert {roles[n] for n in ("hallusionbench", "mathvista", "mathverse", "mathvision", "wemath")} == {"ood"}
    assert {roles[n] for n in ("pope", "mmstar", "ai2d", "realworldqa", "chartqa")} == {"general"}
    assert {roles[n] for n in ("gsm8k", "math500")} == {"ood"}  # text math, for a model trained on Geo3K
    assert [n for n, spec in BENCHMARKS.items() if not spec.in_paper] == ["gsm8k", "math500"]
    for name, spec in BENCHMARKS.items():
        assert spec.name == name
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", spec.hub_id), spec.hub_id
        assert spec.default_split in PUBLISHED_ROWS[name], name
        assert callable(spec.loader)
    assert PUBLISHED_ROWS["geo3k"] == {"train": 2101, "validation": 300, "test": 601}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_loader_reads_hub_layout(name):
    count, rows = EXPECTED[name]
    questions = load_benchmark(name, FIXTURES / name)
    assert len(questions) == count
    spec = BENCHMARKS[name]
    by_id = {q.question_id: q for q in questions}
    assert len(by_id) == count  # ids unique
    for qid, (answer, answer_type, choices) in rows.items():
        q = by_id[qid]
        assert (q.answer, q.answer_type, q.choices) == (answer, answer_type, choices), qid
    for q in questions:
        assert q.benchmark == name and q.role == spec.role
        if name in TEXT_ONLY:
            assert q.images == [] and spec.image_columns == ()
        else:
            assert q.images and all(isinstance(im, Image.Image) for im in q.images)
            assert q.images[0].size == (32, 32)
        assert q.problem.strip()
        marks = q.problem.count("<image>")
        assert marks in (0, len(q.images))
        if q.answer_type == "choice":
            assert re.fullmatch(r"[A-H]", q.answer)
            assert q.problem.endswith(CHOICE_INSTRUCTION)
            if q.choices is not None:
                assert ord(q.answer) - ord("A") < len(q.choices)
                listing = "\n".join(f"{chr(65 + k)}. {c}" for k, c in enumerate(q.choices))
                assert listing in q.problem
        elif q.answer_type == "yesno":
            assert q.answer in {"yes", "no"}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_row_names_path_row_and_field(name):
    row, field = MALFORMED[name]
    path = FIXTURES / "malformed" / f"{name}.parquet"
    with pytest.raises(BenchmarkDataError) as info:
        load_benchmark(name, path)
    message = str(info.value)
    assert str(path) in message
    assert f"row {row}:" in message
    assert f"field '{field}" in message


def test_malformed_synthetic_image_inside_images_list():
    path = FIXTURES / "malformed" / "synthetic.parquet"
    with pytest.raises(
        BenchmarkDataError, match=r"synthetic\.parquet row 2: field 'images\[0\]' is not a readable image"
    ):
        load_benchmark("geo3k", path)


def test_hallusionbench_prompt_matches_noisyrollout():
    q = load_benchmark("hallusionbench", FIXTURES / "hallusionbench")[2]
    # the text after the first '?' is dropped, then "? <suffix>" is appended
    assert q.problem == f"According to the chart, did sales grow in 2020? {YESNO_INSTRUCTION}"


def test_mathvision_image_mark_becomes_placeholder():
    qs = {q.question_id: q for q in load_benchmark("mathvision", FIXTURES / "mathvision")}
    assert qs["1"].problem == "Which number should be written in place of the question mark?\n<image>"
    assert qs["3"].problem.startswith("<image>\nThe angle x in the figure is\nA. 10°")
    assert "<image1>" not in qs["2"].problem


def test_mathvista_free_form_keeps_precision_hint():
    q = {q.question_id: q for q in load_benchmark("mathvista", FIXTURES / "mathvista")}["3"]
    assert "one decimal place" in q.problem
    assert q.metadata["precision"] == 1.0


def test_split_limit_and_single_file():
    assert len(load_benchmark("geo3k", FIXTURES / "geo3k", split="train")) == 2
    assert len(load_benchmark("geo3k", FIXTURES / "geo3k", limit=3)) == 3
    assert load_benchmark("geo3k", FIXTURES / "geo3k", limit=0) == []
    file = FIXTURES / "pope" / "data" / "test-00000-of-00003.parquet"
    assert [q.question_id for q in load_benchmark("pope", file)] == [
        "adversarial_1",
        "adversarial_2",
        "popular_1",
    ]


def test_missing_folder_and_split_say_what_is_expected(tmp_path):
    with pytest.raises(
        BenchmarkDataError, match=r"does not exist.*hiyouga/geometry3k.*data/test-00000-of-00001\.parquet"
    ):
        load_benchmark("geo3k", tmp_path / "nowhere")
    with pytest.raises(
        BenchmarkDataError, match=r"no 'validation' data under .*data/validation-00000-of-00001\.parquet"
    ):
        load_benchmark("geo3k", FIXTURES / "geo3k", split="validation")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchmarkDataError, match=r"mmstar: no 'val' data .*mmstar\.parquet.*found: nothing"):
        load_benchmark("mmstar", tmp_path / "empty")


def test_unknown_benchmark():
    with pytest.raises(KeyError, match="unknown benchmark 'nope'"):
        load_benchmark("nope")


def test_hub_failure_tells_to_pass_a_path(monkeypatch):
    seen = {}

    def fake_load_dataset(hub_id, config=None, *, split=None, **kwargs):
        seen["args"] = (hub_id, config, split)
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(
        BenchmarkDataError, match=r"could not load AI4Math/MathVerse.*--data_dir.*testmini\.parquet"
    ):
        load_benchmark("mathverse")
    assert seen["args"] == ("AI4Math/MathVerse", "testmini", "testmini")


def test_hub_dataset_rows_are_converted(monkeypatch):
    ds = datasets.Dataset.from_parquet(str(FIXTURES / "ai2d" / "data" / "test-00000-of-00001.parquet"))
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, config=None, *, split=None: ds)
    qs = load_benchmark("ai2d")
    assert [q.answer for q in qs] == ["B", "A", "B"]


def test_json_layout_with_image_files(tmp_path):
    """MathVerse as the hub also lays it out: testmini.json plus image files."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(tmp_path / "images" / "image_1.png")
    rows = [
        {
            "sample_index": "1",
            "question": "Find x.\nChoices:\nA:1\nB:2",
            "image": "image_1.png",
            "answer": "B",
            "question_type": "multi-choice",
        },
        {
            "sample_index": "2",
            "question": "Find y.",
            "image": "image_2.png",
            "answer": "3",
            "question_type": "free-form",
        },
    ]
    (tmp_path / "testmini.json").write_text(json.dumps(rows))
    with pytest.raises(
        BenchmarkDataError, match=r"testmini\.json row 1: field 'image': image file 'image_2\.png' not found"
    ):
        load_benchmark("mathverse", tmp_path)
    q = load_benchmark("mathverse", tmp_path, limit=1)[0]
    assert (q.answer, q.choices, q.images[0].size) == ("B", ["1", "2"], (8, 8))


def test_duplicate_question_ids_are_an_error(tmp_path):
    ds = datasets.Dataset.from_parquet(str(FIXTURES / "pope" / "data" / "test-00000-of-00003.parquet"))
    ds = ds.map(lambda r: {"question_id": "1", "category": "random"})
    ds.to_parquet(str(tmp_path / "dup.parquet"))
    with pytest.raises(BenchmarkDataError, match=r"dup\.parquet row 1: question_id 'random_1' repeats row 0"):
        load_benchmark("pope", tmp_path / "dup.parquet")


def test_gold_letter_out_of_choices_is_reported(tmp_path):
    ds = datasets.Dataset.from_parquet(str(FIXTURES / "mmstar" / "mmstar.parquet"))
    ds = ds.map(lambda r, i: {"answer": "F" if i == 2 else r["answer"]}, with_indices=True)
    ds.to_parquet(str(tmp_path / "mmstar.parquet"))
    with pytest.raises(BenchmarkDataError, match=r"row 2: field 'answer' \('F'\) is neither a letter A-D"):
        load_benchmark("mmstar", tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A: x, B: y, C: z", ["x", "y", "z"]),
        ("A. 3cm; B. 6cm; C. 9cm", ["3cm", "6cm", "9cm"]),
        ("A: The suitcase is on the book., B: A B: C", ["The suitcase is on the book.", "A B: C"]),
        ("no options here", None),
    ],
)
def test_split_inline_options(text, expected):
    assert split_inline_options(text) == expected


def test_split_option_lines():
    assert split_option_lines("Q?\nA. x\nB. y\nPlease answer.") == ("Q?", ["x", "y"], "Please answer.")
    assert split_option_lines("Q?\n(A) x\n(B) y") == ("Q?", ["x", "y"], "")
    assert split_option_lines("A. only one") is None


@pytest.mark.parametrize(
    ("answer", "expected"),
    [("24", "number"), ("1,000", "number"), ("23%", "number"), ("Yes", "yesno"), ("2\\pi", "free")],
)
def test_infer_answer_type(answer, expected):
    assert infer_answer_type(answer) == expected


def test_hallusionbench_json_release_with_filenames(tmp_path):
    """The GitHub release: HallusionBench.json whose `filename` points at images/<...>.png."""
    (tmp_path / "images" / "VD" / "illusion").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "VD" / "illusion" / "0_0.png")
    row = {
        "category": "VD",
        "subcategory": "illusion",
        "set_id": 0,
        "figure_id": 0,
        "question_id": 0,
        "question": "Is the left circle bigger?",
        "gt_answer": 0,
        "filename": "./VD/illusion/0_0.png",
    }
    no_image = {**row, "visual_input": "0", "filename": None, "question_id": 1}
    (tmp_path / "HallusionBench.json").write_text(json.dumps([{**row, "visual_input": "1"}, no_image]))
    (q,) = load_benchmark("hallusionbench", tmp_path / "HallusionBench.json", split="image")
    assert (q.question_id, q.answer, q.images[0].size) == ("VD_illusion_0_0_0", "no", (8, 8))


def test_hallusionbench_paper_split_keeps_the_last_row_of_each_noisyrollout_id(tmp_path):
    """The paper's n (10,038) counts HallusionBench by NoisyRollout's id set_figure_question,
    which repeats across categories: one question per id, the last row in file order."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    rows = [
        {"category": c, "subcategory": sub, "visual_input": "1", "set_id": 0, "figure_id": f,
         "question_id": 0, "question": f"Is {c} {sub} {f} right?", "gt_answer": g, "filename": "a.png"}
        for c, sub, f, g in [("VD", "illusion", 0, "1"), ("VS", "chart", 0, "0"), ("VD", "math", 1, "1")]
    ]  # fmt: skip
    (tmp_path / "HallusionBench.json").write_text(json.dumps(rows))
    qs = load_benchmark("hallusionbench", tmp_path / "HallusionBench.json")
    assert [(q.question_id, q.answer, q.metadata["category"]) for q in qs] == [
        ("0_0_0", "no", "VS"),
        ("0_1_0", "yes", "VD"),
    ]
    assert len(load_benchmark("hallusionbench", tmp_path / "HallusionBench.json", split="image")) == 3


def test_default_ood_splits_give_the_papers_count():
    ood = [spec for spec in BENCHMARKS.values() if spec.role == "ood" and spec.in_paper]
    assert sum(PUBLISHED_ROWS[spec.name][spec.default_split] for spec in ood) == 10038


def test_gold_letter_is_the_position_of_the_gold_option():
    """MathVista stores the option text; options can look like letters ("(c)" first), and the gold
    letter must be where the gold option is, not the letter its text spells (issue 13)."""
    ctx = RowContext(benchmark="mathvista", label="mathvista", split="testmini")
    options = ["(c)", "(a)", "(e)", "(b)"]
    assert gold_letter("(b)", options, ctx, 0, by="text") == "D"
    assert gold_letter("(c)", options, ctx, 0, by="text") == "A"
    # benchmarks that store a letter keep reading it as a letter
    assert gold_letter("B", ["x", "y"], ctx, 0) == "B"
    assert gold_letter("y", ["x", "y"], ctx, 0) == "B"


def test_mathverse_choice_block_spellings_and_two_answer_rows(tmp_path):
    """Real MathVerse rows write 'Choice:' as well as 'Choices:', store some golds as the option's
    text, and 'Choose 2 answers' rows store both letters ("C\\nD")."""
    img = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(img)
    base = {
        "problem_index": "1",
        "problem_version": "Text Lite",
        "image": "a.png",
        "question_type": "multi-choice",
    }
    rows = [
        {**base, "sample_index": "1", "question": "Bearing?\nChoice:\nA. 045 T\nB. 135 T", "answer": "045 T"},
        {**base, "sample_index": "2", "question": "Which?\nChoices:\nA:x\nB:y\nC:z", "answer": "A\nC"},
    ]
    (tmp_path / "testmini.json").write_text(json.dumps(rows))
    one, two = load_benchmark("mathverse", tmp_path / "testmini.json")
    assert (one.answer, one.answer_type, one.choices) == ("A", "choice", ["045 T", "135 T"])
    assert (two.answer, two.answer_type, two.choices) == ("A, C", "free", None)
    assert two.metadata["choices"] == ["x", "y", "z"]


def test_wemath_full_width_option_marks():
    assert split_inline_options("A. ④;B．⑤;C. ⑥; D. Unknown; E. None of these") == [
        "④",
        "⑤",
        "⑥",
        "Unknown",
        "None of these",
    ]


# --- a benchmark of one's own (issue 32, item 7) ----------------------------------------------------


def test_a_benchmark_of_ones_own_any_name_with_or_without_images(tmp_path: Path) -> None:
    path = write_own_benchmark(tmp_path / "mine")
    qs = load_benchmark("shapes_v2", path, role="ood")
    assert [(q.benchmark, q.question_id, q.role, len(q.images)) for q in qs] == [
        ("shapes_v2", "f0", "ood", 1),
        ("shapes_v2", "f1", "ood", 1),
        ("shapes_v2", "t0", "ood", 0),
        ("shapes_v2", "t1", "ood", 0),
    ]
    assert qs[1].problem == "What colour is it?" and qs[3].answer == "yes" and qs[3].answer_type == "yesno"
    assert qs[2].answer_type == "number" and qs[0].images[0].size == (12, 12)
    assert {q.role for q in load_benchmark("shapes_v2", path)} == {"in_domain"}  # the default role
    # a folder laid out by split works too, and the role of a built-in benchmark can be set
    (tmp_path / "by-split").mkdir()
    write_own_benchmark(tmp_path / "by-split", "test.jsonl")
    assert len(load_benchmark("shapes_v2", tmp_path / "by-split", limit=3)) == 3
    assert parse_role("in-domain") == "in_domain" and parse_role("OOD") == "ood"
    with pytest.raises(ValueError, match="not one of in-domain, ood, general"):
        parse_role("training")


def test_bad_own_benchmarks_name_the_problem(tmp_path: Path) -> None:
    path = write_own_benchmark(tmp_path / "mine")
    with pytest.raises(KeyError, match=r"unknown benchmark 'shapes'.*--data NAME=FILE.jsonl"):
        load_benchmark("shapes", None)
    with pytest.raises(ValueError, match="letters, digits"):
        load_benchmark("my shapes/v2", path)
    for taken in (
        "mathvista",
        "MathVista",
        "Geometry3K",
        "geo-3k",
        "hallusion",
        "synthetic",
    ):  # tables would relabel them
        with pytest.raises(ValueError, match="built-in benchmark's name"):
            custom_benchmark(taken)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"id": "x", "problem": "<image> and <image>?", "answer": "1", "image": "mine/fig0.png"})
        + "\n"
    )
    with pytest.raises(
        BenchmarkDataError, match=r"row 0: field 'problem' has 2 '<image>' placeholders but the row has 1"
    ):
        load_benchmark("shapes", bad)
    bad.write_text(json.dumps({"id": "x", "problem": "What?"}) + "\n")
    with pytest.raises(BenchmarkDataError, match=r"shapes .*bad.jsonl row 0: field 'answer' is missing"):
        load_benchmark("shapes", bad)


# --- GSM8K and MATH-500, text-only (issue 44) -------------------------------------------------------


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_gsm8k_gold_is_the_number_after_the_hashes(tmp_path):
    """GSM8K's own evaluation (grade-school-math's extract_answer): the number after '#### ', commas
    removed. Before, a GSM8K file passed as one's own benchmark took the whole solution as the gold."""
    from ncgrpo.data.benchmarks.converters import gsm8k_gold

    assert gsm8k_gold("She has 3 + 4 = <<3+4=7>>7.\n#### 7") == "7"
    assert gsm8k_gold("80,000 + 50,000\n#### 130,000") == "130000"
    assert gsm8k_gold("4 - 7 = -3\n#### -3") == "-3"
    assert gsm8k_gold("no final answer") is None
    # the GitHub layout (test.jsonl) read by load_benchmark: gold, solution kept, text-only, ood
    rows = [
        {"question": "Q1?", "answer": "1,000 apples.\n#### 1,000"},
        {"question": "Q2?", "answer": "18"},  # a copy that stores the number only
    ]
    qs = load_benchmark("gsm8k", _jsonl(tmp_path / "test.jsonl", rows))
    assert [(q.question_id, q.answer, q.answer_type, q.role, q.images) for q in qs] == [
        ("0", "1000", "number", "ood", []),
        ("1", "18", "number", "ood", []),
    ]
    assert qs[0].metadata["solution"] == "1,000 apples.\n#### 1,000" and qs[0].problem == "Q1?"
    assert load_benchmark("gsm8k", tmp_path, limit=1)[0].answer == "1000"  # the folder's test.jsonl
    # a TRL-style copy: the question in `prompt`
    trl = _jsonl(
        tmp_path / "trl.jsonl", [{"prompt": [{"role": "user", "content": "Q4?"}], "answer": "#### 4"}]
    )
    assert [(q.problem, q.answer) for q in load_benchmark("gsm8k", trl)] == [("Q4?", "4")]
    _jsonl(tmp_path / "bad.jsonl", [rows[0], {"question": "Q3?", "answer": "It is 5 apples."}])
    with pytest.raises(
        BenchmarkDataError, match=r"bad.jsonl row 1: field 'answer' has no final answer '#### N'"
    ):
        load_benchmark("gsm8k", tmp_path / "bad.jsonl")


def test_math500_both_layouts_give_the_same_questions(tmp_path):
    """MATH-500's canonical layout (problem/solution/answer/subject/level/unique_id) and the
    prompt/answer copy (the problem with an instruction line appended) give the same problem text and
    gold; the copy's instruction line is dropped (the run's --math_prompt asks for the box)."""
    from ncgrpo.data.benchmarks.converters import MATH500_PROMPT_SUFFIX

    canonical = load_benchmark("math500", FIXTURES / "math500")
    rows = [{"answer": q.answer, "prompt": f"{q.problem}\n{MATH500_PROMPT_SUFFIX}"} for q in canonical]
    copy = load_benchmark("math500", _jsonl(tmp_path / "math500.jsonl", rows))
    assert [(q.problem, q.answer, q.answer_type) for q in copy] == [
        (q.problem, q.answer, q.answer_type) for q in canonical
    ]
    assert [q.question_id for q in copy] == ["0", "1", "2", "3"]
    assert canonical[0].metadata["subject"] == "Precalculus" and canonical[0].metadata["level"] == 2
    assert copy[0].metadata["instruction"] == MATH500_PROMPT_SUFFIX
    assert load_benchmark("math500", tmp_path, limit=2)[1].answer == "\\frac{14}{3}"  # math500.jsonl


def test_own_benchmark_takes_trls_prompt_column(tmp_path):
    """TRL's datasets hold the question in ``prompt`` (text, or chat messages); ncgrpo eval --data
    mine=FILE read only ``problem``/``question`` before. Text prompts are taken as written, as ncgrpo train
    takes a data file (a system message included: tests/test_own_text_data.py); a prompt with image parts
    is one user turn whose images become placeholders."""
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "fig.png")
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": [{"role": "user", "content": "What is 4 + 4?"}], "answer": "8"},
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many sides?"}]}
            ],
            "images": ["fig.png"],
            "answer": "4",
        },
    ]
    qs = load_benchmark("mine", _jsonl(tmp_path / "mine.jsonl", rows))
    assert [(q.problem, q.answer, len(q.images)) for q in qs] == [
        ("What is 2 + 3?", "5", 0),
        ("What is 4 + 4?", "8", 0),
        ("<image>How many sides?", "4", 1),
    ]
    bad = {
        "a number": (
            7,
            r"row 0: field 'prompt' must be a string or a non-empty list of chat messages, got 7",
        ),
        "an image without its file": (
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]}],
            r"row 0: field 'prompt' has 1 '<image>' placeholders but the row has 0 image",
        ),
    }
    for what, (prompt, message) in bad.items():
        _jsonl(tmp_path / "bad.jsonl", [{"prompt": prompt, "answer": "1"}])
        with pytest.raises(BenchmarkDataError, match=message):
            load_benchmark("mine", tmp_path / "bad.jsonl")
        assert what
    _jsonl(tmp_path / "bad.jsonl", [{"text": "Q?", "answer": "1"}])
    with pytest.raises(BenchmarkDataError, match=r"row 0: field 'problem' is missing \(.*'prompt'\)"):
        load_benchmark("mine", tmp_path / "bad.jsonl")


def test_train_data_can_be_gsm8k_or_math500(tmp_path):
    """``ncgrpo train --dataset_name gsm8k|math500`` builds its TRL dataset with the benchmark's loader
    (text-only prompts, the benchmark's gold in ``answer``)."""
    from ncgrpo.commands.train_settings import ScriptArguments
    from ncgrpo.driver import build_datasets

    for name, path, answers in [
        ("gsm8k", FIXTURES / "gsm8k", ["13", "130000", "-3"]),
        ("math500", FIXTURES / "math500", ["\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{14}{3}"]),
    ]:
        args = ScriptArguments(dataset_name=name, dataset_path=str(path), dataset_train_split="test")
        train, evals = build_datasets(args, tmp_path, seed=0)
        assert evals is None and train["answer"][: len(answers)] == answers
        assert set(train["benchmark"]) == {name} and all(images == [] for images in train["images"])
        user = train[0]["prompt"][-1]
        assert user["role"] == "user" and [p["type"] for p in user["content"]] == ["text"]
    with pytest.raises(BenchmarkDataError, match=r"no 'train' data"):
        build_datasets(
            ScriptArguments(dataset_name="math500", dataset_path=str(FIXTURES / "math500")), tmp_path
        )
