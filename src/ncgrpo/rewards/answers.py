"""Reading an answer: ``extract(o_i)`` (:func:`extract_boxed`), the normalisation and the symbolic stage
(math-verify) that :func:`ncgrpo.rewards.grade` compares answers with (the rules are in :mod:`ncgrpo.rewards`)."""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

#: Closed forms evaluated by sympy are "equal" within this relative error (float round-off only).
EXACT_RTOL = 1e-9
#: Imaginary parts below this (relative) count as zero when a closed form is evaluated.
ABS_TOL = 1e-6


#: Seconds math-verify may spend per parse / comparison (main thread only; see module docstring).
SYMBOLIC_TIMEOUT_S = 3
#: Longest normalised answer handed to the symbolic grader; longer ones compare as strings only.
SYMBOLIC_MAX_CHARS = 200


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
_MATH_THOUSANDS_RE = re.compile(r",\s*\\!\s*(?=\d)")
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
    s = _MATH_THOUSANDS_RE.sub(",", s)  # MATH writes 10,\!080
    # a LaTeX row break "\\" (matrices) is no spacing command "\ ": kept aside while spacing goes
    s = _SPACING_RE.sub(" ", s.replace("\\\\", "\x00")).replace("\x00", "\\\\")
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
# Structured answers: matrices, tuples and intervals, lists (compared entry by entry)

_MATRIX_RE = re.compile(
    r"(?P<open>[(\[]?)\s*\\begin\s*\{(?P<env>[pbBvV]?matrix|smallmatrix|array)\}"
    r"(?:\s*\{[^{}]*\})?(?P<body>.*)\\end\s*\{(?P=env)\}\s*(?P<close>[)\]]?)",
    re.DOTALL,
)
#: Matrix environments by what they denote: brackets are presentation, bars are not (a determinant).
_MATRIX_KINDS = {"vmatrix": "det", "Vmatrix": "norm"}
_OPENERS, _CLOSERS = "([{", ")]}"


@dataclass(frozen=True)
class _Matrix:
    """A matrix as written: its kind (``matrix``, ``det`` for ``vmatrix``, ``norm``) and its rows."""

    kind: str
    rows: tuple[tuple[str, ...], ...]


def _matrix(s: str) -> _Matrix | None:
    """``\\begin{pmatrix}a & b\\\\c & d\\end{pmatrix}`` (also bmatrix, Bmatrix, matrix, smallmatrix,
    an ``array`` in brackets; vmatrix/Vmatrix are another kind) as its rows of entries; else None."""
    m = _MATRIX_RE.fullmatch(s.strip())
    if m is None:
        return None
    env, opening, closing = m.group("env"), m.group("open"), m.group("close")
    if env == "array" and (opening + closing) not in ("()", "[]"):
        return None  # an array without brackets is a table, not a matrix
    if env != "array" and (opening or closing):
        return None
    lines = [line.strip() for line in m.group("body").split("\\\\")]
    while lines and not lines[-1]:
        lines.pop()  # a row break after the last row
    if not lines or "\\begin" in m.group("body"):
        return None
    rows = tuple(tuple(e.strip() for e in line.split("&")) for line in lines)
    return _Matrix(_MATRIX_KINDS.get(env, "matrix"), rows)


def _split_top(s: str, sep: str = ",") -> list[str]:
    """``s`` split at each ``sep`` outside brackets (``()``, ``[]``, ``{}``); escaped ``\\{`` counts too."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        if c in _OPENERS:
            depth += 1
        elif c in _CLOSERS:
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
        i += 1
    parts.append(s[start:].strip())
    return parts


def _enclosed(s: str) -> bool:
    """The bracket that opens ``s`` closes only at its end (``(1,2)``, not ``(0,9)\\cup(9,36)``)."""
    depth = 0
    for i, c in enumerate(s):
        if c in _OPENERS:
            depth += 1
        elif c in _CLOSERS:
            depth -= 1
            if depth == 0 and i < len(s) - 1:
                return False
    return depth == 0


@dataclass(frozen=True)
class _Sequence:
    """A tuple or interval (``brackets`` its opening and closing bracket, ``(]`` for a half-open
    interval) or, with ``brackets=""``, a bare list of answers (``1, -2``: all solutions)."""

    brackets: str
    entries: tuple[str, ...]


def _sequence(s: str) -> _Sequence | None:
    """``(a, b)``, ``[a, b)``, ... (two entries or more) or a bare list ``a, b``; None otherwise."""
    s = s.strip()
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _enclosed(s):
        entries = _split_top(s[1:-1])
        if len(entries) >= 2 and all(entries):
            return _Sequence(s[0] + s[-1], tuple(entries))
        return None
    entries = _split_top(s)
    if len(entries) >= 2 and all(entries):
        return _Sequence("", tuple(entries))
    return None


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
