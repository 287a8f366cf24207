"""The loaders and the scorer on the benchmarks' REAL annotation rows (issue 13).

The annotation files are public but are not committed here (docs/benchmarks-data.md, "Real
annotation files", lists the repository and path of each). Put them in a folder laid out as
``<benchmark>/<file>`` and point ``NCGRPO_REAL_ANNOTATIONS`` at it, or place them in
``../shared/benchmarks/`` beside the repository; without them every test here is skipped.

For every benchmark whose annotations are found:

1. the benchmark's loader (the same converter ``load_benchmark`` uses) reads every row, with the
   annotation rows put into the hub's field layout and one tiny placeholder image per row (the
   images are not needed to check conventions);
2. every gold answer, written as a model would write it (the letter, ``(L)``, ``L. text`` and the
   option text for choices, also when that text is a lowercase letter such as MathVista's ``(b)``;
   the number in the benchmark's own notation), scores correct;
3. wrong answers made by fixed rules -- neighbouring integers, steps of the stated precision, a
   rounding to fewer digits, another option's letter and text, hedges ("A or B", "Yes or No"), a
   dropped radical, an inverted fraction, the negation, the opposite yes/no -- never score correct.

``python tests/data/test_real_annotations.py`` prints the per-benchmark table (rows read, gold
forms accepted, wrong answers tried and accepted) and the first offending pairs.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from published import PUBLISHED_ROWS

from ncgrpo.data.benchmarks import BENCHMARKS, BenchmarkDataError, RowContext, load_benchmark
from ncgrpo.data.types import LETTERS, Question
from ncgrpo.rewards import score

REPO = Path(__file__).resolve().parents[2]


def annotations_root() -> Path:
    env = os.environ.get("NCGRPO_REAL_ANNOTATIONS")
    return Path(env) if env else REPO.parent / "shared" / "benchmarks"


# benchmark -> (files under <root>/<benchmark>/, split, rows the loader must return)
SOURCES: dict[str, tuple[tuple[str, ...], str, int]] = {
    "mathvista": (("testmini.json",), "testmini", 1000),
    "mathvision": (("test.jsonl",), "test", 3040),
    # the full 3940-row testmini.json is not in the GitHub repository (only on the hub); the
    # text-only version holds the same 788 problems, options and answers
    "mathverse": (("testmini_text_only.json",), "testmini", 788),
    "hallusionbench": (("HallusionBench.json",), "image", 951),
    "wemath": (("testmini.json",), "testmini", 1740),
    "pope": (
        ("coco_pope_adversarial.json", "coco_pope_popular.json", "coco_pope_random.json"),
        "test",
        9000,
    ),
    "chartqa": (("test_human.json", "test_augmented.json"), "test", 2500),
    # text-only (issue 44): openai/grade-school-math's test.jsonl; MATH-500 in a prompt/answer copy
    "gsm8k": (("test.jsonl",), "test", 1319),
    "math500": (("math500.jsonl",), "test", 500),
}
#: Text-only benchmarks: their answers are also checked against the golds of other rows.
TEXT_ONLY = ("gsm8k", "math500")
#: How many following rows' golds each question is checked against (wrong answers that are real answers).
OTHER_GOLDS = 11


def _image():
    from PIL import Image

    return Image.new("RGB", (4, 4))


def _read(file: Path) -> list[dict]:
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".jsonl" or (text.lstrip().startswith("{") and "\n{" in text):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    return list(data.values()) if isinstance(data, dict) else data


def hub_rows(name: str, folder: Path) -> list[dict]:
    """The annotation rows of ``name`` in its hub layout (the layout the loaders read)."""
    files, _split, _n = SOURCES[name]
    image = _image()
    rows: list[dict] = []
    for fname in files:
        for row in _read(folder / fname):
            row = dict(row)
            if name in ("mathvista", "mathvision"):
                row["decoded_image"] = image
            elif name == "mathverse":
                row["image"] = image
            elif name == "hallusionbench":
                if not row.get("filename"):  # visual_input 0: the hub's non_image split
                    continue
                row["image"] = image
            elif name == "wemath":
                row["image_path"] = image
            elif name == "chartqa":  # {imgname, query, label} per file; the hub has label lists
                row = {**row, "image": image, "human_or_machine": fname.removesuffix(".json")[5:]}
            elif name == "pope":  # {question_id, image, text, label} -> lmms-lab/POPE fields
                category = fname.removeprefix("coco_pope_").removesuffix(".json")
                row = {
                    "question_id": row["question_id"],
                    "question": row["text"],
                    "answer": row["label"],
                    "category": category,
                    "image_source": row["image"],
                    "image": image,
                }
            rows.append(row)
    return rows


def load_real(name: str, folder: Path) -> list[Question]:
    spec = BENCHMARKS[name]
    split = SOURCES[name][1]
    ctx = RowContext(benchmark=name, label=f"{name} {folder}", split=split)
    return spec.loader(enumerate(hub_rows(name, folder)), ctx)


# ----------------------------------------------------------------------------------------------
# answers as a model writes them


def model_form(gold: str) -> str:
    """The gold as a model would box it: no ``$``, no ``\\boxed{}``, ``\\f`` not a form feed."""
    g = gold.replace("\x0c", "\\f").strip()
    m = re.fullmatch(r"\$?\s*\\boxed\{(.*)\}\s*\$?", g)
    if m:
        g = m.group(1)
    g = g.replace("\\$", "$").replace("$", "").strip()  # "$3\sqrt{3}-\pi \$": a stray \$
    g = re.sub(r"(?:\\+\s*)+$", "", g).strip()  # "x=3y \\": a trailing LaTeX line break
    return g


_LETTERISH_RE = re.compile(r"\(?([A-Za-z])\)?\.?")


def _letterish(text: str) -> bool:
    """Option texts that read as a CAPITAL letter ("B", "\\text{(C)}"): a capital is the position
    letter, so a model naming such an option by its text is ambiguous. A lowercase one ("(c)",
    MathVista 168 and 849) is read as the option's text by the scorer, so it is a form like any other."""
    m = _LETTERISH_RE.fullmatch(re.sub(r"\\text\{(.*)\}", r"\1", text).strip())
    return m is not None and m.group(1).isupper()


def gold_forms(q: Question) -> list[str]:
    if q.answer_type == "yesno":
        return [q.answer, q.answer.capitalize(), f"\\text{{{q.answer.capitalize()}}}"]
    if q.answer_type == "choice":
        letter = q.answer
        forms = [letter, f"({letter})"]
        if q.choices:
            text = model_form(q.choices[LETTERS.index(letter)])
            forms.append(f"{letter}. {text}")
            same = [c for c in q.choices if model_form(c) == text]
            if not _letterish(text) and len(same) == 1:
                forms.append(text)
        return forms
    if q.benchmark == "gsm8k":
        return gsm8k_forms(q.answer)
    if q.benchmark == "math500":
        return math500_forms(model_form(q.answer))
    return [model_form(q.answer)]


def gsm8k_forms(gold: str) -> list[str]:
    """A GSM8K gold as models write it: bare, with thousands commas, in dollars, with cents."""
    n = int(gold)
    return list(dict.fromkeys([gold, f"{n:,}", f"\\${gold}", f"${n:,}", f"{gold}.00", f"{gold}."]))


def _squeeze(text: str) -> str:
    """``text`` without spaces, except between two letters (``\\pi r`` stays ``\\pi r``)."""
    return re.sub(r"(?<![A-Za-z])\s+|\s+(?![A-Za-z])", "", text)


def math500_forms(gold: str) -> list[str]:
    """A MATH-500 gold as models write it: as stored, without spaces (``\\begin{pmatrix}-2\\\\-14
    \\end{pmatrix}``), spaced out, with ``\\dfrac`` and without ``\\left``/``\\right``, and matrices
    as bmatrix."""
    forms = [gold, _squeeze(gold), re.sub(r"\s*(\\\\|&)\s*", r" \1 ", gold)]
    if re.match(r"\\left|[(\[]", gold):  # a tuple or interval, spaced out
        forms.append(re.sub(r"\s*,\s*", ", ", gold))
    forms += [gold.replace("\\frac", "\\dfrac"), re.sub(r"\\(?:left|right)(?![A-Za-z])\s*", "", gold)]
    if "pmatrix" in gold:
        forms.append(_squeeze(gold).replace("pmatrix", "bmatrix"))
    return list(dict.fromkeys(forms))


# numbers, but not exponents (cm^{2} -> cm^{3} changes a unit, which the scorer ignores by design)
_NUM_TOKEN = re.compile(r"(?<![\w.^])(?<!\^\{)(?<!\^ )(?<!\^\{ )(\d+)(?:\.(\d+))?(?![\w.])")


def _shift(text: str, m: re.Match[str], steps: int) -> str | None:
    whole, frac = m.group(1), m.group(2)
    if frac is None:
        value = int(whole) + steps
        if value < 0:
            return None
        new = str(value)
    else:
        d = len(frac)
        value = int(whole + frac) + steps
        if value < 0:
            return None
        digits = str(value).rjust(d + 1, "0")
        new = f"{digits[:-d]}.{digits[-d:]}"
    return text[: m.start()] + new + text[m.end() :]


def wrong_forms(q: Question) -> list[tuple[str, str]]:
    """(rule, answer) pairs that must never score correct for ``q`` (rules in the docstring)."""
    out: list[tuple[str, str]] = []
    if q.benchmark in TEXT_ONLY:
        out += structure_wrong(model_form(q.answer))
    if q.answer_type == "yesno":
        other = "no" if q.answer == "yes" else "yes"
        out = [("opposite", other), ("opposite", other.capitalize())]
        return out + [("hedge", h) for h in ("Yes or No", "yes/no", "\\text{Yes or No}")]
    if q.answer_type == "choice":
        gi = LETTERS.index(q.answer)
        n = len(q.choices) if q.choices else 4
        gold_text = model_form(q.choices[gi]) if q.choices else None
        for j in range(n):
            if j == gi:
                continue
            lj = LETTERS[j]
            out += [("other letter", lj), ("other letter", f"({lj})")]
            if q.choices:
                tj = model_form(q.choices[j])
                if tj == gold_text:  # two options with the same text: not a different answer
                    continue
                out.append(("other letter+text", f"({lj}) {tj}"))
                if not _letterish(tj):
                    out.append(("other text", tj))
        other = LETTERS[(gi + 1) % n]
        hedges = (f"({q.answer}) or ({other})", f"{q.answer} or {other}", f"{q.answer}, {other}")
        return out + [("hedge", h) for h in hedges]
    gold = model_form(q.answer)
    tokens = list(_NUM_TOKEN.finditer(gold))[:3]
    for m in tokens:
        steps = (-1, 1) if m.group(2) is None else (-3, -1, 1, 3)
        rule = "neighbour integer" if m.group(2) is None else "precision step"
        for s in steps:
            shifted = _shift(gold, m, s)
            if shifted is not None:
                out.append((rule, shifted))
    # a rounding to fewer digits than the gold states
    m = re.fullmatch(r"-?\d+\.(\d+)", gold)
    if m:
        d = len(m.group(1))
        rounded = f"{float(gold):.{d - 1}f}"
        if float(rounded) != float(gold):
            out.append(("fewer digits", rounded))
    # the negation
    if re.fullmatch(r"\d+(\.\d+)?", gold) and float(gold) != 0:
        out.append(("negation", "-" + gold))
    # radicals: dropped, or the decimal approximation of an exact surd
    for rad in (r"\\sqrt\s*\{[^{}]*\}", r"\\sqrt\s*\d", r"√\s*\{[^{}]*\}", r"√\s*\d+"):
        if re.search(rad, gold):
            dropped = re.sub(rad, "", gold, count=1).strip()
            out.append(("dropped radical", dropped or "1"))
    value = _exact_value(gold)
    if value is not None and not re.fullmatch(r"-?\d+(\.\d+)?", gold):
        out.append(("decimal of exact form", f"{value:.4f}"))  # 3.4641 for 2\sqrt{3}
    # inverted fractions
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", gold)
    if m and m.group(2) != m.group(3):
        out.append(("inverted fraction", f"{m.group(1)}\\frac{{{m.group(3)}}}{{{m.group(2)}}}"))
    m = re.fullmatch(r"(-?)(\d+)/(\d+)", gold)
    if m and m.group(2) != m.group(3):
        out.append(("inverted fraction", f"{m.group(1)}{m.group(3)}/{m.group(2)}"))
    return [w for w in dict.fromkeys(out) if w[1] != gold]


def structure_wrong(gold: str) -> list[tuple[str, str]]:
    """Wrong answers to a matrix, tuple, interval or list gold, and to a GSM8K number: an entry
    dropped or added, a column vector as a row vector or a tuple, the entries reversed, the other
    bracket of an interval, a hedge; a number ten times too big or small, or in thousands."""
    out: list[tuple[str, str]] = []
    m = re.fullmatch(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", gold.strip(), re.DOTALL)
    if m:
        rows = [r.strip() for r in m.group(1).split("\\\\")]
        cells = [[c.strip() for c in r.split("&")] for r in rows]
        if len(rows) > 1:
            out.append(
                ("matrix: a row dropped", "\\begin{pmatrix}" + "\\\\".join(rows[:-1]) + "\\end{pmatrix}")
            )
            out.append(
                (
                    "matrix: another entry added",
                    "\\begin{pmatrix}"
                    + "\\\\".join([*rows, "0" if cells[-1] != ["0"] else "1"])
                    + "\\end{pmatrix}",
                )
            )
        if all(len(c) == 1 for c in cells):
            out.append(("matrix: a row vector", "\\begin{pmatrix}" + " & ".join(rows) + "\\end{pmatrix}"))
            out.append(("matrix: a tuple", "(" + ", ".join(rows) + ")"))
        if len(set(rows)) > 1:
            out.append(
                ("matrix: rows reversed", "\\begin{pmatrix}" + "\\\\".join(rows[::-1]) + "\\end{pmatrix}")
            )
        return out
    body = re.sub(r"\\(?:left|right)(?![A-Za-z])\s*", "", gold).strip()
    tuple_m = re.fullmatch(r"([(\[])(.*)([)\]])", body, re.DOTALL)
    inner = tuple_m.group(2) if tuple_m else body
    parts = [p.strip() for p in inner.split(",")] if "\\cup" not in body and "\\{" not in body else []
    if len(parts) >= 2 and all(parts) and not re.fullmatch(r"\d{1,3}(,\s*\\!?\s*\d{3})+", inner):
        o, c = (tuple_m.group(1), tuple_m.group(3)) if tuple_m else ("", "")
        out.append(("tuple: an entry dropped", f"{o}{', '.join(parts[:-1])}{c}"))
        out.append(
            ("tuple: an entry added", f"{o}{', '.join([*parts, '0' if parts[-1] != '0' else '1'])}{c}")
        )
        if tuple_m and len(set(parts)) > 1:
            out.append(("tuple: entries reversed", f"{o}{', '.join(parts[::-1])}{c}"))
        if tuple_m and o + c in ("(]", "[)", "[]", "()") and len(parts) == 2 and "infty" not in inner:
            flip = {"(": "[", "[": "("}[o] + ", ".join(parts) + c
            out.append(("interval: other bracket", flip))
        if tuple_m:
            out.append(("tuple without its brackets", ", ".join(parts)))  # wrong for MATH's grader too
    if re.fullmatch(r"-?\d+", gold) and int(gold) != 0:
        out += [("ten times", gold + "0"), ("hedge", f"{gold} or {int(gold) + 1}")]
        if len(gold.lstrip("-")) > 1:
            out.append(("a tenth", gold[:-1]))
    return out


def other_golds(questions: list[Question], k: int = OTHER_GOLDS) -> dict[str, list[str]]:
    """Each question's wrong answers that are real answers: the golds of the next ``k`` rows (in a
    ring) that differ from its own when written without spaces and ``\\left``/``\\right``."""

    def key(gold: str) -> str:
        """The gold without what the scorer ignores by design: spacing, sizing, thousands commas,
        a leading "x =", degrees (36^\\circ is 36)."""
        text = re.sub(r"\s+|\\(?:left|right)(?![A-Za-z])|\\!|\\,|,(?=\d{3}\b)", "", model_form(gold))
        return re.sub(r"^[a-z]=|\^\{?\\circ\}?", "", text)

    out: dict[str, list[str]] = {}
    n = len(questions)
    for i, q in enumerate(questions):
        mine = key(q.answer)
        picks = [questions[(i + j) % n].answer for j in range(1, min(k, n - 1) + 1)]
        out[q.question_id] = list(dict.fromkeys(model_form(g) for g in picks if key(g) != mine))
    return out


def _exact_value(gold: str) -> float | None:
    """Value of a closed form with a radical or pi (``2\\sqrt{3}``), else None."""
    if not re.search(r"\\sqrt|√|\\pi|π", gold):
        return None
    try:
        from math_verify import parse

        parsed = parse(f"${gold}$")
        value = complex(parsed[0].evalf(20)) if parsed else None
    except Exception:
        return None
    if value is None or abs(value.imag) > 1e-12 or not math.isfinite(value.real):
        return None
    return value.real


# ----------------------------------------------------------------------------------------------
# the check


def check(name: str, questions: list[Question]) -> dict:
    gold_tried = gold_ok = wrong_tried = 0
    rejected_gold: list[tuple] = []
    accepted_wrong: list[tuple] = []
    others = other_golds(questions) if name in TEXT_ONLY else {}
    for q in questions:
        for form in gold_forms(q):
            gold_tried += 1
            if score(f"\\boxed{{{form}}}", q.answer, choices=q.choices, answer_type=q.answer_type).correct:
                gold_ok += 1
            else:
                rejected_gold.append((q.question_id, form, q.answer, q.choices))
        wrong = wrong_forms(q) + [("another row's gold", g) for g in others.get(q.question_id, [])]
        for rule, form in wrong:
            wrong_tried += 1
            if score(f"\\boxed{{{form}}}", q.answer, choices=q.choices, answer_type=q.answer_type).correct:
                accepted_wrong.append((rule, q.question_id, form, q.answer, q.choices))
    return {
        "benchmark": name,
        "rows": len(questions),
        "gold_tried": gold_tried,
        "gold_accepted": gold_ok,
        "wrong_tried": wrong_tried,
        "wrong_accepted": len(accepted_wrong),
        "rejected_gold": rejected_gold,
        "accepted_wrong": accepted_wrong,
    }


def available() -> Iterator[str]:
    root = annotations_root()
    for name, (files, _split, _n) in SOURCES.items():
        if all((root / name / f).is_file() for f in files):
            yield name


def _folder(name: str) -> Path:
    folder = annotations_root() / name
    files = SOURCES[name][0]
    if not all((folder / f).is_file() for f in files):
        pytest.skip(
            f"real {name} annotations not found: put {', '.join(files)} in {folder} (or set "
            "NCGRPO_REAL_ANNOTATIONS); see docs/benchmarks-data.md, 'Real annotation files'"
        )
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_real_rows_load_and_score(name):
    folder = _folder(name)
    questions = load_real(name, folder)
    assert len(questions) == SOURCES[name][2]
    result = check(name, questions)
    # the report (.ci/run shows it with -rP): golds accepted, wrong answers accepted (must be 0)
    print(
        f"{name}: {result['rows']} rows; golds accepted {result['gold_accepted']}/{result['gold_tried']}; "
        f"wrong answers accepted {result['wrong_accepted']}/{result['wrong_tried']}"
    )
    assert result["rejected_gold"] == [], result["rejected_gold"][:10]
    assert result["accepted_wrong"] == [], result["accepted_wrong"][:10]


def _scores(q: Question, form: str) -> bool:
    return score(f"\\boxed{{{form}}}", q.answer, choices=q.choices, answer_type=q.answer_type).correct


@pytest.mark.parametrize("pid", ["168", "849"])
def test_mathvista_option_text_that_is_a_letter(pid):
    """MathVista pids 168 and 849: the gold option's text is itself ``(b)`` at another position
    (issue 25). ``(b)`` names that option, not letter B; the position letter still works; every other
    letter, every other option's text (each itself a letter) and hedges stay wrong."""
    folder = _folder("mathvista")
    q = next(q for q in load_real("mathvista", folder) if q.question_id == pid)
    gi = LETTERS.index(q.answer)
    assert q.choices is not None and q.choices[gi] == "(b)" and q.answer != "B"
    right = [q.answer, f"({q.answer})", f"{q.answer}. (b)", "(b)", "b", "\\text{(b)}", "The answer is (b)"]
    assert [f for f in right if not _scores(q, f)] == []
    wrong = [h for j, t in enumerate(q.choices) if j != gi for h in (LETTERS[j], f"({LETTERS[j]})", t, t[1])]
    wrong += ["B", "(B)", f"{q.answer}. (a)", "(b) or (c)", "(b), (c)", f"({q.answer}) or (B)"]
    assert [f for f in wrong if _scores(q, f)] == []


def test_hallusionbench_paper_split_gives_the_papers_ood_count():
    """The paper's n = 10,038 OOD questions = 318 + 1000 + 3940 + 3040 + 1740: HallusionBench rows
    collapse to 318 under NoisyRollout's id ``set_figure_question``, the other four are whole."""
    folder = _folder("hallusionbench")
    rows = hub_rows("hallusionbench", folder)
    spec = BENCHMARKS["hallusionbench"]
    ctx = RowContext(benchmark="hallusionbench", label="hallusionbench", split="image_paper")
    questions = spec.loader(enumerate(rows), ctx)
    assert len(questions) == 318
    assert len({q.question_id for q in questions}) == 318
    sizes = {n: PUBLISHED_ROWS[n][BENCHMARKS[n].default_split] for n in BENCHMARKS}
    ood = [n for n in BENCHMARKS if BENCHMARKS[n].role == "ood" and BENCHMARKS[n].in_paper]
    assert sorted(ood) == ["hallusionbench", "mathverse", "mathvision", "mathvista", "wemath"]
    assert sum(sizes[n] for n in ood) == 10038


def test_real_mathvista_loads_through_load_benchmark(tmp_path):
    """The GitHub ``testmini.json`` (a dict of rows, image paths) read by ``load_benchmark`` itself."""
    folder = _folder("mathvista")
    rows = json.loads((folder / "testmini.json").read_text(encoding="utf-8"))
    first = dict(list(rows.items())[:20])
    (tmp_path / "images").mkdir()
    for row in first.values():
        _image().save(tmp_path / row["image"])
    (tmp_path / "testmini.json").write_text(json.dumps(first), encoding="utf-8")
    questions = load_benchmark("mathvista", tmp_path / "testmini.json")
    assert [q.question_id for q in questions] == list(first)


def main() -> None:
    root = annotations_root()
    print(f"annotations: {root}")
    print(f"{'benchmark':<16}{'rows':>6}{'gold ok/tried':>16}{'wrong accepted/tried':>22}")
    only = [n for n in os.environ.get("ONLY", "").split(",") if n]
    for name in available():
        if only and name not in only:
            continue
        try:
            questions = load_real(name, root / name)
        except BenchmarkDataError as exc:
            print(f"{name:<16} loader failed: {exc}")
            continue
        r = check(name, questions)
        print(
            f"{name:<16}{r['rows']:>6}{r['gold_accepted']:>9}/{r['gold_tried']:<6}"
            f"{r['wrong_accepted']:>12}/{r['wrong_tried']}"
        )
        by_rule = Counter(item[0] for item in r["accepted_wrong"])
        if by_rule:
            print("   accepted wrong by rule: " + ", ".join(f"{k} {v}" for k, v in by_rule.most_common()))
        shown: Counter[str] = Counter()
        for item in r["rejected_gold"][: int(os.environ.get("SHOW", "8"))]:
            print(f"   rejected gold: {item}")
        for item in r["accepted_wrong"]:
            shown[item[0]] += 1
            if shown[item[0]] <= int(os.environ.get("SHOW", "8")):
                print(f"   accepted wrong: {item}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
