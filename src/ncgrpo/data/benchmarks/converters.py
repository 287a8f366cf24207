"""Per-benchmark row converters: one public dataset's rows, in its hub layout, to questions."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, get_args

from ncgrpo.data.benchmarks.rows import (
    _DIRECT_ANSWER,
    _ROLES,
    CHOICE_INSTRUCTION,
    YESNO_INSTRUCTION,
    RowContext,
    _is_empty,
    format_choice_problem,
    gold_letter,
    infer_answer_type,
    split_inline_options,
    split_option_lines,
)
from ncgrpo.data.files import prompt_messages
from ncgrpo.data.prompts import IMAGE_PLACEHOLDER
from ncgrpo.data.types import LETTERS, AnswerType, Question

_ANSWER_TYPES = set(get_args(AnswerType))


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
    optional (``images``: a list, or ``image``: one; none: a text-only question) and ``question`` or
    TRL's ``prompt`` (text, or one user message) accepted for ``problem``; the benchmark's name and
    role are the user's, never a row's."""
    return _schema_row(i, row, ctx, custom=True)


def _has_image_parts(prompt: Any) -> bool:
    """Whether a TRL ``prompt`` column's chat messages hold an image part (``{"type": "image"}``)."""
    return isinstance(prompt, list | tuple) and any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list | tuple)
        and any(isinstance(part, dict) and part.get("type") == "image" for part in m["content"])
        for m in prompt
    )


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
    messages = None
    if custom and "problem" not in row and "question" not in row and _has_image_parts(row.get("prompt")):
        # a multimodal chat prompt: one user turn whose image parts become <image> placeholders
        text_field, problem = "prompt", ctx.prompt(row, i)
    elif custom and "problem" not in row and "question" not in row and "prompt" in row:
        # TRL's prompt column (a string or chat messages), as ncgrpo train reads a data file: as written

        try:
            messages = prompt_messages(row["prompt"])
        except ValueError as e:
            raise ctx.error(i, f"field 'prompt' {e}") from None
        users = [m["content"] for m in messages if m["role"] == "user"]
        text_field, problem = "prompt", users[-1] if users else messages[-1]["content"]
    else:
        if custom and text_field not in row:
            raise ctx.error(
                i, "field 'problem' is missing (the question goes in 'problem', 'question' or 'prompt')"
            )
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
            **({"messages": messages} if messages else {}),
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


#: GSM8K's own evaluation (openai/grade-school-math, ``grade_school_math/dataset.py``): the gold is
#: the number after ``#### `` in the worked solution (``ANS_RE``), its commas removed.
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_gold(solution: str) -> str | None:
    """The gold of a GSM8K ``answer`` field as GSM8K's ``extract_answer`` reads it: the number after
    ``#### ``, commas removed (``"...\\n#### 1,000"`` -> ``"1000"``); None when there is none."""
    m = _GSM8K_ANSWER.search(solution)
    if m is None:
        return None
    gold = m.group(1).strip().replace(",", "")
    return gold if _NUMBER.fullmatch(gold) else None


_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")


def _gsm8k_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    """``openai/gsm8k`` (and the GitHub ``test.jsonl``): ``question``, and ``answer`` = the worked
    solution ending ``#### N``; the gold is N (:func:`gsm8k_gold`), the solution kept in metadata. A
    row whose ``answer`` is already a plain number (a converted copy) takes it, commas removed."""
    question = (
        ctx.prompt(row, i) if "question" not in row and "prompt" in row else ctx.text(row, i, "question")
    )
    solution = ctx.text(row, i, "answer")
    gold = gsm8k_gold(solution)
    if gold is None:
        plain = solution.replace(",", "")
        if not _NUMBER.fullmatch(plain):
            raise ctx.error(
                i,
                "field 'answer' has no final answer '#### N' (GSM8K's layout: the worked solution, then a "
                f"line '#### ' and the number); it ends {solution[-60:]!r}",
            )
        gold, solution = plain, None
    qid = ctx.optional(row, "id", ctx.optional(row, "question_id", i))
    return _question(ctx, str(qid), question, gold, [], "number", metadata={"solution": solution})


#: The instruction line the ``prompt``/``answer`` copies of MATH-500 append to each problem
#: (jianzhnie/LLMEval ``data/math500.jsonl``); the problem is read without it, as in the canonical
#: layout, and the run's ``--math_prompt`` asks for the box instead.
MATH500_PROMPT_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def _math500_row(i: int, row: dict[str, Any], ctx: RowContext) -> Question:
    """MATH-500 (``HuggingFaceH4/MATH-500``: ``problem, solution, answer, subject, level,
    unique_id``; or a ``prompt``/``answer`` copy): the gold is ``answer``, the field MATH's own grader
    (PRM800K's ``grade_answer``) compares with; question_id = ``unique_id`` (else the row index)."""
    answer = ctx.text(row, i, "answer")
    if "problem" in row or "prompt" not in row:
        problem = ctx.text(row, i, "problem")
        meta = {k: ctx.optional(row, k) for k in ("subject", "level", "solution")}
        qid = ctx.optional(row, "unique_id", i)
    else:
        problem = ctx.prompt(row, i)
        instruction = None
        if problem.endswith(MATH500_PROMPT_SUFFIX):
            problem, instruction = problem[: -len(MATH500_PROMPT_SUFFIX)].rstrip(), MATH500_PROMPT_SUFFIX
        if not problem:
            raise ctx.error(i, "field 'prompt' has no problem before its instruction line")
        meta = {"instruction": instruction}
        qid = ctx.optional(row, "unique_id", ctx.optional(row, "id", i))
    return _free_question(ctx, str(qid), problem, answer, [], metadata=meta)
