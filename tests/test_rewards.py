"""The shared scorer (Algorithm 1 line 9, ``r_i = 1[extract(o_i) = y*]``) and its TRL reward wrappers.

Tables of tricky strings, each row commented with why it is tricky; a property test that nothing
raises on arbitrary text; the TRL reward-function signature with plain and conversational input.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncgrpo.rewards import (
    ACCURACY_WEIGHT,
    FORMAT_WEIGHT,
    Score,
    accuracy_reward,
    extract_boxed,
    format_reward,
    grade,
    make_math_reward,
    math_reward,
    score,
)

# ----------------------------------------------------------------------------------------------
# extract(o)

EXTRACT_CASES = [
    # plain box
    (r"so \boxed{12}.", "12"),
    # nested braces must balance, not stop at the first "}"
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\sqrt{\frac{3}{4}}} units", r"\sqrt{\frac{3}{4}}"),
    # several boxes: the LAST one is the answer
    (r"first \boxed{3}, corrected: \boxed{4}", "4"),
    # no box at all: None, not "" (evaluation records "no answer" distinctly)
    ("The answer is 12.", None),
    # empty box: "" (a box was written, with nothing in it)
    (r"\boxed{}", ""),
    # whitespace inside the box is stripped
    (r"\boxed{  7  }", "7"),
    # escaped braces are literal set braces, not grouping
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    # last box never closes (output truncated): no answer, even though an earlier box closed
    (r"\boxed{3} then \boxed{4", None),
    # brace-less LaTeX form takes the next token
    (r"$\boxed 5$", "5"),
    # \fbox is accepted like \boxed
    (r"\fbox{B}", "B"),
    # \boxedfoo is another command, not a box
    (r"\boxedfoo{1}", None),
    # a box around text
    (r"\boxed{\text{(B)}}", r"\text{(B)}"),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACT_CASES)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# ----------------------------------------------------------------------------------------------
# extract(o) = y*  (free-form and numeric answers)

MATCH = [
    # fraction vs its decimal, both directions
    (r"\frac{1}{2}", "0.5"),
    ("0.5", r"\frac{1}{2}"),
    # \dfrac / \tfrac are display variants of \frac
    (r"\dfrac{3}{4}", "0.75"),
    (r"\tfrac{3}{4}", r"\frac{3}{4}"),
    # \frac12 shorthand (no braces)
    (r"\frac12", "0.5"),
    # unreduced fraction: same value
    (r"\frac{2}{4}", r"\frac{1}{2}"),
    # Geometry3K decimal gold vs fraction prediction
    (r"\frac{17}{2}", "8.5"),
    # plain slash fraction
    ("17/2", "8.5"),
    # units after a number, as text, in \text{}, squared
    ("12 cm", "12"),
    (r"12\text{ cm}", "12"),
    (r"24 \text{ cm}^2", "24"),
    ("36 square units", "36"),
    ("5 m", "5"),
    # degrees: ^\circ, ^{\circ}, the degree sign
    (r"30^\circ", "30"),
    (r"30^{\circ}", "30"),
    ("30°", "30"),
    ("30 degrees", r"30^\circ"),
    # thousands commas (and the {,} LaTeX form)
    ("1,000", "1000"),
    ("1{,}234.5", "1234.5"),
    # trailing period, surrounding $...$
    ("12.", "12"),
    ("$12$", "12"),
    # negative numbers, with the unicode minus sign
    ("-5", "-5"),
    ("\u22125", "-5"),
    (r"-\frac{1}{2}", "-0.5"),
    # integer gold, decimal prediction of the same value
    ("12.0", "12"),
    # a decimal gold accepts what rounds to it at the decimals it states (issue 13)
    ("1.449", "1.45"),
    ("1.4547", "1.45"),
    ("48211.54", "48211.5"),
    # ... and a value of a closed form that rounds to it (Geometry3K golds are rounded decimals)
    (r"\sqrt{31}", "5.6"),
    # an exact fraction gold: an exact decimal of it
    ("0.25", r"\frac{1}{4}"),
    # scientific notation
    ("2e3", "2000"),
    # percent sign is presentation
    (r"50\%", "50"),
    # "x = 5" / "AB \approx 3.46": the value after the last = or \approx
    ("x = 5", "5"),
    # relations: side by side, each side by the usual rules
    ("y = 1 + 2x", "y=2x+1"),
    (r"AB \approx 8.5", "8.5"),
    # surds: equal forms graded symbolically
    (r"2\sqrt 3", r"2\sqrt{3}"),
    (r"\sqrt{12}", r"2\sqrt{3}"),
    (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}"),
    # the radical in every notation the benchmarks use: \sqrt{3}, \sqrt 3, √{3} (MathVista), √3
    (r"2\sqrt{3}", "2√{3}"),
    ("2√3", r"2\sqrt{3}"),
    (r"90\sqrt{2}", "90√{2}m"),
    ("4π", r"4\pi"),
    # MathVision stores some \frac with "\f" read as a form feed
    (r"\frac{36}{13}", "\x0crac{36}{13}"),
    # MathVerse's mis-decoded degree sign (掳)
    ("118", "118掳"),
    # pi written with a space
    (r"4 \pi", r"4\pi"),
    # symbolic identity
    ("x^2+2x", "x(x+2)"),
    # free text: case and spacing do not matter
    (r"\text{Triangle ABC}", "triangle ABC"),
    # a boxed gold is unwrapped
    ("7", r"\boxed{7}"),
    # tuples: spacing
    ("(1,2)", "(1, 2)"),
    # long prediction: graded outside the cache, same rules
    (" " * 600 + "12 cm", "12"),
]

NO_MATCH = [
    # decimal point in the wrong place
    ("12", "1.2"),
    # sign matters
    ("5", "-5"),
    # integers are exact, however large (relative tolerance once accepted these; issue 13)
    ("1001", "1000"),
    ("27014", "27013"),
    ("300000001", "300000000"),
    ("1000.01", "1000"),
    ("0.0000001", "0"),
    # a decimal gold: 1 and 3 units of its last stated digit, and fewer digits, are wrong
    ("48211.8", "48211.5"),
    ("5311.5", "5311.4"),
    ("1.4", "1.45"),
    ("5311", "5311.4"),
    # an exact fraction: a rounded decimal is not it
    ("0.333", r"\frac{1}{3}"),
    # decimals of an exact closed form are not it, however many digits (issue 9: a policy could
    # learn to box approximations); the gold states an exact value
    ("1.732", r"\sqrt{3}"),
    ("1.73", r"\sqrt{3}"),
    ("3.4641", r"2\sqrt{3}"),
    ("12.566", r"4\pi"),
    # a radical dropped or changed, in the benchmarks' notation
    ("2", "2√{3}"),
    ("90m", "90√{2}m"),
    ("2√{2}", r"2\sqrt{3}"),
    # an inverted fraction
    (r"\frac{13}{36}", r"\frac{36}{13}"),
    ("3/7", "7/3"),
    # ranges are not subtractions: 0.5 - 1.0 and 0.0 - 0.5 are both "-0.5" as arithmetic
    ("0.5 - 1.0", "0.0 - 0.5"),
    ("4-1-3-2", "4-3-2-1"),
    # text differing in one word is different text, not two symbols that "simplify" alike
    (
        "The number of foxes in the wood would rise.",
        "The number of foxes in the wood would fall.",
    ),
    ("trees shrink", "trees grow"),
    # hedges: two answers are no answer
    ("3 or 4", "3"),
    # a chain of equalities is compared side by side, not by its last part
    ("a_1=(t+2)^2=b(t+1)", "a_1=(t+1)^2=b(t+1)"),
    # surd vs a different surd
    (r"3\sqrt{2}", r"2\sqrt{3}"),
    # degrees and radians are not converted
    (r"\frac{\pi}{6}", r"30^\circ"),
    # empty box is never correct
    ("", "12"),
    ("", ""),
    # division by zero does not equal anything finite
    (r"\frac{1}{0}", "1"),
    # overflowing literals
    ("1e99999", "5"),
    # a unit does not rescue a wrong number
    ("13 cm", "12"),
    # a thousands comma is not a decimal point
    ("1,000", "1"),
    # text vs different text
    ("triangle", "square"),
]


@pytest.mark.parametrize(("pred", "gold"), MATCH)
def test_grade_matches(pred, gold):
    assert grade(pred, gold) is True


@pytest.mark.parametrize(("pred", "gold"), NO_MATCH)
def test_grade_rejects(pred, gold):
    assert grade(pred, gold) is False


def test_none_prediction_is_never_correct():
    # None means "no box was written": wrong whatever the gold
    assert grade(None, "12") is False
    assert grade(None, "") is False


# ----------------------------------------------------------------------------------------------
# multiple choice

OPTIONS = ["20", r"2\sqrt{3}", "40", "45"]

CHOICE_CASES = [
    # (pred, gold, choices, answer_type, expected)
    # gold letter vs predicted letter in its usual spellings
    ("B", "B", OPTIONS, "choice", True),
    ("(B)", "B", OPTIONS, "choice", True),
    ("B.", "B", OPTIONS, "choice", True),
    (r"B: 2\sqrt{3}", "B", OPTIONS, "choice", True),
    (r"(B) 2\sqrt{3}", "B", OPTIONS, "choice", True),
    ("Option B", "B", OPTIONS, "choice", True),
    (r"\text{B}", "B", OPTIONS, "choice", True),
    ("b", "B", OPTIONS, "choice", True),
    # the letter decides even if the text after it is another option's
    ("C: 40", "B", OPTIONS, "choice", False),
    # wrong letter
    ("C", "B", OPTIONS, "choice", False),
    # a letter beyond the option list names nothing
    ("E", "B", OPTIONS, "choice", False),
    # the option text of the gold letter, in an equal form
    (r"2\sqrt{3}", "B", OPTIONS, "choice", True),
    (r"\sqrt{12}", "B", OPTIONS, "choice", True),
    # ... but not a decimal approximation of it (issue 9)
    ("3.4641", "B", OPTIONS, "choice", False),
    # hedges name two options: wrong (issue 9)
    ("(B) or (C)", "B", OPTIONS, "choice", False),
    ("B or C", "B", OPTIONS, "choice", False),
    ("B, C", "B", OPTIONS, "choice", False),
    (r"\text{(B) or (C)}", "B", OPTIONS, "choice", False),
    ("(B) or (C)", "B", None, "choice", False),
    # a letter with text that is not the lettered option's text is not that option
    ("B. 40", "B", OPTIONS, "choice", False),
    # by text, an option named exactly beats one equal by arithmetic; a radical never drops out
    ("2", "B", ["2", "2√{3}", "4"], "choice", False),
    ("2√{3}", "B", ["2", "2√{3}", "4"], "choice", True),
    (r"2\sqrt{3}", "B", ["2", "2√{3}", "4"], "choice", True),
    ("0.5 - 1.0", "A", ["0.0 - 0.5", "0.5 - 1.0", "1.0 - 1.5"], "choice", False),
    ("0.0 - 0.5", "A", ["0.0 - 0.5", "0.5 - 1.0", "1.0 - 1.5"], "choice", True),
    # options differing in one word
    ("trees grow", "A", ["trees shrink", "trees grow"], "choice", False),
    ("trees shrink", "A", ["trees shrink", "trees grow"], "choice", True),
    # options that look like letters: the gold is the letter of the position ("(c)" is option A)
    ("A", "A", ["(c)", "(a)", "(b)"], "choice", True),
    ("C", "A", ["(c)", "(a)", "(b)"], "choice", False),
    # another option's text
    ("40", "B", OPTIONS, "choice", False),
    # Geometry3K style: the gold is the option text; the prediction gives the letter
    ("B", r"2\sqrt{3}", OPTIONS, "choice", True),
    ("A", r"2\sqrt{3}", OPTIONS, "choice", False),
    # ... or the text itself (answer_type left "free": choices alone switch choice mode on)
    (r"2\sqrt{3}", r"2\sqrt{3}", OPTIONS, "free", True),
    # no option list: a bare gold letter A-E still grades letters
    ("(C)", "C", None, "free", True),
    ("C.", "C", None, "choice", True),
    ("D", "C", None, "choice", False),
    # yes/no asked as multiple choice: the letter, or the option's text with yes/no leniency
    ("B", "No", ["Yes", "No"], "choice", True),
    ("No, they differ", "B", ["Yes", "No"], "choice", True),
    ("Yes", "B", ["Yes", "No"], "choice", False),
    # AI2D: the options are themselves letters; a capital gold is the LETTER of the option, so
    # gold "B" is the option "D"; a capital prediction is a letter, a lowercase one that is an
    # option's text is that text
    ("B", "B", ["c", "D", "b", "a"], "choice", True),
    ("(B) D", "B", ["c", "D", "b", "a"], "choice", True),
    ("D", "B", ["c", "D", "b", "a"], "choice", False),
    ("b", "B", ["c", "D", "b", "a"], "choice", False),
    ("b", "C", ["c", "D", "b", "a"], "choice", True),
    # a sentence that starts with a capital is not a letter answer
    ("I think 20", "A", OPTIONS, "choice", False),
]


@pytest.mark.parametrize(("pred", "gold", "choices", "answer_type", "expected"), CHOICE_CASES)
def test_grade_choice(pred, gold, choices, answer_type, expected):
    assert grade(pred, gold, choices=choices, answer_type=answer_type) is expected


# ----------------------------------------------------------------------------------------------
# yes / no

YESNO_CASES = [
    # (pred, gold, answer_type, expected)
    ("yes", "yes", "yesno", True),
    # case and trailing punctuation
    ("Yes.", "yes", "yesno", True),
    ("YES", "Yes", "free", True),
    # a justification after the word
    ("No, the lines are parallel", "no", "yesno", True),
    # wrapped in \text{}
    (r"\text{No}", "No", "yesno", True),
    # the opposite word
    ("yes", "no", "yesno", False),
    ("no", "yes", "free", False),
    # "not"/"none"/"noun" are not "no"
    ("not sure", "no", "yesno", False),
    ("None", "no", "yesno", False),
    # a non-answer
    ("maybe", "yes", "yesno", False),
    # hedges: both words is no answer (issue 9)
    ("Yes or No", "yes", "yesno", False),
    ("yes/no", "no", "yesno", False),
    (r"\text{Yes or No}", "yes", "free", False),
]


@pytest.mark.parametrize(("pred", "gold", "answer_type", "expected"), YESNO_CASES)
def test_grade_yesno(pred, gold, answer_type, expected):
    assert grade(pred, gold, answer_type=answer_type) is expected


# ----------------------------------------------------------------------------------------------
# issue 25: correct forms the strictness work rejected, and the near misses that must stay wrong

# Options whose text is itself a lowercase letter in parentheses (MathVista has two such rows);
# our own arrangement: the option at position D reads "(b)", the one at B reads "(c)".
LETTER_TEXTS = ["(d)", "(c)", "(a)", "(b)"]

RIGHT_FORMS = [
    # (pred, gold, choices, answer_type)
    # \left( ... \right) around the value; the gold written a/b
    (r"\left(\frac{1}{2}\right)", "1/2", None, "free"),
    (r"(\frac{1}{2})", "1/2", None, "free"),
    # a mixed number is its value (2 1/2 = 5/2), as math-verify reads it
    (r"2\frac{1}{2}", "5/2", None, "free"),
    (r"-2\frac{1}{2}", "-5/2", None, "free"),
    (r"3\frac{1}{4}", "13/4", None, "number"),
    # a nested \frac
    (r"\frac{1}{\frac{4}{1}}", "1/4", None, "free"),
    (r"\frac{\frac{1}{2}}{2}", "1/4", None, "number"),
    # a sentence that states the answer: "The answer is" is presentation
    (r"\text{The answer is } 5", "5", None, "free"),
    ("The answer is 12 cm.", "12", None, "number"),
    (r"\text{The final answer is: } \frac{1}{2}", "0.5", None, "free"),
    ("The answer is yes", "yes", None, "yesno"),
    ("The answer is (B)", "B", OPTIONS, "choice"),
    # an option whose text is a lowercase letter is named by that text, in any of its spellings
    ("(b)", "D", LETTER_TEXTS, "choice"),
    ("b", "D", LETTER_TEXTS, "choice"),
    (r"\text{(b)}", "D", LETTER_TEXTS, "choice"),
    ("The answer is (b)", "D", LETTER_TEXTS, "choice"),
]

STILL_WRONG = [
    # (pred, gold, choices, answer_type)
    # another value in the same dress
    (r"\left(\frac{1}{3}\right)", "1/2", None, "free"),
    (r"\left(\frac{2}{1}\right)", "1/2", None, "free"),
    # an exact fraction: a rounded decimal is not it, in parentheses either
    (r"\left(0.333\right)", "1/3", None, "free"),
    ("(0.3333333333)", "1/3", None, "free"),
    # integers are exact in parentheses too (a float comparison would take 1 in 3e9)
    ("(3000000001)", "3000000000", None, "number"),
    # a fraction that is off by far less than float round-off is still another number
    (r"\frac{1}{2}+10^{-12}", "1/2", None, "free"),
    # a mixed number is not the product, nor another mixed number
    (r"2\frac{1}{2}", "1", None, "free"),
    (r"2\frac{1}{3}", "5/2", None, "free"),
    # a nested \frac upside down
    (r"\frac{\frac{4}{1}}{1}", "1/4", None, "free"),
    # ratios, ranges and sums of plain numbers are compared as written, even against a/b
    ("1:2", "1/2", None, "free"),
    ("3-2.5", "1/2", None, "free"),
    # several answers
    (r"\frac{1}{2}, \frac{1}{4}", "1/2", None, "free"),
    (r"\frac{1}{2} \text{ or } \frac{1}{4}", "1/2", None, "free"),
    # the sentence does not rescue a wrong answer or a hedge
    (r"\text{The answer is } 6", "5", None, "free"),
    ("The answer is 5 or 6", "5", None, "free"),
    ("The answer is 5, 6", "5", None, "free"),
    ("The answer is yes or no", "yes", None, "yesno"),
    ("The answer is no", "yes", None, "yesno"),
    ("The answer is (B) or (C)", "B", OPTIONS, "choice"),
    ("The answer is C", "B", OPTIONS, "choice"),
    # letter-like option texts: a capital is the position letter (B reads "(c)")...
    ("B", "D", LETTER_TEXTS, "choice"),
    ("(B)", "D", LETTER_TEXTS, "choice"),
    # ... and a lowercase letter that is an option's text names that option, not the position
    ("(c)", "D", LETTER_TEXTS, "choice"),
    ("c", "D", LETTER_TEXTS, "choice"),
    ("(d)", "D", LETTER_TEXTS, "choice"),
    ("The answer is (c)", "D", LETTER_TEXTS, "choice"),
    # a letter with another option's text, and hedges
    ("D. (a)", "D", LETTER_TEXTS, "choice"),
    ("(b) or (c)", "D", LETTER_TEXTS, "choice"),
    ("(b), (c)", "D", LETTER_TEXTS, "choice"),
    ("(b) (c)", "D", LETTER_TEXTS, "choice"),
]


@pytest.mark.parametrize(("pred", "gold", "choices", "answer_type"), RIGHT_FORMS)
def test_right_forms_are_accepted(pred, gold, choices, answer_type):
    assert grade(pred, gold, choices=choices, answer_type=answer_type) is True


@pytest.mark.parametrize(("pred", "gold", "choices", "answer_type"), STILL_WRONG)
def test_near_misses_stay_wrong(pred, gold, choices, answer_type):
    assert grade(pred, gold, choices=choices, answer_type=answer_type) is False


# Issue 44: MATH-500's matrices, tuples, intervals, lists of answers and numbers in a base, and GSM8K's
# numbers, entry by entry with the free-form rules. (pred, gold, correct)
STRUCTURED_CASES = [
    # a matrix gold written with or without spaces, as bmatrix, an array in brackets, entries in any notation
    (r"\begin{pmatrix}-2\\-14\\-7\end{pmatrix}", r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}", True),
    (r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}", r"\begin{pmatrix}-2\\-14\\-7\end{pmatrix}", True),
    (
        r"\begin{bmatrix} -2 \\ -14 \\ -7 \end{bmatrix}",
        r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}",
        True,
    ),
    (
        r"\left(\begin{array}{c} -2 \\ -14 \\ -7 \end{array}\right)",
        r"\begin{pmatrix}-2\\-14\\-7\end{pmatrix}",
        True,
    ),
    (
        r"\begin{pmatrix}-\dfrac{1}{3}\\\frac23\\\frac{5}{3}\end{pmatrix}",
        r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}",
        True,
    ),
    (r"\begin{pmatrix}-1&0\\0&-1\end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", True),
    (r"\begin{pmatrix}-1&0\\0&-1\\\end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", True),
    # ... an entry that differs, another shape, a determinant, a tuple: wrong
    (
        r"\begin{pmatrix} -2 \\ -14 \\ -8 \end{pmatrix}",
        r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}",
        False,
    ),
    (r"\begin{pmatrix}-2&-14&-7\end{pmatrix}", r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}", False),
    (r"\begin{pmatrix} -2 \\ -14 \end{pmatrix}", r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}", False),
    (
        r"\begin{pmatrix} -2 \\ -14 \\ -7 \\ 0 \end{pmatrix}",
        r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}",
        False,
    ),
    (
        r"\begin{vmatrix} -2 \\ -14 \\ -7 \end{vmatrix}",
        r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}",
        False,
    ),
    ("(-2, -14, -7)", r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}", False),
    (
        r"\begin{pmatrix}-0.333\\0.667\\1.667\end{pmatrix}",
        r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}",
        False,
    ),
    (
        r"\begin{pmatrix}1/3\\2/3\\5/3\end{pmatrix}",
        r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}",
        False,
    ),
    (r"\begin{pmatrix}-1&0\\0&1\end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", False),
    (r"\begin{pmatrix}0&-1\\-1&0\end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", False),
    (r"\begin{pmatrix}-1&0&0&-1\end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", False),
    # tuples and intervals: entries in order, each by the scorer's rules; the brackets are the answer
    ("(1,2)", "(1, 2)", True),
    (r"(\frac{3}{2},-13)", r"\left( \frac{3}{2}, -13 \right)", True),
    ("(1.5, -13)", r"\left( \frac{3}{2}, -13 \right)", True),
    (r"(3,\frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(2\sqrt3, 1)", r"(\sqrt{12}, 1)", True),
    (r"(-\infty,0]", r"(-\infty, 0]", True),
    ("(2,1)", "(1, 2)", False),
    ("[1,2)", "(1, 2)", False),
    ("(3,4)", "(3,4]", False),
    (r"(-\infty,0)", r"(-\infty, 0]", False),
    ("(1.4,-13)", r"\left( \frac{3}{2}, -13 \right)", False),
    ("(3,1.5708)", r"\left( 3, \frac{\pi}{2} \right)", False),  # a decimal of pi/2 is not it
    ("(3.4641, 1)", r"(2\sqrt{3}, 1)", False),
    ("(1,-16,-4)", "(1,-16,-4,43)", False),
    ("(1,-16,-4,43,0)", "(1,-16,-4,43)", False),
    ("3, 5", r"\left( 3, 5 \right)", False),  # a point without its brackets (MATH's grader: wrong too)
    # a list of all the solutions: the same answers in any order, bare or as a set
    ("-2,1", "1,-2", True),
    (r"\{1,-2\}", "1,-2", True),
    ("7,5,3", "3, 5, 7", True),
    ("3,5", "3, 5, 7", False),
    ("3,5,5", "3, 5, 7", False),
    ("3,5,7,9", "3, 5, 7", False),
    ("1,2", "1,-2", False),
    ("5, 6", "5", False),  # two answers for one
    # a number in a base: the same digits, and the base where one is written
    ("4210_5", r"4210_{5}", True),
    ("4210", r"4210_{5}", True),
    (r"4210_{4}", r"4210_{5}", False),
    (r"4211_{5}", r"4210_{5}", False),
    ("52_8", "52", False),
    # MATH's thousands "10,\!080" and GSM8K's golds: commas, dollars and cents are presentation
    ("10,080", r"10,\!080", True),
    ("10080", r"10,\!080", True),
    ("10081", r"10,\!080", False),
    ("11,111,111,100", r"11,\! 111,\! 111,\! 100", True),
    (r"\$32,348", r"\$32,\!348", True),
    ("1000", "1,000", True),
    (r"\$1000", "1000", True),
    ("$1,000", "1000", True),
    ("1000.00", "1000", True),
    ("1000.5", "1000", False),
    ("100", "1000", False),
    ("10000", "1000", False),
    ("-1000", "1000", False),
    ("1000 or 1001", "1000", False),
]


@pytest.mark.parametrize(("pred", "gold", "expected"), STRUCTURED_CASES)
def test_matrices_tuples_lists_and_bases_entry_by_entry(pred, gold, expected):
    assert grade(pred, gold) is expected
    assert score(f"<think>x</think> \\boxed{{{pred}}}", gold).correct is expected


def test_letter_text_options_keep_their_letters():
    # with letter-text options the position letters keep working, with or without the option's text
    for pred in ("D", "(D)", "D. (b)", "(D) (b)", "Option D"):
        assert grade(pred, "D", choices=LETTER_TEXTS, answer_type="choice") is True, pred
    # a lowercase letter that is no option's text is still a letter
    assert grade("d", "D", choices=["(x)", "(y)", "(z)", "(w)"], answer_type="choice") is True


# ----------------------------------------------------------------------------------------------
# score = (extract, grade)


def test_score_composes_extract_and_grade():
    s = score(r"<think>half</think> \boxed{\dfrac{1}{2}}", "0.5")
    assert s == Score(extracted=r"\dfrac{1}{2}", correct=True)
    assert score("the answer is 0.5", "0.5") == Score(extracted=None, correct=False)
    assert score(r"\boxed{no}", "yes", answer_type="yesno") == Score("no", False)
    assert score(r"\boxed{B}", r"2\sqrt{3}", choices=OPTIONS, answer_type="choice").correct


def test_score_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        score(r"\boxed{1}", "1").correct = False  # type: ignore[misc]


def test_grade_off_the_main_thread():
    # math-verify's signal timeout only works in the main thread; off it we must not raise and
    # must still grade symbolically (pairs used nowhere else, so no cached result answers them)
    pairs = [(r"\sqrt{27}", r"3\sqrt{3}", True), ("x^2+3x", "x(x+3)", True), ("2", r"\sqrt{5}", False)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda c: grade(c[0], c[1]), pairs))
    assert got == [c[2] for c in pairs]


# ----------------------------------------------------------------------------------------------
# never raises

NASTY = [
    "\\boxed{",
    "\\boxed{{{",
    "}}}\\boxed}",
    "\\boxed{\\frac{1}{0}}",
    "\\frac{1}{0}",
    "1e99999",
    "-1e99999",
    "10^{10^{10}}",
    "(10^9)^(10^9)",
    "9^9^9",
    "100000!",
    "\\sqrt{-1}",
    "\\binom{100000}{50000}",
    "\\left(",
    "$$",
    "\\",
    "\\text{",
    "B:",
    "()",
    "nan",
    "inf",
    "\x00",
    "<think>",
    "</think>",
    "\u2212",
    "°",
]
_text = st.lists(st.one_of(st.sampled_from(NASTY), st.text(max_size=20)), max_size=6).map("".join)
_settings = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@_settings
@given(
    output=_text,
    gold=_text,
    choices=st.none() | st.lists(_text, max_size=5),
    kind=st.sampled_from(["choice", "yesno", "number", "free", "bogus"]),
)
def test_scoring_never_raises(output, gold, choices, kind):
    assert extract_boxed(output) is None or isinstance(extract_boxed(output), str)
    s = score(output, gold, choices=choices, answer_type=kind)
    assert isinstance(s.correct, bool)
    assert isinstance(grade(output, gold, choices=choices, answer_type=kind), bool)


@_settings
@given(outputs=st.lists(_text, min_size=1, max_size=3), gold=_text)
def test_rewards_never_raise(outputs, gold):
    n = len(outputs)
    conversational = [[{"role": "assistant", "content": o}] for o in outputs]
    for completions in (outputs, conversational):
        for f in (accuracy_reward, math_reward):
            r = f(prompts=[""] * n, completions=completions, answer=[gold] * n)
            assert len(r) == n and all(0.0 <= x <= 1.0 for x in r)
        assert len(format_reward(completions=completions)) == n


def test_non_string_inputs_do_not_raise():
    assert extract_boxed(None) is None  # type: ignore[arg-type]
    assert grade(12, 12) is True  # type: ignore[arg-type]
    assert score(None, "1") == Score(None, False)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# format and the TRL reward functions

FORMAT_CASES = [
    # the canonical shape
    ("<think>a</think> so \\boxed{1}", 1.0),
    # newlines inside and between (DOTALL)
    ("<think>\nline\nline\n</think>\n\nThe answer is \\boxed{1}.\n", 1.0),
    # NoisyRollout's re.fullmatch on the raw text: a leading newline or space fails (issue 9)
    ("\n<think>a</think>\\boxed{1}", 0.0),
    (" <think>a</think>\\boxed{1}", 0.0),
    # ... trailing text of any kind after the box is allowed by its final ".*"
    ("<think>a</think>\\boxed{1}\n\n", 1.0),
    # no think block
    ("\\boxed{1}", 0.0),
    # the box must come after </think>
    ("<think>\\boxed{1}</think> done", 0.0),
    # text before <think> (fullmatch, as in NoisyRollout)
    ("Sure. <think>a</think>\\boxed{1}", 0.0),
    # unclosed think
    ("<think>a \\boxed{1}", 0.0),
    # no box
    ("<think>a</think> 1", 0.0),
]


@pytest.mark.parametrize(("text", "expected"), FORMAT_CASES)
def test_format_reward(text, expected):
    assert format_reward([text]) == [expected]


GOOD = "<think>2+2</think> \\boxed{4}"
WRONG = "<think>2+2</think> \\boxed{5}"
BARE = "\\boxed{4}"
LOOSE = "<think>2+2</think> 4"


def _trl_call(f, completions, **columns):
    # exactly how GRPOTrainer._calculate_rewards calls a reward function (TRL 1.16)
    n = len(completions)
    return f(
        prompts=["q"] * n,
        completions=completions,
        completion_ids=[[1, 2]] * n,
        trainer_state=None,
        log_extra=lambda *a, **k: None,
        log_metric=lambda *a, **k: None,
        **columns,
    )


def _conversational(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def _typed_parts(texts):
    # content as typed parts, split mid-text, with a non-text part in between
    return [
        [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": t[:3]},
                    {"type": "image"},
                    {"type": "text", "text": t[3:]},
                ],
            }
        ]
        for t in texts
    ]


@pytest.mark.parametrize(
    "wrap", [list, _conversational, _typed_parts], ids=["plain", "conversational", "parts"]
)
def test_trl_rewards(wrap):
    completions = wrap([GOOD, WRONG, BARE, LOOSE])
    answer = ["4"] * 4
    assert _trl_call(accuracy_reward, completions, answer=answer) == [1.0, 0.0, 1.0, 0.0]
    assert _trl_call(format_reward, completions, answer=answer) == [1.0, 1.0, 0.0, 0.0]
    assert _trl_call(math_reward, completions, answer=answer) == pytest.approx(
        [1.0, FORMAT_WEIGHT, ACCURACY_WEIGHT, 0.0]
    )


def test_trl_per_row_choices_and_types_may_be_none():
    completions = ["\\boxed{B}", "\\boxed{yes}", "\\boxed{\\sqrt{12}}", "\\boxed{B}"]
    answer = ["B", "yes", "2\\sqrt{3}", "2\\sqrt{3}"]
    choices = [None, None, None, np.array(OPTIONS)]  # datasets may hand columns over as arrays
    answer_type = ["choice", "yesno", None, "choice"]
    got = _trl_call(accuracy_reward, completions, answer=answer, choices=choices, answer_type=answer_type)
    assert got == [1.0] * 4
    # whole columns absent or None
    assert _trl_call(accuracy_reward, completions[:2], answer=answer[:2]) == [1.0, 1.0]
    got = _trl_call(accuracy_reward, completions[:2], answer=answer[:2], choices=None, answer_type=None)
    assert got == [1.0, 1.0]
    # a missing gold is a wrong answer, not a crash
    assert _trl_call(accuracy_reward, ["\\boxed{1}"], answer=[None]) == [0.0]


def test_math_reward_weights_and_names():
    assert ACCURACY_WEIGHT == pytest.approx(0.9) and FORMAT_WEIGHT == pytest.approx(0.1)
    assert ACCURACY_WEIGHT + FORMAT_WEIGHT == 1.0
    # TRL logs reward functions by __name__
    assert math_reward.__name__ == "math_reward"
    assert accuracy_reward.__name__ == "accuracy_reward" and format_reward.__name__ == "format_reward"
    assert make_math_reward().__name__ == "math_reward"
    shaped = make_math_reward(format_weight=0.5)
    assert shaped.__name__ == "math_reward_fmt0.5"
    assert shaped([GOOD, WRONG, BARE], answer=["4"] * 3) == pytest.approx([1.0, 0.5, 0.5])
    # weight 0 is the paper's binary reward r_i = 1[extract(o_i) = y*]
    assert make_math_reward(0.0)([GOOD, WRONG, BARE], answer=["4"] * 3) == [1.0, 0.0, 1.0]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="format_weight"):
            make_math_reward(bad)


# ----------------------------------------------------------------------------------------------
# grader="mathruler": NoisyRollout's accuracy (mathruler 0.1.0 grade_answer on
# extract_boxed_content), for comparing with their numbers. The expected values below were
# computed by running mathruler 0.1.0 itself on these inputs (our own table of its outputs).

MATHRULER_GRADES = [
    ("12", "12", True),
    ("12.0", "12", True),
    ("1000.01", "1000", False),
    ("1001", "1000", False),
    (r"\frac{1}{2}", "0.5", True),
    ("0.5", r"\frac{1}{2}", True),
    # unreduced fractions are wrong in mathruler, right in ours
    (r"\frac{2}{4}", r"\frac{1}{2}", False),
    ("2/4", "1/2", False),
    (r"\sqrt{12}", r"2\sqrt{3}", True),
    ("3.4641", r"2\sqrt{3}", False),
    # mathruler does not read the benchmarks' √{3}
    ("2√{3}", r"2\sqrt{3}", False),
    ("2", "2√{3}", False),
    ("Yes or No", "yes", False),
    ("yes", "Yes", True),
    ("Yes.", "yes", False),
    ("(A) or (B)", "A", False),
    ("A", "A", True),
    ("(A)", "A", True),
    ("A. 20", "A", False),
    (r"30^\circ", "30", True),
    ("30°", "30", False),
    ("12 cm", "12", True),
    # mathruler's sympy stage accepts a different range (both are -0.2 as arithmetic)
    ("0.5 - 1.0", "0.0 - 0.5", True),
    ("trees grow", "trees shrink", False),
    ("x = 5", "5", True),
    (r"\text{B}", "B", True),
    ("1,000", "1000", True),
    ("None", "5", False),
    ("27014", "27013", False),
    ("48211.8", "48211.5", False),
    ("1.45", "1.449", False),
    (r"4\pi", "12.566", False),
    ("(1,2)", "(1, 2)", True),
    ("b", "B", True),
]

MATHRULER_EXTRACTS = [
    ("<think>a</think> \\boxed{12}", "12"),
    ("\\boxed{\\frac{1}{2}} and \\boxed{3}", "3"),
    ("no box", None),  # mathruler returns the string "None"; Score records None
    ("\\boxed{3", None),
    ("\\boxed{}", ""),
    ("\\boxed{\\text{A}}", "\\text{A}"),
    ("\\fbox{7}", None),  # mathruler reads only \boxed{
    ("\\boxed 5", None),
]


@pytest.mark.parametrize(("pred", "gold", "expected"), MATHRULER_GRADES)
def test_mathruler_grader_reproduces_mathruler(pred, gold, expected):
    mathruler = pytest.importorskip("mathruler.grader")
    assert mathruler.grade_answer(pred, gold) is expected  # the table is mathruler's own output
    assert grade(pred, gold, grader="mathruler") is expected
    assert score(f"<think>t</think> \\boxed{{{pred}}}", gold, grader="mathruler").correct is expected


@pytest.mark.parametrize(("text", "expected"), MATHRULER_EXTRACTS)
def test_mathruler_extraction(text, expected):
    pytest.importorskip("mathruler.grader")
    assert score(text, "12", grader="mathruler").extracted == expected


def test_mathruler_reward_is_noisyrollouts():
    pytest.importorskip("mathruler.grader")
    reward = make_math_reward(grader="mathruler")
    assert reward.__name__ == "math_reward_mathruler"
    texts = [GOOD, WRONG, BARE, "\n" + GOOD, "<think>t</think> \\boxed{0.5 - 1.0}"]
    answer = ["4", "4", "4", "4", "0.0 - 0.5"]
    assert reward(texts, answer=answer) == pytest.approx([1.0, 0.1, 0.9, 0.9, 1.0])
    # ours on the same rows: the range is wrong
    assert math_reward(texts, answer=answer) == pytest.approx([1.0, 0.1, 0.9, 0.9, 0.1])


def test_unknown_grader_is_an_error():
    with pytest.raises(ValueError, match="grader"):
        grade("1", "1", grader="mathverify")
    with pytest.raises(ValueError, match="grader"):
        make_math_reward(grader="judge")


def test_the_module_imports_without_mathruler() -> None:
    """mathruler is an optional extra: importing ncgrpo.rewards (every training run does) must not need it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['mathruler'] = None; sys.modules['mathruler.grader'] = None\n"
        "import ncgrpo.rewards as r\n"
        "assert r.math_reward(['<think>a</think> \\\\boxed{2}'], ['2']) == [1.0]\n"
        "try:\n    r.math_reward_mathruler(['x'], ['2'])\nexcept ImportError as e:\n    print('needs', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "needs" in out.stdout and "mathruler" in out.stdout
