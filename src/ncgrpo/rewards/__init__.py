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
4. structured golds, entry by entry with rule 3 (issue 44): a matrix (``pmatrix``, ``bmatrix``,
   ``matrix``, an ``array`` in brackets alike, spaces or none) needs a matrix of the same shape
   (a ``vmatrix``, a tuple or another shape is wrong); a tuple or interval the same brackets and its
   entries in order (``(3,4)`` is not ``(3,4]``); a bare list of math answers (``1,-2``: all the
   solutions) the same answers in any order, bare or as a set ``\\{...\\}``; a number in a base
   (``4210_{5}``) the same digits and, where the prediction writes one, the same base.

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

from ncgrpo.rewards.answers import ABS_TOL, EXACT_RTOL, SYMBOLIC_MAX_CHARS, SYMBOLIC_TIMEOUT_S, extract_boxed
from ncgrpo.rewards.functions import (
    ACCURACY_WEIGHT,
    FORMAT_WEIGHT,
    accuracy_reward,
    completion_text,
    format_reward,
    make_math_reward,
    math_reward,
    math_reward_mathruler,
)
from ncgrpo.rewards.grading import ANSWER_TYPES, FORMAT_PATTERN, GRADERS, Score, format_ok, grade, score

__all__ = [
    "ABS_TOL",
    "ACCURACY_WEIGHT",
    "ANSWER_TYPES",
    "EXACT_RTOL",
    "FORMAT_PATTERN",
    "FORMAT_WEIGHT",
    "GRADERS",
    "SYMBOLIC_MAX_CHARS",
    "SYMBOLIC_TIMEOUT_S",
    "Score",
    "accuracy_reward",
    "completion_text",
    "extract_boxed",
    "format_ok",
    "format_reward",
    "grade",
    "make_math_reward",
    "math_reward",
    "math_reward_mathruler",
    "score",
]
