"""Reading a benchmark's rows with errors that name the place (file, row, field), and the answer
conventions every loader follows (see :mod:`ncgrpo.data.benchmarks`)."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from PIL import Image, UnidentifiedImageError

from ncgrpo.data.prompts import IMAGE_PLACEHOLDER
from ncgrpo.data.types import LETTERS, AnswerType, Role

#: Appended to every multiple-choice problem after its option list.
CHOICE_INSTRUCTION = "Answer with the letter of the correct option in \\boxed{}."
#: NoisyRollout's HallusionBench suffix (eval/utils/data_loaders.py), typo included so prompts match
#: theirs token for token; POPE uses the same suffix.
YESNO_INSTRUCTION = "You final answer can only be \\boxed{yes} or \\boxed{no}."

_ROLES = set(get_args(Role))


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

    def prompt(self, row: dict[str, Any], index: int, name: str = "prompt") -> str:
        """The question a TRL ``prompt`` column holds: a string, or chat messages (``[{"role": "user",
        "content": ...}]``, the content a string or a list of ``{"type": "text"|"image"}`` parts; an
        image part becomes an ``<image>`` placeholder). One user turn only: a system message or an
        earlier exchange would be dropped from what the model is asked, so they are errors that say
        what to do instead."""
        value = self.field(row, index, name)
        if isinstance(value, str):
            return value.strip()
        if not isinstance(value, list | tuple):
            raise self.error(
                index, f"field '{name}' should be text or a list of chat messages, got {type(value).__name__}"
            )
        roles = []
        for k, message in enumerate(value):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise self.error(
                    index, f"field '{name}' message {k} should be {{'role': ..., 'content': ...}}"
                )
            roles.append(str(message["role"]))
        if "system" in roles:
            raise self.error(
                index,
                f"field '{name}' holds a system message; the system message is one for every question "
                "(--system_prompt): remove it from the rows and pass it there",
            )
        if roles != ["user"]:
            raise self.error(
                index,
                f"field '{name}' holds the turns {roles}; each row is one question: one user message",
            )
        content = value[0]["content"]
        if isinstance(content, str):
            text = content
        elif isinstance(content, list | tuple):
            pieces = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    pieces.append(str(part.get("text") or ""))
                elif kind == "image":
                    pieces.append(IMAGE_PLACEHOLDER)
                else:
                    raise self.error(
                        index,
                        f"field '{name}' user content part {k} should be a text or image part, got {part!r}",
                    )
            text = "".join(pieces)
        else:
            raise self.error(index, f"field '{name}' user content should be text or a list of parts")
        if not text.replace(IMAGE_PLACEHOLDER, "").strip():
            raise self.error(index, f"field '{name}' has no question text")
        return text.strip()


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
