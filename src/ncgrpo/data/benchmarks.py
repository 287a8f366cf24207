"""Loaders for the paper's evaluation benchmarks (and the registry that names them).

Every loader turns the rows of one public dataset, in the layout its hub repository uses, into
:class:`~ncgrpo.data.types.Question` objects in one convention (docs/benchmarks-data.md):

- multiple choice: ``choices`` holds the options in order, ``answer`` the gold letter,
  ``answer_type="choice"``, and ``problem`` lists the options as ``"A. ...\\nB. ..."`` followed by
  :data:`CHOICE_INSTRUCTION` (asks for the letter in ``\\boxed{}``);
- yes/no: ``answer`` is ``"yes"`` or ``"no"``, ``answer_type="yesno"``;
- numeric: ``answer_type="number"``; anything else ``"free"``.

Sources: ``path`` is a local folder laid out as on the hub (``data/test-00000-of-00001.parquet``,
``<split>.parquet``, ...) or one file (parquet, json, jsonl); with ``path=None`` the rows come from the
``datasets`` cache through ``datasets.load_dataset(hub_id, ...)``, which works offline only when the
dataset is cached. A missing file or a malformed row raises :class:`BenchmarkDataError` naming the
file, the row index and the field (``"geo3k test.parquet row 17: field 'answer' is empty"``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from ncgrpo.data.prompts import IMAGE_PLACEHOLDER
from ncgrpo.data.types import LETTERS, AnswerType, Question, Role

__all__ = [
    "BENCHMARKS",
    "CHOICE_INSTRUCTION",
    "YESNO_INSTRUCTION",
    "BenchmarkDataError",
    "BenchmarkSpec",
    "ROLE_NAMES",
    "RowContext",
    "custom_benchmark",
    "format_choice_problem",
    "load_benchmark",
    "parse_role",
]

#: Appended to every multiple-choice problem after its option list.
CHOICE_INSTRUCTION = "Answer with the letter of the correct option in \\boxed{}."
#: NoisyRollout's HallusionBench suffix (eval/utils/data_loaders.py), typo included so prompts match
#: theirs token for token; POPE uses the same suffix.
YESNO_INSTRUCTION = "You final answer can only be \\boxed{yes} or \\boxed{no}."

_ROLES = set(get_args(Role))
_ANSWER_TYPES = set(get_args(AnswerType))
_PARQUET = (".parquet",)
_JSON = (".json", ".jsonl")


class BenchmarkDataError(ValueError):
    """A benchmark file is missing or one of its rows is malformed (message names file, row, field)."""


# --------------------------------------------------------------------------------------------------
# Row access with errors that name the place
# --------------------------------------------------------------------------------------------------


@dataclass
class RowContext:
    """Where rows come from: used to word errors and to resolve relative image paths."""

    benchmark: str
    label: str  # e.g. "geo3k test.parquet" or "geo3k hub:hiyouga/geometry3k[test]"
    split: str
    base_dir: Path | None = None  # folder that relative image paths are resolved against

    def error(self, index: int, message: str) -> BenchmarkDataError:
        return BenchmarkDataError(f"{self.label} row {index}: {message}")

    def field(self, row: dict[str, Any], index: int, name: str, *, allow_empty: bool = False) -> Any:
        """``row[name]``, or an error naming the row and the field when it is missing or empty."""
        if name not in row:
            raise self.error(index, f"field '{name}' is missing")
        value = row[name]
        if not allow_empty and _is_empty(value):
            raise self.error(index, f"field '{name}' is empty")
        return value

    def text(self, row: dict[str, Any], index: int, name: str) -> str:
        value = self.field(row, index, name)
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise self.error(index, f"field '{name}' should be text, got {type(value).__name__}")
        return str(value).strip()

    def optional(self, row: dict[str, Any], name: str, default: Any = None) -> Any:
        value = row.get(name)
        return default if _is_empty(value) else value

    def image(self, row: dict[str, Any], index: int, name: str) -> Any:
        return decode_image(self.field(row, index, name), self, index, name)

    def images(self, row: dict[str, Any], index: int, name: str) -> list[Any]:
        value = self.field(row, index, name)
        if not isinstance(value, list | tuple):
            raise self.error(index, f"field '{name}' should be a list of images, got {type(value).__name__}")
        return [decode_image(v, self, index, f"{name}[{k}]") for k, v in enumerate(value)]


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list | tuple | dict):
        return len(value) == 0
    try:  # NaN from pandas-written files
        return value != value
    except Exception:  # pragma: no cover - exotic types
        return False


def decode_image(value: Any, ctx: RowContext, index: int, name: str) -> Any:
    """Open one stored image as a (lazily decoded) PIL image, or raise an error naming the field.

    Accepts what the hub layouts hold: a PIL image, the ``{"bytes", "path"}`` struct of a
    ``datasets.Image`` column read without decoding, or a path relative to the data folder (json
    layouts). The file is verified (header and, for PNG, checksums) and reopened lazily, so a loaded
    benchmark holds compressed bytes rather than pixels.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value
    if _is_empty(value):
        raise ctx.error(index, f"field '{name}' is empty")
    data: bytes | None = None
    source = ""
    if isinstance(value, dict):
        if value.get("bytes"):
            data = bytes(value["bytes"])
        elif value.get("path"):
            value = value["path"]
        else:
            raise ctx.error(index, f"field '{name}' has neither image bytes nor a path")
    if data is None:
        if isinstance(value, bytes | bytearray):
            data = bytes(value)
        elif isinstance(value, str):
            file = _resolve_image_path(value, ctx)
            if file is None:
                raise ctx.error(index, f"field '{name}': image file '{value}' not found")
            source = f" ({file})"
            data = file.read_bytes()
        else:
            raise ctx.error(index, f"field '{name}' is not an image (got {type(value).__name__})")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        reason = str(exc).split(" <_io.")[0].strip() or type(exc).__name__
        raise ctx.error(index, f"field '{name}' is not a readable image{source} ({reason})") from None
    return image


def _resolve_image_path(value: str, ctx: RowContext) -> Path | None:
    candidate = Path(value)
    if candidate.is_absolute():
        return candidate if candidate.is_file() else None
    if ctx.base_dir is None:
        return None
    rel = value[2:] if value.startswith("./") else value
    for root in (ctx.base_dir, ctx.base_dir / "images", ctx.base_dir.parent):
        if (root / rel).is_file():
            return root / rel
    return None


# --------------------------------------------------------------------------------------------------
# Answer conventions
# --------------------------------------------------------------------------------------------------


def format_choice_problem(stem: str, choices: Sequence[str]) -> str:
    """``stem`` followed by ``"A. ...\\nB. ..."`` and :data:`CHOICE_INSTRUCTION`."""
    options = "\n".join(f"{LETTERS[i]}. {str(c).strip()}" for i, c in enumerate(choices))
    return f"{stem.rstrip()}\n{options}\n{CHOICE_INSTRUCTION}"


def _is_number(text: str) -> bool:
    cleaned = text.strip().replace(",", "").rstrip("%").strip()
    try:
        float(cleaned)
    except ValueError:
        return False
    return True


def infer_answer_type(answer: str) -> AnswerType:
    """``"yesno"`` for yes/no, ``"number"`` for a plain number (commas and ``%`` allowed), else ``"free"``."""
    if answer.strip().lower() in {"yes", "no"}:
        return "yesno"
    return "number" if _is_number(answer) else "free"


def gold_letter(
    answer: Any,
    choices: Sequence[str],
    ctx: RowContext,
    index: int,
    name: str = "answer",
    *,
    by: str = "letter",
) -> str:
    """The gold letter for ``answer``, always the POSITION of the gold option in ``choices``.

    ``by="letter"`` (benchmarks that store a letter: MathVision, MathVerse, WeMath, MMStar): a letter
    within range, else the option whose text ``answer`` is. ``by="text"`` (benchmarks that store the
    option's text: MathVista, Geometry3K): the position of that text, so options that look like
    letters ("(c)", "(a)", ...) are never read as letters; a letter only if no option has the text.
    """
    text = str(answer).strip()
    stripped = [str(c).strip() for c in choices]
    letter = text.strip("().").upper()
    is_letter = len(letter) == 1 and letter in LETTERS[: len(choices)]
    if by == "text" and text in stripped:
        return LETTERS[stripped.index(text)]
    if is_letter:
        return letter
    if text in stripped:
        return LETTERS[stripped.index(text)]
    raise ctx.error(
        index,
        f"field '{name}' ({text!r}) is neither a letter A-{LETTERS[len(choices) - 1]} nor one of the choices",
    )


_OPTION_LINE = re.compile(r"^\s*\(?([A-H])[).:：]\s*(.*)$")


def split_option_lines(text: str) -> tuple[str, list[str], str] | None:
    """Split ``text`` into (stem, options, tail) where options are consecutive ``A. ...`` lines.

    Returns None unless the option lines run A, B, C, ... from A with at least two options.
    """
    lines = text.split("\n")
    for start, line in enumerate(lines):
        m = _OPTION_LINE.match(line)
        if not m or m.group(1) != "A":
            continue
        options: list[str] = []
        end = start
        while end < len(lines):
            m = _OPTION_LINE.match(lines[end])
            if not m or m.group(1) != LETTERS[len(options)]:
                break
            options.append(m.group(2).strip())
            end += 1
        if len(options) >= 2:
            stem = "\n".join(lines[:start]).strip()
            tail = "\n".join(lines[end:]).strip()
            return stem, options, tail
    return None


def split_inline_options(text: str) -> list[str] | None:
    """Options written on one line: ``"A: x, B: y, C: z"`` (MMStar) or ``"A. x; B. y"`` (WeMath)."""
    # WeMath mixes ASCII and full-width marks: "A. ①;B．②;C. ③"
    marks = list(re.finditer(r"(?:^|(?<=[\s,;；]))([A-H])\s*[.:：．]\s*", text))
    # keep only marks that run A, B, C, ... in order
    picked: list[re.Match[str]] = []
    for m in marks:
        if m.group(1) == LETTERS[len(picked)]:
            picked.append(m)
    if len(picked) < 2:
        return None
    options = []
    for k, m in enumerate(picked):
        end = picked[k + 1].start() if k + 1 < len(picked) else len(text)
        options.append(text[m.end() : end].strip().rstrip(",;；").strip())
    return options


_DIRECT_ANSWER = re.compile(r"\s*Please answer directly[^\n]*$", re.IGNORECASE)


# --------------------------------------------------------------------------------------------------
# Per-benchmark row converters
# --------------------------------------------------------------------------------------------------

Converter = Callable[[Iterable[tuple[int, dict[str, Any]]], RowContext], list[Question]]
#: One row to its question (None: the row belongs to another split and is skipped).
RowConverter = Callable[[int, dict[str, Any], RowContext], Question | None]


def _per_row(convert: RowConverter) -> Converter:
    """The converter that applies ``convert`` to each ``(index, row)`` and keeps what it returns."""

    def convert_rows(rows: Iterable[tuple[int, dict[str, Any]]], ctx: RowContext) -> list[Question]:
        return [q for i, row in rows if (q := convert(i, row, ctx)) is not None]

    return convert_rows


def _question(
    ctx: RowContext,
    qid: str,
    problem: str,
    answer: str,
    images: list[Any],
    answer_type: AnswerType,
    **fields: Any,
) -> Question:
    """A question of benchmark ``ctx.benchmark``; ``fields`` are the other :class:`Question` fields."""
    return Question(
        benchmark=ctx.benchmark,
        question_id=qid,
        problem=problem,
        answer=answer,
        images=images,
        answer_type=answer_type,
        **fields,
    )


def _choice_question(
    ctx: RowContext, qid: str, stem: str, choices: list[str], letter: str, images: list[Any], **fields: Any
) -> Question:
    """A multiple-choice question: ``stem`` with its options listed (:func:`format_choice_problem`)."""
    problem = format_choice_problem(stem, choices)
    return _question(ctx, qid, problem, letter, images, "choice", choices=choices, **fields)


def _free_question(
    ctx: RowContext, qid: str, problem: str, answer: str, images: list[Any], **fields: Any
) -> Question:
    """A question whose answer type is read from ``answer`` (a yes/no answer lower-cased)."""
    atype = infer_answer_type(answer)
    return _question(
        ctx, qid, problem, answer.lower() if atype == "yesno" else answer, images, atype, **fields
    )


def _geo3k_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    """A row in the geo3k schema (real or synthetic) to a question; errors name row and field.

    The synthetic suite's extra columns ``family``, ``role`` and ``answer_type`` are read when present.
    """
    return _schema_row(i, row, ctx, custom=False)


def _custom_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    """A row of a user's own benchmark (:func:`custom_benchmark`): the geo3k schema with the images
    optional (``images``: a list, or ``image``: one; none: a text-only question) and ``question``
    accepted for ``problem``; the benchmark's name and role are the user's, never a row's."""
    return _schema_row(i, row, ctx, custom=True)


def _schema_row(i: int, row: dict[str, Any], ctx: RowContext, *, custom: bool) -> Question:
    if not custom:
        images = ctx.images(row, i, "images")
        if not images:
            raise ctx.error(i, "field 'images' is empty")
    elif not _is_empty(row.get("images")):
        images = ctx.images(row, i, "images")
    elif not _is_empty(row.get("image")):
        images = [ctx.image(row, i, "image")]
    else:
        images = []
    text_field = "question" if custom and "problem" not in row and "question" in row else "problem"
    problem = ctx.text(row, i, text_field)
    answer = ctx.text(row, i, "answer")
    n_marks = problem.count(IMAGE_PLACEHOLDER)
    if n_marks and n_marks != len(images):
        raise ctx.error(
            i,
            f"field '{text_field}' has {n_marks} '<image>' placeholders but "
            + (f"the row has {len(images)} image(s)" if custom else f"field 'images' has {len(images)}"),
        )

    family = None if custom else ctx.optional(row, "family")
    benchmark = f"synthetic/{family}" if family else ctx.benchmark
    role = ctx.optional(row, "role", "in_domain") if not custom else "in_domain"  # load_benchmark sets it
    if role not in _ROLES:
        raise ctx.error(i, f"field 'role' should be one of {sorted(_ROLES)}, got {role!r}")
    hub_choices = [str(c) for c in (ctx.optional(row, "choices") or [])]
    ground_truth = ctx.optional(row, "ground_truth")

    answer_type = ctx.optional(row, "answer_type") or infer_answer_type(answer)
    if answer_type not in _ANSWER_TYPES:
        raise ctx.error(
            i, f"field 'answer_type' should be one of {sorted(_ANSWER_TYPES)}, got {answer_type!r}"
        )
    choices = None
    if answer_type == "choice":
        if not hub_choices:
            raise ctx.error(i, "field 'choices' is empty but answer_type is 'choice'")
        choices = hub_choices
        gt = str(ground_truth or "").strip().upper()
        answer = (
            gt
            if len(gt) == 1 and gt in LETTERS[: len(choices)]
            else gold_letter(answer, choices, ctx, i, by="text")
        )
    elif answer_type == "yesno":
        answer = answer.lower()
        if answer not in {"yes", "no"}:
            raise ctx.error(
                i, f"field 'answer' should be 'yes' or 'no' for answer_type 'yesno', got {answer!r}"
            )

    qid = ctx.optional(row, "question_id", ctx.optional(row, "id"))
    return Question(
        benchmark=str(benchmark),
        question_id=str(qid) if qid is not None else str(i),
        problem=problem,
        answer=answer,
        images=images,
        choices=choices,
        answer_type=answer_type,
        role=role,
        metadata={
            "split": ctx.split,
            "choices": hub_choices or None,
            "ground_truth": ground_truth,
            **({"family": family} if family else {}),
        },
    )


#: HallusionBench split that reproduces the paper's question count (docs/benchmarks-data.md,
#: "Counts"): the ``image`` rows keyed by NoisyRollout's id ``set_figure_question``, which repeats
#: across categories, so 951 rows collapse to 318; the LAST row of each id is kept (a dict filled in
#: row order). 318 + 1000 + 3940 + 3040 + 1740 = 10,038, the paper's OOD n.
HALLUSION_PAPER_SPLIT = "image_paper"


def _convert_hallusionbench(rows, ctx: RowContext) -> list[Question]:
    out = _per_row(_hallusionbench_row)(rows, ctx)
    if ctx.split != HALLUSION_PAPER_SPLIT:
        return out
    by_id: dict[str, Question] = {}
    for q in out:
        m = q.metadata
        q.question_id = f"{m['set_id']}_{m['figure_id']}_{m['question_id']}"
        by_id.pop(q.question_id, None)  # keep the last row, at its own position
        by_id[q.question_id] = q
    return list(by_id.values())


def _hallusionbench_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question | None:
    if ctx.split != "non_image" and str(row.get("visual_input", "")) == "0":
        return None  # the GitHub json holds both splits; its no-image rows are the non_image split
    question = ctx.text(row, i, "question")
    gt = ctx.text(row, i, "gt_answer")
    if gt not in {"0", "1"}:
        raise ctx.error(i, f"field 'gt_answer' should be '0' or '1', got {gt!r}")
    # NoisyRollout keeps the text before the first '?' and appends its yes/no instruction.
    stem = question.split("?")[0] if "?" in question else question
    # json layouts (the GitHub release) give only `filename`, a path relative to the data folder
    images = [] if ctx.split == "non_image" else [_image_of(row, i, ctx, "image", "filename")]
    ids = [
        str(ctx.optional(row, k, ""))
        for k in ("category", "subcategory", "set_id", "figure_id", "question_id")
    ]
    metadata = {
        "category": ctx.optional(row, "category"),
        "subcategory": ctx.optional(row, "subcategory"),
        "filename": ctx.optional(row, "filename"),
        "question": question,
        **{k: str(ctx.optional(row, k, "")) for k in ("set_id", "figure_id", "question_id")},
    }
    qid = "_".join(ids) if any(ids) else str(i)
    answer = "yes" if gt == "1" else "no"
    return _question(
        ctx, qid, f"{stem.strip()}? {YESNO_INSTRUCTION}", answer, images, "yesno", metadata=metadata
    )


def _image_of(row, i, ctx: RowContext, *names: str):
    """The first of ``names`` present and non-empty in ``row`` decoded as an image."""
    for name in names:
        if not _is_empty(row.get(name)):
            return ctx.image(row, i, name)
    raise ctx.error(
        i, f"field '{names[0]}' is missing" if names[0] not in row else f"field '{names[0]}' is empty"
    )


def _mathvista_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    pid = ctx.text(row, i, "pid")
    qtype = ctx.text(row, i, "question_type")
    question = ctx.text(row, i, "question")
    answer = ctx.text(row, i, "answer")
    image = _image_of(row, i, ctx, "decoded_image", "image")
    meta = {
        "question_type": qtype,
        "mathvista_answer_type": ctx.optional(row, "answer_type"),
        "unit": ctx.optional(row, "unit"),
        "precision": ctx.optional(row, "precision"),
        "query": ctx.optional(row, "query"),
        "task": (ctx.optional(row, "metadata") or {}).get("task"),
    }
    if qtype == "multi_choice":
        choices = [str(c) for c in ctx.field(row, i, "choices")]
        letter = gold_letter(answer, choices, ctx, i, by="text")
        return _choice_question(
            ctx, pid, question, choices, letter, [image], metadata={**meta, "answer_text": answer}
        )
    if qtype == "free_form":
        # `query` carries MathVista's precision hint ("requiring a floating-point number with two
        # decimal places"), which a rule-based scorer needs; NoisyRollout prompts with it too.
        problem = str(ctx.optional(row, "query") or question)
        vista_type = str(ctx.optional(row, "answer_type", ""))
        atype: AnswerType = "number" if vista_type in {"integer", "float"} else infer_answer_type(answer)
        return _question(ctx, pid, problem, answer, [image], atype, metadata=meta)
    raise ctx.error(i, f"field 'question_type' should be 'multi_choice' or 'free_form', got {qtype!r}")


# MathVerse writes "Choices:" and, in some rows, "Choice:" before the option lines.
_CHOICES_BLOCK = re.compile(r"\n?\s*Choices?\s*:\s*\n?", re.IGNORECASE)
# "Choose 2 answers" rows store every right letter, one a line ("C\nD").
_MULTI_LETTER = re.compile(r"[A-H](?:\s*[\n,;]\s*[A-H])+")


def _mathverse_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    sid = ctx.text(row, i, "sample_index")
    question = ctx.text(row, i, "question")
    qtype = ctx.text(row, i, "question_type")
    answer = ctx.text(row, i, "answer")
    images = [ctx.image(row, i, "image")]
    meta = {
        "problem_index": ctx.optional(row, "problem_index"),
        "problem_version": ctx.optional(row, "problem_version"),
        "question_for_eval": ctx.optional(row, "question_for_eval"),
        "query_cot": ctx.optional(row, "query_cot"),
    }
    if qtype == "free-form":
        return _question(ctx, sid, question, answer, images, infer_answer_type(answer), metadata=meta)
    if qtype != "multi-choice":
        raise ctx.error(i, f"field 'question_type' should be 'multi-choice' or 'free-form', got {qtype!r}")
    parts = _CHOICES_BLOCK.split(question, maxsplit=1)
    parsed = split_option_lines(parts[1]) if len(parts) == 2 else None
    if parsed is None:
        # Vision-only versions print the options inside the figure: no list to show.
        letter = answer.strip("().").upper()
        if len(letter) != 1 or letter not in LETTERS:
            raise ctx.error(i, f"field 'answer' ({answer!r}) should be an option letter")
        return _question(
            ctx, sid, f"{question}\n{CHOICE_INSTRUCTION}", letter, images, "choice", metadata=meta
        )
    stem, choices, _tail = parsed
    stem = (parts[0] + ("\n" + stem if stem else "")).strip()
    if _MULTI_LETTER.fullmatch(answer):
        # several right options: graded as the letters, in order, e.g. "C, D"
        letters = ", ".join(re.findall(r"[A-H]", answer))
        problem = format_choice_problem(stem, choices)
        return _question(ctx, sid, problem, letters, images, "free", metadata={**meta, "choices": choices})
    return _choice_question(
        ctx, sid, stem, choices, gold_letter(answer, choices, ctx, i), images, metadata=meta
    )


_MATHVISION_IMAGE = re.compile(r"<image\d*>")


def _mathvision_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    qid = ctx.text(row, i, "id")
    question = ctx.text(row, i, "question")
    answer = ctx.text(row, i, "answer")
    image = _image_of(row, i, ctx, "decoded_image", "image")
    # The question marks its figure as <image1>; keep the first mark as our placeholder.
    marks = _MATHVISION_IMAGE.findall(question)
    stem = question
    if marks:
        stem = _MATHVISION_IMAGE.sub("", question.replace(marks[0], "\x00", 1)).replace(
            "\x00", IMAGE_PLACEHOLDER
        )
    stem = stem.strip()
    options = [str(o) for o in (ctx.optional(row, "options") or [])]
    meta = {"subject": ctx.optional(row, "subject"), "level": ctx.optional(row, "level")}
    if options:
        return _choice_question(
            ctx, qid, stem, options, gold_letter(answer, options, ctx, i), [image], metadata=meta
        )
    return _question(ctx, qid, stem, answer, [image], infer_answer_type(answer), metadata=meta)


def _wemath_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    qid = ctx.text(row, i, "ID")
    key = ctx.text(row, i, "key")
    question = ctx.text(row, i, "question")
    option = ctx.text(row, i, "option")
    answer = ctx.text(row, i, "answer")
    choices = split_inline_options(option)
    if choices is None:
        raise ctx.error(i, f"field 'option' has no 'A. ...; B. ...' options: {option!r}")
    image = _image_of(row, i, ctx, "image_path", "image")
    letter = gold_letter(answer, choices, ctx, i)
    metadata = {
        "key": key,
        "knowledge_concept": ctx.optional(row, "knowledge concept"),
        "question_number": ctx.optional(row, "question number"),
    }
    return _choice_question(ctx, f"{qid}@{key}", question, choices, letter, [image], metadata=metadata)


def _pope_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    question = ctx.text(row, i, "question")
    answer = ctx.text(row, i, "answer").lower()
    if answer not in {"yes", "no"}:
        raise ctx.error(i, f"field 'answer' should be 'yes' or 'no', got {answer!r}")
    category = str(ctx.optional(row, "category", ""))
    qid = str(ctx.optional(row, "question_id", ctx.optional(row, "id", i)))
    images = [ctx.image(row, i, "image")]
    metadata = {"category": category or None, "image_source": ctx.optional(row, "image_source")}
    qid = f"{category}_{qid}" if category else qid
    problem = f"{question} {YESNO_INSTRUCTION}"
    return _question(ctx, qid, problem, answer, images, "yesno", role="general", metadata=metadata)


_MMSTAR_OPTIONS = re.compile(r"\n?\s*Options\s*:\s*", re.IGNORECASE)


def _mmstar_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    question = ctx.text(row, i, "question")
    answer = ctx.text(row, i, "answer")
    parts = _MMSTAR_OPTIONS.split(question, maxsplit=1)
    choices = split_inline_options(parts[1]) if len(parts) == 2 else None
    if choices is None:
        raise ctx.error(i, "field 'question' has no 'Options: A: ..., B: ...' list")
    qid = str(ctx.field(row, i, "index"))
    letter = gold_letter(answer, choices, ctx, i)
    images = [ctx.image(row, i, "image")]
    metadata = {"category": ctx.optional(row, "category"), "l2_category": ctx.optional(row, "l2_category")}
    return _choice_question(
        ctx, qid, parts[0].strip(), choices, letter, images, role="general", metadata=metadata
    )


def _ai2d_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    question = ctx.text(row, i, "question")
    choices = [str(o) for o in ctx.field(row, i, "options")]
    answer = ctx.text(row, i, "answer")
    # lmms-lab/ai2d stores the 0-based index of the right option as a string.
    if answer.isdigit():
        k = int(answer)
        if k >= len(choices):
            raise ctx.error(i, f"field 'answer' ({answer}) is out of range for {len(choices)} options")
        letter = LETTERS[k]
    else:
        letter = gold_letter(answer, choices, ctx, i)
    qid = str(ctx.optional(row, "id", i))
    return _choice_question(ctx, qid, question, choices, letter, [ctx.image(row, i, "image")], role="general")


def _realworldqa_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    question = ctx.text(row, i, "question")
    answer = ctx.text(row, i, "answer")
    image = ctx.image(row, i, "image")
    parsed = split_option_lines(question)
    letter = answer.strip("().").upper()
    fields = {"role": "general", "metadata": {"question": question}}
    if parsed is not None and len(letter) == 1 and letter in LETTERS[: len(parsed[1])]:
        stem, choices, _tail = parsed  # the tail is "Please answer directly with only the letter ..."
        return _choice_question(ctx, str(i), stem, choices, letter, [image], **fields)
    stem = _DIRECT_ANSWER.sub("", question).strip()
    return _free_question(ctx, str(i), stem, answer, [image], **fields)


def _chartqa_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    # HuggingFaceM4/ChartQA: query + label (list); lmms-lab/ChartQA: question + answer.
    if "query" in row or "label" in row:
        question = ctx.text(row, i, "query")
        label = ctx.field(row, i, "label")
        answer = str(label[0] if isinstance(label, list | tuple) else label).strip()
        if not answer:
            raise ctx.error(i, "field 'label' is empty")
        source = ctx.optional(row, "human_or_machine")
    else:
        question = ctx.text(row, i, "question")
        answer = ctx.text(row, i, "answer")
        source = ctx.optional(row, "type")
    images = [ctx.image(row, i, "image")]
    return _free_question(ctx, str(i), question, answer, images, role="general", metadata={"source": source})


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark: where it lives on the hub, which split the paper uses, how rows convert."""

    name: str
    role: Role
    default_split: str
    hub_id: str
    loader: Converter
    hub_config: str | None = None
    #: Extra file names/globs (relative to the data folder, ``{split}`` substituted) tried before the
    #: generic ``data/{split}-*.parquet`` / ``{split}.parquet`` / ``{split}.json[l]`` ones.
    files: tuple[str, ...] = ()
    #: Columns holding images (so they are read undecoded and decoded here, with row-level errors).
    image_columns: tuple[str, ...] = ("image",)
    #: Splits made from another stored split by the loader (``{"image_paper": "image"}``).
    derived_splits: dict[str, str] = field(default_factory=dict)


#: The benchmarks, one a line: name, role, the split the paper uses, hub repository, row converter,
#: then where the hub's layout differs from the defaults.
# fmt: off
_SPECS = [
    BenchmarkSpec("geo3k",          "in_domain", "test",                "hiyouga/geometry3k",      _per_row(_geo3k_row),       image_columns=("images",)),
    BenchmarkSpec("hallusionbench", "ood",       HALLUSION_PAPER_SPLIT, "lmms-lab/HallusionBench", _convert_hallusionbench,    derived_splits={HALLUSION_PAPER_SPLIT: "image"}),
    BenchmarkSpec("mathvista",      "ood",       "testmini",            "AI4Math/MathVista",       _per_row(_mathvista_row),   image_columns=("decoded_image",)),
    BenchmarkSpec("mathverse",      "ood",       "testmini",            "AI4Math/MathVerse",       _per_row(_mathverse_row),   hub_config="testmini", files=("{split}.parquet", "{split}.json")),
    BenchmarkSpec("mathvision",     "ood",       "test",                "MathLLMs/MathVision",     _per_row(_mathvision_row),  image_columns=("decoded_image",)),
    BenchmarkSpec("wemath",         "ood",       "testmini",            "We-Math/We-Math",         _per_row(_wemath_row),      image_columns=("image_path",)),
    BenchmarkSpec("pope",           "general",   "test",                "lmms-lab/POPE",           _per_row(_pope_row)),
    BenchmarkSpec("mmstar",         "general",   "val",                 "Lin-Chen/MMStar",         _per_row(_mmstar_row),      hub_config="val", files=("mmstar.parquet",)),
    BenchmarkSpec("ai2d",           "general",   "test",                "lmms-lab/ai2d",           _per_row(_ai2d_row)),
    BenchmarkSpec("realworldqa",    "general",   "test",                "xai-org/RealworldQA",     _per_row(_realworldqa_row)),
    BenchmarkSpec("chartqa",        "general",   "test",                "HuggingFaceM4/ChartQA",   _per_row(_chartqa_row)),
]
# fmt: on
BENCHMARKS: dict[str, BenchmarkSpec] = {spec.name: spec for spec in _SPECS}

#: How a role is written after ``NAME=FILE:`` (``ncgrpo eval --data``), to the records' role.
ROLE_NAMES: dict[str, Role] = {
    "in-domain": "in_domain",
    "in_domain": "in_domain",
    "ood": "ood",
    "general": "general",
}
#: A user's own benchmark's name: it labels records, tables and figures.
_CUSTOM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def _norm_name(name: str) -> str:
    """A benchmark name as the tables match it to the paper's labels: lower-case letters and digits."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def parse_role(text: str) -> Role:
    """``in-domain`` (or ``in_domain``), ``ood`` or ``general`` to the records' role; else ValueError."""
    role = ROLE_NAMES.get(str(text).strip().lower())
    if role is None:
        raise ValueError(f"role {text!r} is not one of in-domain, ood, general")
    return role


def custom_benchmark(name: str, role: Role = "in_domain") -> BenchmarkSpec:
    """The spec of a user's own benchmark ``name`` (any name but the registered ones and ``synthetic``):
    rows in the geo3k schema, images optional (:func:`_custom_row`), read from a file or folder only.

    Its questions are labelled ``name`` in records, tables and figures, with ``role`` (in_domain, ood or
    general: which table and which pooled test they join)."""
    if not _CUSTOM_NAME.fullmatch(name or ""):
        raise ValueError(
            f"benchmark name {name!r}: use letters, digits and _ . + - (it names the records, tables and figures)"
        )
    builtin = {_norm_name(n) for spec in _SPECS for n in (spec.name, spec.hub_id.rsplit("/", 1)[-1])}
    if _norm_name(name) in builtin | {"synthetic"}:  # tables label those by the paper's names
        raise ValueError(f"{name!r} is a built-in benchmark's name; give your own benchmark another name")
    if role not in _ROLES:
        raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
    return BenchmarkSpec(
        name, role, "test", hub_id="", loader=_per_row(_custom_row), image_columns=("images", "image")
    )


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------


def _candidate_files(spec: BenchmarkSpec, folder: Path, split: str) -> list[Path]:
    patterns = [p.format(split=split) for p in spec.files] + [
        f"data/{split}-*.parquet",
        f"data/{split}.parquet",
        f"{split}-*.parquet",
        f"{split}.parquet",
        f"{split}/*.parquet",
        f"*/{split}-*.parquet",
        f"data/{split}.jsonl",
        f"{split}.jsonl",
        f"data/{split}.json",
        f"{split}.json",
    ]
    for pattern in patterns:
        found = sorted(p for p in folder.glob(pattern) if p.is_file())
        if found:
            return found
    return []


def _expected_layout(spec: BenchmarkSpec, split: str) -> str:
    names = [p.format(split=split) for p in spec.files] + [
        f"data/{split}-00000-of-00001.parquet",
        f"{split}.parquet",
        f"{split}.jsonl",
    ]
    return ", ".join(dict.fromkeys(names))


def _read_parquet(files: list[Path], image_columns: tuple[str, ...]):
    """Rows of parquet files via ``datasets``, with image columns left as undecoded structs."""
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    empty = [f for f in files if _parquet_rows(f) == 0]
    if empty:  # datasets would say only "An error occurred while generating the dataset"
        raise BenchmarkDataError(
            f"{empty[0]}: the parquet file holds no rows; remove it or write the split's questions into it"
        )
    try:
        ds = datasets.Dataset.from_parquet([str(f) for f in files])
        return _undecoded(ds, image_columns)
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def _parquet_rows(file: Path) -> int | None:
    """Rows of a parquet file from its footer (None when it is not readable as parquet)."""
    try:
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(file).metadata.num_rows)
    except Exception:  # noqa: BLE001 - the reader below reports unreadable files
        return None


def _undecoded(ds, image_columns: tuple[str, ...]):
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, datasets.List | datasets.Sequence) and isinstance(
            getattr(feature, "feature", None), datasets.Image
        ):
            ds = ds.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return ds


def _read_json(file: Path) -> list[dict[str, Any]]:
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise BenchmarkDataError(f"{file}: line {n + 1} is not valid JSON: {exc}") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchmarkDataError(f"{file}: not valid JSON: {exc}") from None
    if isinstance(data, dict):  # {"id": row, ...} layouts
        bad = next((k for k, v in data.items() if not isinstance(v, dict)), None)
        if bad is not None:
            raise BenchmarkDataError(
                f"{file}: holds a JSON object whose value at key {bad!r} is {type(data[bad]).__name__}, not a row; "
                'expected a list of row objects ([{...}, ...]) or an object of rows keyed by id ({"id": {...}})'
            )
        data = list(data.values())
    if not isinstance(data, list):
        raise BenchmarkDataError(
            f"{file}: holds a JSON {type(data).__name__}; expected a list of row objects ([{{...}}, ...])"
        )
    return data


def _rows(records, limit: int | None, label: str = "") -> Iterable[tuple[int, dict[str, Any]]]:
    n = len(records)
    stop = n if limit is None else min(n, limit)
    for i in range(stop):
        row = records[i]
        if not isinstance(row, dict):
            where = f"{label}: " if label else ""
            raise BenchmarkDataError(
                f"{where}row {i} is {type(row).__name__}, not an object of fields; each row must be a JSON object"
            )
        yield i, row


def load_benchmark(
    name: str,
    path: str | Path | None = None,
    *,
    split: str | None = None,
    limit: int | None = None,
    role: Role | None = None,
) -> list[Question]:
    """Load benchmark ``name`` as a list of questions.

    ``name``: a key of :data:`BENCHMARKS`, or any other name for a benchmark of one's own read from
    ``path`` (:func:`custom_benchmark`: the geo3k schema, images optional). ``path``: a folder in the
    hub's layout or a single parquet/json/jsonl file; None reads the ``datasets`` cache (offline only if
    cached; built-in benchmarks only). ``split`` defaults to the spec's (``test`` for one's own);
    ``limit`` keeps the first rows only. ``role`` overrides the benchmark's role (in_domain, ood,
    general; one's own: in_domain by default).
    """
    if name in BENCHMARKS:
        spec = BENCHMARKS[name]
        if role is not None:
            if role not in _ROLES:
                raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
            spec = dataclasses.replace(spec, role=role)
    elif path is None:
        raise KeyError(
            f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}; a benchmark of your own needs its "
            "file or folder (ncgrpo eval --data NAME=FILE.jsonl[:role])"
        )
    else:
        spec = custom_benchmark(name, role or "in_domain")
    split = split or spec.default_split
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")

    stored = spec.derived_splits.get(split, split)
    if path is None:
        records, ctx = _from_hub(spec, stored)
    else:
        records, ctx = _from_path(spec, Path(path), stored)
    ctx.split = split
    questions = spec.loader(_rows(records, limit, ctx.label), ctx)
    for q in questions:
        if q.role != spec.role and not q.benchmark.startswith("synthetic/"):
            q.role = spec.role
    _check_unique(questions, ctx)
    return questions


def _from_path(spec: BenchmarkSpec, path: Path, split: str):
    if path.is_file():
        files = [path]
        base = path.parent
    elif path.is_dir():
        files = _candidate_files(spec, path, split)
        if not files:
            present = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())[:20]
            raise BenchmarkDataError(
                f"{spec.name}: no '{split}' data under {path}; expected one of: {_expected_layout(spec, split)} "
                f"(found: {', '.join(present) or 'nothing'})"
            )
        base = path
    else:
        holding = f"the {spec.hub_id} files" if spec.hub_id else "its rows"
        raise BenchmarkDataError(
            f"{spec.name}: {path} does not exist; pass the file or the folder holding {holding} "
            f"(expected: {_expected_layout(spec, split)})"
        )
    label = f"{spec.name} {files[0]}" if len(files) == 1 else f"{spec.name} {files[0].parent}/{split}-*"
    ctx = RowContext(benchmark=spec.name, label=label, split=split, base_dir=base)
    suffixes = {f.suffix for f in files}
    if suffixes <= set(_PARQUET):
        try:
            records = _read_parquet(files, spec.image_columns)
        except BenchmarkDataError:
            raise
        except Exception as exc:
            raise BenchmarkDataError(f"{label}: cannot read parquet: {exc}") from exc
    elif len(files) == 1 and files[0].suffix in _JSON:
        records = _read_json(files[0])
    else:
        raise BenchmarkDataError(f"{spec.name}: unsupported file type(s) {sorted(suffixes)} in {path}")
    return records, ctx


def _from_hub(spec: BenchmarkSpec, split: str):
    import datasets

    label = f"{spec.name} hub:{spec.hub_id}[{split}]"
    try:
        ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=split)
    except Exception as exc:
        raise BenchmarkDataError(
            f"{spec.name}: could not load {spec.hub_id} (split '{split}') from the datasets cache "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Download it where "
            f"there is network, or pass --data_dir/path pointing at a folder with "
            f"{_expected_layout(spec, split)} (see docs/benchmarks-data.md)."
        ) from exc
    ctx = RowContext(benchmark=spec.name, label=label, split=split, base_dir=None)
    return _undecoded(ds, spec.image_columns), ctx


def _check_unique(questions: list[Question], ctx: RowContext) -> None:
    seen: dict[str, int] = {}
    for k, q in enumerate(questions):
        if q.uid in seen:
            raise BenchmarkDataError(
                f"{ctx.label} row {k}: question_id {q.question_id!r} repeats row {seen[q.uid]} "
                f"(benchmark {q.benchmark})"
            )
        seen[q.uid] = k
