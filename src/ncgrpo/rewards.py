"""The one rule-based scorer: training rewards and evaluation call the same functions.

Paper, Algorithm 1 line 9: ``r_i = 1[extract(o_i) = y*]``. Here ``extract`` is :func:`extract_boxed`
(content of the LAST ``\\boxed{...}``), ``=`` is :func:`grade`, and :func:`score` composes the two;
``ncgrpo eval`` calls :func:`score` and the TRL reward :func:`accuracy_reward` calls it too, so the
training reward and the evaluation metric cannot drift. :func:`math_reward` is NoisyRollout's
shaped reward ``0.9 * accuracy + 0.1 * format`` (anchors.md), the one the GRPO recipes train on.

Grading rules (what counts as ``=``), in the order :func:`grade` tries them. They are meant to be
un-gameable: an answer that names two answers, or a value the gold does not state, is wrong.

1. multiple choice (``answer_type="choice"``, a ``choices`` list, or a bare gold letter A-E): the
   gold names an option by its capital letter (the ``ncgrpo.data`` convention, the letter of the
   option's POSITION) or, failing that, by its text (Geometry3K). The prediction must name that
   option and no other: by letter ("B", "(B)", "B.", "Option B"), where any text after the letter
   must be that option's text ("B: 2\\sqrt{3}"); or by the option's text alone, where an option
   spelled exactly wins over one equal by arithmetic ("0.2 - 0.4" is not "0.0 - 0.2"; "2" is not
   "2√{3}"). Hedges ("(A) or (B)", "A, B") are wrong. A capital is always the position letter; a
   lowercase one ("b", "(b)") is a letter unless an option's text is that letter (MathVista has
   options "(c)", "(a)", "(e)", ...): then it names that option by its text.
2. yes/no (``answer_type="yesno"`` or a gold of yes/no): the leading yes/no word of the prediction,
   case-insensitive ("Yes.", "\\text{No}", "no, because ..."); an answer with both words ("Yes or
   No", "yes/no") is wrong.
3. everything else: both sides are normalised (``$``, ``\\text{}``, ``\\dfrac``, ``\\left(``/``\\right)``,
   degrees, units after a number, thousands commas, trailing period, the radical as
   ``\\sqrt{}``/``√{}``/``√3``, an ``x = `` or "The answer is" prefix) and compared as strings;
   relations side by side; then as numbers TO THE PRECISION THE GOLD STATES: integers and fractions
   exactly (``15018`` is not ``15017``, ``0.333`` is not ``1/3``), a decimal with d decimals accepts
   what rounds to it (``1.449`` for ``1.45``, not ``1.4`` or ``1.48``); arithmetic of integers and
   fractions (a mixed number ``2\\frac{1}{2}`` = 5/2, a nested ``\\frac``, a number in parentheses)
   by its exact value; closed forms (``2\\sqrt{3}``, ``4\\pi``) by exact value (float round-off only),
   so a decimal approximation of a surd is wrong (``3.4641`` is not ``2\\sqrt{3}``); expressions with
   variables symbolically with ``math-verify``. Ranges, orders and ratios of plain numbers
   ("0.2 - 0.4", "5-4-3-2-1", "1:2") and text ("plants increase") are compared as written only
   (a gold ``a/b`` is the fraction).

Degrees and radians are not converted (``30^\\circ`` matches ``30``, not ``\\frac{\\pi}{6}``).
Units are presentation and are ignored (``12 cm`` matches ``12``; so does ``12 cm^3``).

``grader="mathruler"`` (:func:`score`, :func:`grade`, :func:`make_math_reward`) replaces all of the
above by NoisyRollout's grader, the ``mathruler`` package's ``grade_answer(extract_boxed_content(o),
gold)``, to compare with their numbers; it needs ``pip install mathruler``.

Nothing here raises on any input text: :func:`grade`, :func:`score`, :func:`extract_boxed` and the
reward functions turn every internal failure into "not correct". ``math-verify`` guards its sympy
calls with ``signal.alarm``, which only works in the main thread; off the main thread we pass no
timeout and instead keep inputs that could make sympy hang (huge exponents, factorials, very long
strings) away from it.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from ncgrpo.data.types import LETTERS

#: NoisyRollout's reward weights (anchors.md): ``0.9 * accuracy + 0.1 * format``.
FORMAT_WEIGHT = 0.1
ACCURACY_WEIGHT = 1.0 - FORMAT_WEIGHT  # 0.9

#: Closed forms evaluated by sympy are "equal" within this relative error (float round-off only).
EXACT_RTOL = 1e-9
#: Imaginary parts below this (relative) count as zero when a closed form is evaluated.
ABS_TOL = 1e-6

#: ``"ncgrpo"``: the rules in this module; ``"mathruler"``: NoisyRollout's ``grade_answer``.
GRADERS = ("ncgrpo", "mathruler")

#: NoisyRollout / verl ``geo3k`` format check, applied with ``re.fullmatch`` to the raw output.
FORMAT_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)

#: Seconds math-verify may spend per parse / comparison (main thread only; see module docstring).
SYMBOLIC_TIMEOUT_S = 3
#: Longest normalised answer handed to the symbolic grader; longer ones compare as strings only.
SYMBOLIC_MAX_CHARS = 200

ANSWER_TYPES = ("choice", "yesno", "number", "free")


@dataclass(frozen=True)
class Score:
    """What evaluation records per question: the extracted answer and whether it is correct."""

    extracted: str | None
    correct: bool


# ---------------------------------------------------------------------------------------------
# extract(o_i)


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, stripped.

    Braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; escaped ``\\{``/``\\}`` do not count).
    ``\\boxed 5`` without braces gives its next token. ``None`` when there is no box, or when the
    last box never closes (a response cut off mid-answer has no answer, as in ``mathruler``);
    ``""`` for an empty box.
    """
    try:
        if not isinstance(text, str):
            return None
        last = None
        for m in _BOX_RE.finditer(text):
            last = m
        if last is None:
            return None
        i, n = last.end(), len(text)
        while i < n and text[i] in " \t":
            i += 1
        if i >= n:
            return None
        if text[i] != "{":
            token = re.match(r"[^\s$]+", text[i:])
            return token.group(0) if token else None
        depth, j = 0, i
        while j < n:
            c = text[j]
            if c == "\\":
                j += 2  # escaped character: \{ and \} are literal braces
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j].strip()
            j += 1
        return None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Normalisation (thin layer over math-verify: the forms it does not handle, or handles slowly)

_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mathsf|mbox|operatorname|emph)"
    r"\s*\{([^{}]*)\}"
)
_SPACING_RE = re.compile(r"\\[,;:!> ]|\\q?quad(?![A-Za-z])|~")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\(?:circ|degree)(?![A-Za-z])|°|º|掳")  # 掳: ° mis-decoded
_RADICAL_BRACED_RE = re.compile(r"√\s*\{")
_RADICAL_BARE_RE = re.compile(r"√\s*(\d+(?:\.\d+)?|[A-Za-z])")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")
_UNIT_WORDS = (
    r"(?:(?:square|sq\.?|cubic)\s*)?"
    r"(?:units?|cm|mm|km|in|inch(?:es)?|ft|feet|foot|yd|yards?|mi|miles?|"
    r"(?:centi|milli|kilo)?met(?:er|re)s?|degrees?|deg|radians?|rad|seconds?|minutes?|hours?|"
    r"days?|years?|kg|grams?|g|liters?|litres?|ml|percent)"
)
_UNIT_RE = re.compile(
    rf"(?P<val>.*?(?:[\d}})]|\\pi))\s*{_UNIT_WORDS}(?:\s*(?:\^\s*\{{?\s*[23]\s*\}}?|²|³))?",
    re.IGNORECASE,
)
_METRE_RE = re.compile(r"(?P<val>.*?(?:[\d})]|\\pi))\s+m(?:\s*(?:\^\s*\{?\s*[23]\s*\}?|²|³))?")
# "The answer is 5", "Final answer: B": the sentence around an answer is presentation.
_ANSWER_PREFIX_RE = re.compile(
    r"(?:the\s+)?(?:final\s+|correct\s+)?answer\s*(?:is\b\s*:?|:)\s*", re.IGNORECASE
)
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_NUM_RE = re.compile(_NUM)
_FRAC_NUM_RE = re.compile(rf"([-+]?)\\frac\{{({_NUM})\}}\{{({_NUM})\}}")
_SLASH_NUM_RE = re.compile(rf"({_NUM})/({_NUM})")


def _normalize(s: str) -> str:
    """Strip presentation from an answer string; keeps LaTeX math that sympy can read."""
    s = s.replace("\x0c", "\\f").strip()  # "\frac" read from JSON with "\f" as a form feed (MathVision)
    if "\\boxed" in s or "\\fbox" in s:
        inner = extract_boxed(s)
        if inner is not None:
            s = inner
    s = s.replace("\u2212", "-").replace("\\$", "").replace("$", "")
    s = _RADICAL_BRACED_RE.sub(r"\\sqrt{", s)  # MathVista/MathVerse write 2√{3}; also √3, √x
    s = _RADICAL_BARE_RE.sub(r"\\sqrt{\1}", s)
    s = s.replace("π", "\\pi ")
    s = s.replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    while True:
        t = _TEXT_CMD_RE.sub(r"\1", s)
        if t == s:
            break
        s = t
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _SPACING_RE.sub(" ", s)
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("{,}", ",")
    s = re.sub(r"(?:\\+\s*)+$", "", s)  # a trailing LaTeX line break "\\" (MathVision options)
    s = re.sub(r"\s+", " ", s).strip().rstrip(".。").strip()
    prefix = _ANSWER_PREFIX_RE.match(s)
    if prefix and prefix.end() < len(s):
        s = s[prefix.end() :]
    for unit_re in (_UNIT_RE, _METRE_RE):
        m = unit_re.fullmatch(s)
        if m:
            s = m.group("val").strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _balanced(s[1:-1]):
        s = s[1:-1].strip()
    return s


def _balanced(s: str, opening: str = "{", closing: str = "}") -> bool:
    depth = 0
    for c in s:
        depth += (c == opening) - (c == closing)
        if depth < 0:
            return False
    return depth == 0


def _key(s: str) -> str:
    """Comparison key for the exact-string rule: no spaces, case-folded."""
    return s.replace(" ", "").casefold()


@dataclass(frozen=True)
class _Literal:
    """An exact number as written: its value and the decimals it states (None: exact, as in 1/3)."""

    value: Fraction
    decimals: int | None


_MAX_EXPONENT = 400  # 1e99999 is "too big to be anyone's answer", not a 100,000-digit integer


def _literal(s: str) -> _Literal | None:
    """A plain number, ``a/b`` or ``\\frac{a}{b}`` as an exact value; None for anything else."""
    s = s.replace(" ", "")
    for _ in range(4):  # (\frac{1}{2}), \left(5\right): parentheses around one number group nothing
        if len(s) > 2 and s[0] == "(" and s[-1] == ")" and "," not in s and _balanced(s[1:-1], "(", ")"):
            s = s[1:-1]
    if _NUM_RE.fullmatch(s):
        mantissa, _, exponent = s.lower().partition("e")
        if exponent and abs(int(exponent)) > _MAX_EXPONENT:
            return None
        decimals = None if exponent else len(mantissa.partition(".")[2])
        return _Literal(Fraction(s), decimals)
    m = _FRAC_NUM_RE.fullmatch(s) or _SLASH_NUM_RE.fullmatch(s)
    if m:
        num, den = (_literal(x) for x in m.groups()[-2:])
        if num is None or den is None or den.value == 0:
            return None
        sign = -1 if m.re is _FRAC_NUM_RE and m.group(1) == "-" else 1
        return _Literal(sign * num.value / den.value, None)
    return None


def _within_stated_precision(pred: Fraction | float, gold: _Literal) -> bool:
    """``pred`` equals ``gold`` to the precision the gold states.

    Integers and fractions are exact (``15017`` is not ``15018``; ``0.333`` is not ``1/3``); a decimal
    with ``d`` decimals accepts what rounds to it at ``d`` decimals (``1.449`` for ``1.45``, not ``1.4``
    or ``1.48``). A float ``pred`` (a closed form evaluated by sympy) is exact to 1e-9 relative.
    """
    if isinstance(pred, float):
        if not math.isfinite(pred):
            return False
        g = float(gold.value)
        slack = EXACT_RTOL * max(1.0, abs(g))
        if gold.decimals:
            slack += 0.5 * 10.0 ** (-gold.decimals)
        return abs(pred - g) <= slack
    if gold.decimals:
        return abs(pred - gold.value) <= Fraction(1, 2 * 10**gold.decimals)
    return pred == gold.value


# Arithmetic of plain numbers that is NOT a value to compute: ranges ("0.2 - 0.4"), orders
# ("5-4-3-2-1"), ratios ("1:2"), sums shown as answers ("2+4+3"). Compared as written.
_LITERAL_EXPRESSION_RE = re.compile(
    rf"{_NUM}(?:\s*(?:[-+*/:×·~–—]|\\cdot|\\times|to)\s*[-+]?{_NUM})+", re.IGNORECASE
)
# Words a formula may contain; any other run of 2+ letters makes an answer text, not math.
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "arcsin", "arccos", "arctan"}


def _is_math(s: str) -> bool:
    words = re.findall(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", " ", s))
    return all(w.lower() in _MATH_WORDS for w in words)


# ---------------------------------------------------------------------------------------------
# Symbolic stage (math-verify)

# Inputs that can make sympy run for minutes (it builds the exact integer of a power tower before
# any timeout can fire): exponents of 3+ digits, of a bracket, or holding a power; chained or
# stacked powers; factorials; big binomials; sums, products, integrals, limits; 40+ digit runs.
_RISKY_RE = re.compile(
    r"\^\s*\{?\s*[-+]?\d{3,}"  # 10^{100}
    r"|\^\s*\("  # 10^(9)
    r"|\^\s*\{[^{}]*\^"  # 10^{10^{10}}
    r"|\^\s*(?:\w+|\{[^{}]*\})\s*\^"  # 9^9^9, 10^{9}^{9}
    r"|\([^()]*\^[^()]*\)\s*\^|\{[^{}]*\^[^{}]*\}\s*\^"  # (9^9)^9, (2^{99})^{99}
    r"|!|\\binom\s*\{?\s*\d{3,}|\\(?:int|sum|prod|lim)(?![A-Za-z])|\d{40,}"
)


def _timeout() -> int | None:
    """math-verify's signal-based timeout works only in the main thread; elsewhere, none."""
    return SYMBOLIC_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(s: str) -> tuple[Any, ...]:
    """math-verify's parse of one answer (sympy objects, then the matched string); () if unsafe."""
    if len(s) > SYMBOLIC_MAX_CHARS or _RISKY_RE.search(s):
        return ()
    return _parse_cached(s)


@lru_cache(maxsize=16384)
def _parse_cached(s: str) -> tuple[Any, ...]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = (LatexExtractionConfig(), ExprExtractionConfig())
    return tuple(parse(f"${s}$", extraction_config=config, parsing_timeout=_timeout()))


def _numeric(expr: Any) -> float | None:
    """Real value of a closed-form sympy number (``2*sqrt(3)``, ``4*pi``); None otherwise."""
    from sympy import Basic

    if not isinstance(expr, Basic) or not expr.is_number:
        return None
    value = complex(expr.evalf(15))
    if abs(value.imag) > ABS_TOL * max(1.0, abs(value.real)):
        return None
    return value.real if math.isfinite(value.real) else None


def _rational(expr: Any) -> Fraction | None:
    """Exact value of arithmetic on integers and fractions (a mixed number ``2\\frac{1}{2}``, a nested
    ``\\frac``), so it is compared exactly, not to float round-off; None for anything else (decimals,
    radicals, pi, variables)."""
    from sympy import Basic, Rational

    if not isinstance(expr, Basic) or not expr.is_number:
        return None
    if not all(isinstance(a, Rational) for a in expr.atoms()):
        return None
    value = expr.doit()
    return Fraction(int(value.p), int(value.q)) if isinstance(value, Rational) else None


def _grade_symbolic(pred: str, gold: str, gold_literal: _Literal | None) -> bool:
    """Closed forms: equal values (exact to 1e-9 relative, so ``3.4641`` is not ``2\\sqrt{3}``), or
    math-verify's symbolic equality for expressions with variables (``x(x+2)`` and ``x^2+2x``)."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed, pred_parsed = _parse(gold), _parse(pred)
        if not gold_parsed or not pred_parsed:
            return False
        if gold_literal is not None:
            exact = _rational(pred_parsed[0])
            if exact is not None:
                return _within_stated_precision(exact, gold_literal)
        pv = _numeric(pred_parsed[0])
        if gold_literal is not None:
            return pv is not None and _within_stated_precision(pv, gold_literal)
        gv = _numeric(gold_parsed[0])
        if gv is not None or pv is not None:
            return gv is not None and pv is not None and abs(pv - gv) <= EXACT_RTOL * max(1.0, abs(gv))
        return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=_timeout()))
    except (Exception, TimeoutException):
        return False


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


# ---------------------------------------------------------------------------------------------
# TRL reward functions: f(prompts, completions, completion_ids=None, **dataset_columns) -> list


def completion_text(completion: Any) -> str:
    """Text of a TRL completion: a string, or conversational ``[{"role": "assistant", "content": ...}]``
    where content is a string or a list of typed parts (``{"type": "text", "text": ...}``)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        return "\n".join(
            _content_text(m.get("content"))
            for m in completion
            if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
        )
    return "" if completion is None else str(completion)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # typed parts; image parts carry no text
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                texts.append(str(part.get("text") or ""))
        return "".join(texts)
    return str(content)


def _row(column: Sequence[Any] | None, i: int) -> Any:
    try:
        return None if column is None else column[i]
    except Exception:
        return None


def _row_choices(column: Sequence[Any] | None, i: int) -> list[str] | None:
    value = _row(column, i)
    if value is None or isinstance(value, (str, bytes, dict)):
        return None
    try:
        return [str(c) for c in value] or None  # a list, tuple or array of options
    except TypeError:
        return None


def _accuracies(completions, answer, choices, answer_type, grader: str = "ncgrpo") -> list[float]:
    for name, col in (("answer", answer), ("choices", choices), ("answer_type", answer_type)):
        if col is not None and not isinstance(col, str) and len(col) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(col)} entries in column {name!r}")
    out = []
    for i, completion in enumerate(completions):
        gold = _row(answer, i)
        kind = _row(answer_type, i) or "free"
        try:
            text = completion_text(completion)
        except Exception:
            text = ""
        correct = (
            gold is not None
            and score(text, gold, choices=_row_choices(choices, i), answer_type=kind, grader=grader).correct
        )
        out.append(1.0 if correct else 0.0)
    return out


def accuracy_reward(completions, answer, choices=None, answer_type=None, **kwargs) -> list[float]:
    """1.0 where the last boxed answer grades equal to ``answer`` (Algorithm 1 line 9), else 0.0."""
    return _accuracies(completions, answer, choices, answer_type)


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the completion matches :data:`FORMAT_PATTERN` (``<think>..</think>..\\boxed{..}``)."""
    out = []
    for completion in completions:
        try:
            out.append(1.0 if format_ok(completion_text(completion)) else 0.0)
        except Exception:
            out.append(0.0)
    return out


def make_math_reward(
    format_weight: float = FORMAT_WEIGHT, grader: str = "ncgrpo"
) -> Callable[..., list[float]]:
    """NoisyRollout's shaped reward ``(1 - w) * accuracy + w * format`` as a TRL reward function.

    ``grader="mathruler"`` grades accuracy exactly as NoisyRollout does (``mathruler``'s
    ``grade_answer`` on ``extract_boxed_content``); the default is this module's rules. TRL logs
    reward functions by ``__name__``: ``math_reward`` for the defaults, ``math_reward_fmt{w}`` for
    another weight, with ``_mathruler`` appended for that grader.
    """
    w = float(format_weight)
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight!r}")
    _check_grader(grader)
    if grader == "mathruler":
        _mathruler()

    def reward(completions, answer, choices=None, answer_type=None, **kwargs) -> list[float]:
        acc = _accuracies(completions, answer, choices, answer_type, grader)
        fmt = format_reward(completions)
        return [(1.0 - w) * a + w * f for a, f in zip(acc, fmt, strict=True)]

    name = "math_reward" if w == FORMAT_WEIGHT else f"math_reward_fmt{w:g}"
    name += "" if grader == "ncgrpo" else f"_{grader}"
    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"{1.0 - w:g} * accuracy + {w:g} * format (NoisyRollout's reward)."
    return reward


#: ``ACCURACY_WEIGHT * accuracy + FORMAT_WEIGHT * format``; the GRPO recipes' reward.
math_reward = make_math_reward(FORMAT_WEIGHT)


@lru_cache(maxsize=1)
def _math_reward_mathruler() -> Callable[..., list[float]]:
    return make_math_reward(FORMAT_WEIGHT, grader="mathruler")


def math_reward_mathruler(completions, answer, choices=None, answer_type=None, **kwargs) -> list[float]:
    """:data:`math_reward` graded exactly as NoisyRollout grades (the ``mathruler`` package, extra
    ``noisyrollout``). Built on first call, so importing this module never needs mathruler."""
    return _math_reward_mathruler()(completions, answer, choices, answer_type, **kwargs)
