"""The one scorer's ``=``: :func:`grade` (the rules in :mod:`ncgrpo.rewards`), NoisyRollout's grader for
comparison, and :func:`score`, which composes ``extract`` and ``=``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ncgrpo.data.types import LETTERS
from ncgrpo.rewards.answers import (
    _LITERAL_EXPRESSION_RE,
    _grade_symbolic,
    _is_math,
    _key,
    _literal,
    _matrix,
    _normalize,
    _sequence,
    _within_stated_precision,
    extract_boxed,
)

#: ``"ncgrpo"``: the rules in this module; ``"mathruler"``: NoisyRollout's ``grade_answer``.
GRADERS = ("ncgrpo", "mathruler")

#: NoisyRollout / verl ``geo3k`` format check, applied with ``re.fullmatch`` to the raw output.
FORMAT_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)

ANSWER_TYPES = ("choice", "yesno", "number", "free")


@dataclass(frozen=True)
class Score:
    """What evaluation records per question: the extracted answer and whether it is correct."""

    extracted: str | None
    correct: bool


# ---------------------------------------------------------------------------------------------
# y* comparison


def _grade_free(pred: str, gold: str) -> bool:
    p, g = _normalize(pred), _normalize(gold)
    if not p or not g:
        return False
    if _key(p) == _key(g):
        return True
    if "=" not in g and ("=" in p or "\\approx" in p):  # "x = 5", "AB \approx 3.46"
        p = re.split(r"=|\\approx", p)[-1].strip()
        if not p:
            return False
        if _key(p) == _key(g):
            return True
    based = _grade_base(p, g)
    if based is not None:
        return based
    if "=" not in g:
        structured = _grade_structured(p, g)
        if structured is not None:
            return structured
    if "=" in g:  # a relation or a chain (y_2=(x+2)^3=y_1(x+2)): side by side, never its last part
        gs, ps = g.split("="), p.split("=")
        return len(gs) == len(ps) and all(_grade_free(a, b) for a, b in zip(ps, gs, strict=True))
    gl, pl = _literal(g), _literal(p)
    if gl is not None and pl is not None:
        return _within_stated_precision(pl.value, gl)
    if (gl is None and _LITERAL_EXPRESSION_RE.fullmatch(g)) or _LITERAL_EXPRESSION_RE.fullmatch(p):
        return False  # ranges, orders, ratios: only the string rule above (a gold a/b is a value)
    if not (_is_math(g) and _is_math(p)):
        return False  # text ("increase" / "decrease") is compared as text only
    return _grade_symbolic(p, g, gl)


#: A number written in a base: ``4210_{5}``, ``52_8`` (MATH); math-verify drops the subscript.
_BASE_NUMBER_RE = re.compile(r"(\d[0-9A-Za-z]*)\s*_\s*\{?\s*(\d+)\s*\}?")


def _grade_base(p: str, g: str) -> bool | None:
    """A number in a base (``4210_{5}``) on either side: the same digits, and the same base where the
    prediction writes one (``4210`` answers "in base 5" too; ``4210_{4}`` does not); None when
    neither side is one."""
    gb, pb = _BASE_NUMBER_RE.fullmatch(g), _BASE_NUMBER_RE.fullmatch(p)
    if gb is None and pb is None:
        return None
    g_digits, g_base = gb.groups() if gb else (g, "10")
    p_digits, p_base = pb.groups() if pb else (p, g_base)
    return p_digits.casefold() == g_digits.casefold() and int(p_base) == int(g_base)


def _grade_structured(p: str, g: str) -> bool | None:
    """Matrices, tuples, intervals and lists of answers, entry by entry with the free-form rules;
    None when the gold is none of these (the other rules decide).

    A matrix gold needs a matrix of the same kind (``pmatrix``, ``bmatrix``, ``matrix`` alike; a
    ``vmatrix`` is a determinant) and shape; a tuple or interval gold the same brackets (``(3,4]`` is
    not ``(3,4)``) and entries in order; a bare list of math answers (``1,-2``: all the solutions) the
    same answers in any order, bare or in set braces ``\\{...\\}``.
    """
    gm = _matrix(g)
    if gm is not None:
        pm = _matrix(p)
        if pm is None or pm.kind != gm.kind or [len(r) for r in pm.rows] != [len(r) for r in gm.rows]:
            return False
        return all(
            _grade_free(a, b)
            for pr, gr in zip(pm.rows, gm.rows, strict=True)
            for a, b in zip(pr, gr, strict=True)
        )
    gs = _sequence(g)
    if gs is None:
        return None
    if gs.brackets:
        ps = _sequence(p)
        if ps is None or ps.brackets != gs.brackets or len(ps.entries) != len(gs.entries):
            return False
        return all(_grade_free(a, b) for a, b in zip(ps.entries, gs.entries, strict=True))
    if not all(_is_math(e) for e in gs.entries):
        return None  # text with commas: compared as text
    body = p[2:-2] if p.startswith("\\{") and p.endswith("\\}") else p
    ps = _sequence(body)
    if ps is None or ps.brackets or len(ps.entries) != len(gs.entries):
        return False
    return _one_to_one(ps.entries, gs.entries)


def _one_to_one(preds: Sequence[str], golds: Sequence[str]) -> bool:
    """Each gold answer is matched by its own predicted answer (order free): a bipartite matching."""
    match: dict[int, int] = {}  # gold index -> pred index

    def place(i: int, seen: set[int]) -> bool:
        for j, gold in enumerate(golds):
            if j in seen or not _grade_free(preds[i], gold):
                continue
            seen.add(j)
            if j not in match or place(match[j], seen):
                match[j] = i
                return True
        return False

    return all(place(i, set()) for i in range(len(preds)))


_YESNO_RE = re.compile(r"\W*(yes|no)\b", re.IGNORECASE)
_YESNO_WORD_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def _yes_no(s: str) -> str | None:
    """The yes/no the answer starts with; None if it names both ("Yes or No", "yes/no")."""
    n = _normalize(s)
    m = _YESNO_RE.match(n)
    if not m or len({w.lower() for w in _YESNO_WORD_RE.findall(n)}) > 1:
        return None
    return m.group(1).lower()


_LETTER_ONLY_RE = re.compile(r"\(?([A-Za-z])\)?[.:]?")
_LOWER_LETTER_RE = re.compile(r"\(?([a-z])\)?[.:]?")
_LETTER_LEAD_RE = re.compile(r"\(([A-Z])\)\s*[.:]?\s*(.*)|([A-Z])\s*[.:)](?:\s+(.*)|$)", re.DOTALL)
_LETTER_WORD_RE = re.compile(
    r"(?:option|choice|answer)\s*:?\s*\(?([A-Za-z])\)?(?:[.:)]\s*(.*)|\s+(.*)|$)", re.IGNORECASE | re.DOTALL
)
_OTHER_LETTER_RE = re.compile(r"(?<![A-Za-z])[A-H](?![A-Za-z])|\bor\b", re.IGNORECASE)


def _lower_letter(s: str) -> str | None:
    """The lowercase letter a text is, in any spelling ("b", "(b)", "b."); None otherwise."""
    m = _LOWER_LETTER_RE.fullmatch(_normalize(s))
    return m.group(1) if m else None


def _choice_letter(pred: str, choices: Sequence[str] | None, n: int) -> tuple[int, str] | None:
    """(option index, text after the letter) for a prediction that names an option by letter:
    "B", "(B)", "B.", "B: text", "(B) text", "Option B". None when it does not start with a letter.

    A lowercase letter ("b", "(b)") is a letter too, unless one of the options' texts is that letter
    (AI2D labels diagram parts with letters; MathVista 168 and 849 have options "(c)", "(a)", ...):
    then it names that option by its text. A capital is always the position letter.
    """
    s = _normalize(pred)
    m = _LETTER_ONLY_RE.fullmatch(s)
    if m:
        if m.group(1).islower() and choices and any(_lower_letter(c) == m.group(1) for c in choices):
            return None
        letter, rest = m.group(1), ""
    else:
        m = _LETTER_LEAD_RE.match(s) or _LETTER_WORD_RE.match(s)
        if not m:
            return None
        groups = m.groups()
        letter = next(g for g in groups if g is not None)
        rest = next((g for g in groups[groups.index(letter) + 1 :] if g is not None), "")
    idx = LETTERS.find(letter.upper())
    return (idx, rest.strip()) if 0 <= idx < n else None


def _option_text_matches(pred: str, option: str) -> bool:
    yn = _yes_no(option)
    if yn is not None and _key(_normalize(option)) in ("yes", "no"):
        return _yes_no(pred) == yn
    return _grade_free(pred, option)


def _options_named(pred: str, choices: Sequence[str]) -> set[int]:
    """Options whose text ``pred`` is: the ones it spells exactly if any (so ``0.2 - 0.4`` is not
    ``0.0 - 0.2`` and ``2`` is not ``2\\sqrt{3}``), else the ones it equals by the free-form rules."""
    key, letter = _key(_normalize(pred)), _lower_letter(pred)
    exact = {
        i
        for i, c in enumerate(choices)
        if _key(_normalize(c)) == key or (letter is not None and _lower_letter(c) == letter)
    }
    return exact or {i for i, c in enumerate(choices) if _option_text_matches(pred, c)}


def _gold_index(gold: str, choices: Sequence[str] | None, n: int) -> int | None:
    """Option index of the gold: the capital letter it is (the ``ncgrpo.data`` convention for
    choice questions), else the option whose text it is (Geometry3K keeps the option text)."""
    g = _normalize(gold)
    m = _LETTER_ONLY_RE.fullmatch(g)
    if m and m.group(1).isupper() and LETTERS.index(m.group(1)) < n:
        return LETTERS.index(m.group(1))
    for i, option in enumerate(choices or ()):
        if _key(_normalize(option)) == _key(g):
            return i
    return None


def _grade_choice(pred: str, gi: int, choices: tuple[str, ...] | None, n: int) -> bool:
    """The prediction names option ``gi`` and no other: by letter (any text after the letter must
    be that option's text), or by the option's text alone. "(A) or (B)" names two: wrong."""
    named = _choice_letter(pred, choices, n)
    if named is not None:
        idx, rest = named
        if idx != gi:
            return False
        if not rest:
            return True
        if choices:
            return _names_only(_options_named(rest, choices), gi, choices)
        return _OTHER_LETTER_RE.search(rest) is None
    if choices:
        return _names_only(_options_named(pred, choices), gi, choices)
    return False


def _names_only(named: set[int], gi: int, choices: Sequence[str]) -> bool:
    """``named`` is option ``gi`` alone, or copies of its text (MathVista repeats some options)."""
    return gi in named and len({_key(_normalize(choices[i])) for i in named}) == 1


_CACHE_MAX_CHARS = 512  # pred + gold longer than this are graded uncached


@lru_cache(maxsize=65536)  # GRPO grades the same short answers against the same gold many times
def _grade_cached(pred: str, gold: str, choices: tuple[str, ...] | None, answer_type: str) -> bool:
    if (
        answer_type == "choice"
        or choices
        or (answer_type == "free" and re.fullmatch(r"\(?[A-E]\)?", gold.strip()))
    ):
        n = len(choices) if choices else 5
        gi = _gold_index(gold, choices, n)
        if gi is not None:
            return _grade_choice(pred, gi, choices, n)
    if answer_type == "yesno" or _key(_normalize(gold)) in ("yes", "no"):
        gold_yn = _yes_no(gold)
        if gold_yn is not None:
            return _yes_no(pred) == gold_yn
    return _grade_free(pred, gold)


def grade(
    pred: str | None,
    gold: str,
    *,
    choices: Sequence[str] | None = None,
    answer_type: str = "free",
    grader: str = "ncgrpo",
) -> bool:
    """Whether the predicted answer ``pred`` equals the gold ``y*`` (Algorithm 1 line 9's ``=``).

    ``choices`` is the option list of a multiple-choice question (index 0 = A); ``answer_type`` is
    one of :data:`ANSWER_TYPES` (``ncgrpo.data.types.AnswerType``); unknown values act as "free".
    ``grader="mathruler"`` is NoisyRollout's ``mathruler.grader.grade_answer(pred, gold)`` instead
    (``choices``/``answer_type`` unused, as in theirs). Never raises on any text; ``None`` (no box)
    is never correct; an unknown ``grader`` is a ValueError.
    """
    _check_grader(grader)
    if grader == "mathruler":
        _mathruler()  # a missing package is an error, not a wrong answer
    try:
        if pred is None or gold is None:
            return False
        if grader == "mathruler":
            return _mathruler_grade(str(pred), str(gold))
        pred, gold = str(pred), str(gold)
        opts = tuple(str(c) for c in choices) if choices else None
        kind = answer_type if answer_type in ANSWER_TYPES else "free"
        if len(pred) + len(gold) > _CACHE_MAX_CHARS:  # keep the cache's memory bounded
            return _grade_cached.__wrapped__(pred, gold, opts, kind)
        return _grade_cached(pred, gold, opts, kind)
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# NoisyRollout's grader (mathruler 0.1.0: extract_boxed_content + grade_answer), for comparison


def _check_grader(grader: str) -> None:
    if grader not in GRADERS:
        raise ValueError(f"grader must be one of {GRADERS}, got {grader!r}")


def _mathruler():
    try:
        from mathruler import grader as mathruler_grader
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "grader='mathruler' needs the mathruler package (NoisyRollout's grader): "
            "pip install 'mathruler==0.1.0'"
        ) from exc
    return mathruler_grader


def _mathruler_grade(pred: str, gold: str) -> bool:
    try:
        return bool(_mathruler().grade_answer(pred, gold))
    except Exception:  # NoisyRollout's training would crash here; a wrong answer is the safe reading
        return False


def score(
    output: str,
    gold: str,
    *,
    choices: Sequence[str] | None = None,
    answer_type: str = "free",
    grader: str = "ncgrpo",
) -> Score:
    """Algorithm 1 line 9 for one output: ``Score(extract(o), 1[extract(o) = y*])``.

    The training reward and ``ncgrpo eval`` both call this. ``grader="mathruler"`` reproduces
    NoisyRollout's accuracy exactly: ``grade_answer(extract_boxed_content(output), gold)``.
    Never raises on any text (an unknown ``grader`` is a ValueError).
    """
    _check_grader(grader)
    if grader == "mathruler":
        mr = _mathruler()
        try:
            content = mr.extract_boxed_content(output)
        except Exception:
            return Score(None, False)
        extracted = None if content == "None" and "\\boxed{None}" not in output else content
        return Score(extracted, grade(content, gold, grader="mathruler"))
    extracted = extract_boxed(output)
    return Score(extracted, grade(extracted, gold, choices=choices, answer_type=answer_type))


def format_ok(output: str) -> bool:
    """NoisyRollout's format check: ``re.fullmatch(FORMAT_PATTERN, output)`` on the raw output, so
    a completion that starts with a newline or with text before ``<think>`` gets no format score."""
    try:
        return isinstance(output, str) and FORMAT_PATTERN.fullmatch(output) is not None
    except Exception:
        return False
