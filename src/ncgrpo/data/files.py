"""A user's own data file: rows of a ``.jsonl``, ``.json`` or ``.parquet`` file with TRL's ``prompt``
column, for ``ncgrpo train --dataset_name FILE`` and ``ncgrpo probe --data FILE``.

The prompt column (``prompt`` unless another is named) holds each prompt in either of TRL's forms: a
string (the user's message; rendered with the model's chat template, as every prompt here is, so
``branch_prefix`` and the probe see the same text the trainer does) or a list of chat messages
(``{"role": ..., "content": ...}``, used as written). Every other column is kept and reaches the reward
functions as a keyword argument of the same name, as TRL passes dataset columns (``answer`` for the
built-in rewards: ``answer_column`` names another column to read it from).

Errors are :class:`DataFileError` (a ``ValueError``) naming the file and the line (JSONL) or row and
the column: an empty file, a line that is not JSON, a row that is not an object, a missing or empty
prompt, a message without a role.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ncgrpo.data.types import Question

if TYPE_CHECKING:
    import datasets

__all__ = [
    "DATA_FILE_SUFFIXES",
    "DataFile",
    "DataFileError",
    "file_sha256",
    "is_data_file",
    "prompt_messages",
    "read_data_file",
]

#: What a data file of one's own may be: JSON Lines, a JSON list of rows, or parquet.
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
#: Columns a text data file may not carry besides its prompt: TRL reads them itself (images make a
#: prompt multimodal; completion columns are the trainer's own).
_RESERVED = ("images", "image", "completion", "completion_ids")


class DataFileError(ValueError):
    """A data file of one's own is missing, unreadable or has a bad row (the message names where)."""


def is_data_file(name: str | None) -> bool:
    """Whether a ``dataset_name`` / ``--data`` value names a data file (by its suffix)."""
    return name is not None and Path(str(name)).suffix.lower() in DATA_FILE_SUFFIXES


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes (a data file's content, part of a run's identity)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class DataFile:
    """The rows of one data file, checked: each has a usable prompt in :attr:`prompt_column`."""

    path: Path
    rows: list[dict[str, Any]]
    prompt_column: str
    lines: list[int] | None = None  # JSONL: the line of each row (1-based)

    def where(self, i: int) -> str:
        """``FILE line N`` (JSONL) or ``FILE row N`` (0-based, as ``datasets`` counts)."""
        return f"{self.path} line {self.lines[i]}" if self.lines is not None else f"{self.path} row {i}"

    @property
    def columns(self) -> list[str]:
        """Every column some row has, in first-seen order."""
        return list(dict.fromkeys(k for row in self.rows for k in row))

    def messages(self, i: int, *, system_prompt: str | None = None, math_prompt: str | None = None) -> list:
        """Row ``i``'s prompt as chat messages with string contents: a string prompt is one user
        message; ``math_prompt`` (if given) is appended to the last user message after a space, as the
        built-in datasets append theirs; ``system_prompt`` (if given) opens the conversation unless the
        row has its own system message."""
        msgs = prompt_messages(self.rows[i][self.prompt_column])
        if math_prompt:
            users = [m for m in msgs if m["role"] == "user"]
            if users:
                users[-1]["content"] = f"{users[-1]['content'].rstrip()} {math_prompt}"
        if system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs

    def to_trl_dataset(
        self,
        *,
        system_prompt: str | None = None,
        math_prompt: str | None = None,
        answer_column: str | None = None,
        answer_text: bool = False,
    ) -> datasets.Dataset:
        """A ``datasets.Dataset`` in TRL's conversational form: ``prompt`` (:meth:`messages`) plus every
        other column as written (they reach the reward functions as keyword arguments); with
        ``answer_column`` that column is also given as ``answer``, the column the built-in rewards read
        (``answer_text``: as text, what their grader compares; a JSON number 72 becomes "72")."""
        import datasets

        out = []
        for i, row in enumerate(self.rows):
            rec = {k: v for k, v in row.items() if k != self.prompt_column}
            if answer_column is not None and answer_column != "answer":
                rec["answer"] = row.get(answer_column)
            if answer_text and rec.get("answer") is not None and not isinstance(rec["answer"], str):
                rec["answer"] = str(rec["answer"])
            rec["prompt"] = self.messages(i, system_prompt=system_prompt, math_prompt=math_prompt)
            out.append(rec)
        columns = list(dict.fromkeys(k for rec in out for k in rec))
        out = [{k: rec.get(k) for k in columns} for rec in out]  # a column some rows lack is None there
        try:
            return datasets.Dataset.from_list(out)
        except Exception as e:  # noqa: BLE001 - Arrow's type errors say neither the file nor the column
            raise DataFileError(
                f"{self.path}: its columns do not fit one table ({type(e).__name__}: {e}); give each column "
                "one type in every row (e.g. every answer a string)"
            ) from None

    def check_column(self, column: str, *, what: str) -> None:
        """Every row has a non-empty ``column``; else the first row without it, named, and ``what``
        (who reads the column and how to name another)."""
        for i, row in enumerate(self.rows):
            value = row.get(column)
            if value is None or (isinstance(value, str) and not value.strip()):
                state = "has no column" if column not in row else "has an empty"
                have = ", ".join(row) or "none"
                raise DataFileError(f"{self.where(i)} {state} {column!r} ({what}); its columns: {have}")

    def questions(
        self,
        benchmark: str,
        *,
        answer_column: str | None = None,
        limit: int | None = None,
        answer_text: bool = False,
    ) -> list[Question]:
        """The rows as :class:`~ncgrpo.data.types.Question` objects (text only) for the probe and the
        evaluator: the prompt's messages in ``metadata["messages"]`` (rendered as written), the last user
        message as ``problem``, ``answer`` from ``answer_column`` (default ``answer``; empty if absent)."""

        col = answer_column or "answer"
        rows = self.rows if limit is None else self.rows[:limit]
        out = []
        for i, row in enumerate(rows):
            msgs = self.messages(i)
            users = [m["content"] for m in msgs if m["role"] == "user"]
            answer = row.get(col)  # the question's own answer: what the probe's records show
            out.append(
                Question(
                    benchmark=benchmark,
                    question_id=str(row.get("id", i)),
                    problem=users[-1] if users else msgs[-1]["content"],
                    answer="" if answer is None else str(answer),
                    role="in_domain",
                    metadata={
                        "messages": msgs,
                        "source": self.where(i),
                        "row": self._reward_row(row, answer_column, answer_text),
                    },
                )
            )
        return out

    def _reward_row(
        self, row: dict[str, Any], answer_column: str | None, answer_text: bool
    ) -> dict[str, Any]:
        """A row's columns as the reward functions get them (the prompt's excluded; ``answer`` from
        ``answer_column``, as text with ``answer_text``), as :meth:`to_trl_dataset` passes them."""
        out = {k: v for k, v in row.items() if k != self.prompt_column}
        if answer_column is not None and answer_column != "answer":
            out["answer"] = row.get(answer_column)
        if answer_text and out.get("answer") is not None and not isinstance(out["answer"], str):
            out["answer"] = str(out["answer"])
        return out


def prompt_messages(value: Any) -> list[dict[str, str]]:
    """A TRL prompt (a string, or chat messages with text contents) as messages with string contents;
    a ``ValueError`` says what is wrong with it."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a string or a non-empty list of chat messages, got {value!r:.60}")
    out = []
    for k, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        text_parts = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type", "text") == "text" for p in content
        )
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not (isinstance(content, str) or text_parts)
        ):
            raise ValueError(
                f'has a message ({k}) that is not {{"role": ..., "content": text}} (text parts only: no '
                f"images in a text prompt): {m!r:.80}"
            )
        out.append({"role": m["role"], "content": _content_text(content)})
    return out


def _content_text(content: Any) -> str:
    """A message's content as a string: a string as is, a list of text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content)


def _read_rows(path: Path, what: str) -> tuple[list[Any], list[int] | None]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist(), None
        except Exception as e:  # noqa: BLE001 - pyarrow's reasons, named with the file
            raise DataFileError(f"{what} {path}: not readable as parquet ({type(e).__name__}: {e})") from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataFileError(f"{what} {path}: not UTF-8 text ({e}); save it as UTF-8") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # else JSON Lines in a .json file, which datasets reads too
                raise DataFileError(
                    f"{what} {path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
        else:
            if not isinstance(data, list):
                raise DataFileError(
                    f"{what} {path}: a .json file must hold a list of rows ([{{...}}, {{...}}]), not a "
                    f"{type(data).__name__}; or write one JSON object a line into a .jsonl file"
                )
            return data, None
    rows, lines = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataFileError(
                f"{what} {path} line {n}: not valid JSON ({e.msg} at column {e.colno}); a .jsonl file holds "
                "one JSON object a line"
            ) from None
        lines.append(n)
    return rows, lines


def read_data_file(
    path: str | Path, prompt_column: str = "prompt", *, what: str = "dataset_name"
) -> DataFile:
    """The checked rows of a data file: every row an object with a prompt in ``prompt_column`` (a
    non-empty string, or a non-empty list of messages each with a string ``role`` and a string or text-part
    ``content``). ``what``: the setting that named the file, for the messages."""
    path = Path(path)
    if not path.exists():
        raise DataFileError(
            f"{what} {path}: no such file (a data file of your own: .jsonl, .json or .parquet)"
        )
    if path.is_dir():
        raise DataFileError(f"{what} {path} is a folder; give one .jsonl, .json or .parquet file")
    if path.suffix.lower() not in DATA_FILE_SUFFIXES:
        raise DataFileError(f"{what} {path}: a data file must end in {', '.join(DATA_FILE_SUFFIXES)}")
    rows, lines = _read_rows(path, what)
    if not rows:
        raise DataFileError(f"{what} {path}: the file holds no rows")
    data = DataFile(path, rows, prompt_column, lines)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataFileError(
                f'{data.where(i)}: a row must be a JSON object ({{"prompt": ...}}), not {row!r:.60}'
            )
        if prompt_column not in row:
            have = ", ".join(row) or "none"
            raise DataFileError(
                f"{data.where(i)} has no prompt column {prompt_column!r} (its columns: {have}); name the "
                "column holding the prompt with --prompt_column"
            )
        _check_prompt(data, i, row[prompt_column])
        reserved = [c for c in _RESERVED if c in row]
        if reserved:
            raise DataFileError(
                f"{data.where(i)}: column {reserved[0]!r} is the trainer's own (a text data file carries no "
                "images or completions); rename or drop it"
            )
        if prompt_column != "prompt" and "prompt" in row:
            raise DataFileError(
                f"{data.where(i)}: has a column 'prompt' besides the prompt column {prompt_column!r}; the "
                "prompt column becomes 'prompt' for the trainer, so rename one of them"
            )
    return data


def _check_prompt(data: DataFile, i: int, value: Any) -> None:
    try:
        prompt_messages(value)
    except ValueError as e:
        raise DataFileError(f"{data.where(i)}: the prompt column {data.prompt_column!r} {e}") from None
