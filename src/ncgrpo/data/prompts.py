"""Chat messages for one question, in the conversational multimodal form TRL and transformers take.

The user turn is a list of parts: each ``<image>`` placeholder in the problem becomes an
``{"type": "image"}`` part at its position (a problem without placeholders gets all its images
first, as in NoisyRollout's eval prompt), and the text between them ``{"type": "text", "text": ...}``
parts. The math prompt is appended to the question text, as NoisyRollout's training data does.
Every message's content is a list of parts, so a batch of messages fits one Arrow column.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ncgrpo.data.types import MATH_PROMPT, Question

__all__ = ["IMAGE_PLACEHOLDER", "build_messages", "image_hash", "prompt_hash", "prompt_text", "render_prompt"]

IMAGE_PLACEHOLDER = "<image>"
#: The help of the one prompt-template setting ``ncgrpo train`` (``ScriptArguments.math_prompt``) and
#: ``ncgrpo eval`` (``--math_prompt``) share: same name, default and meaning.
MATH_PROMPT_HELP = (
    "instruction appended to each problem (null: ncgrpo.data.types.MATH_PROMPT; a prompt a data file "
    "gives in its prompt column is used as written, nothing appended, unless this is set)"
)


def prompt_text(q: Question, math_prompt: str = MATH_PROMPT) -> str:
    """The question text the model reads: the problem, a space, then the math prompt (if any)."""
    problem = q.problem.rstrip()
    return f"{problem} {math_prompt}" if math_prompt else problem


def build_messages(
    q: Question,
    *,
    system_prompt: str | None = None,
    math_prompt: str = MATH_PROMPT,
) -> list[dict[str, Any]]:
    """``[system?, user]`` messages for ``q``; image parts carry no payload (the trainer fills them).

    Raises ValueError when the problem has placeholders whose count differs from ``len(q.images)``.

    A question read from a data file of one's own (:mod:`ncgrpo.data.files`) carries its prompt's
    messages in ``metadata["messages"]``: those are used as written (no math prompt appended), with
    ``system_prompt`` first unless they have their own system message.
    """
    own = q.metadata.get("messages") if isinstance(q.metadata, dict) else None
    if own:
        messages = [dict(m) for m in own]
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages
    text = prompt_text(q, math_prompt)
    n_images = len(q.images)
    segments = text.split(IMAGE_PLACEHOLDER)
    n_marks = len(segments) - 1
    parts: list[dict[str, Any]] = []
    if n_marks == 0:
        parts.extend({"type": "image"} for _ in range(n_images))
        parts.append({"type": "text", "text": text})
    elif n_marks != n_images:
        raise ValueError(
            f"{q.uid}: problem has {n_marks} '{IMAGE_PLACEHOLDER}' placeholder(s) but the question has "
            f"{n_images} image(s)"
        )
    else:
        for k, segment in enumerate(segments):
            if k > 0:
                parts.append({"type": "image"})
            if segment.strip():
                parts.append({"type": "text", "text": segment})
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    messages.append({"role": "user", "content": parts})
    return messages


def render_prompt(
    processor: Any,
    q: Question,
    *,
    system_prompt: str | None = None,
    math_prompt: str = MATH_PROMPT,
) -> str:
    """The chat text a model is prompted with for ``q``: :func:`build_messages` through the processor's
    chat template, generation prompt added, not tokenized. Both evaluation engines render with it, so
    their prompts cannot drift apart."""
    messages = build_messages(q, system_prompt=system_prompt, math_prompt=math_prompt)
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _canonical(obj: Any) -> Any:
    """JSON-able copy: drops None-valued keys (Arrow adds ``"text": None`` to image parts) and
    replaces image payloads by a marker, so a prompt hashes the same before and after a round trip."""
    if isinstance(obj, dict):
        return {k: ("<image>" if k == "image" else _canonical(v)) for k, v in obj.items() if v is not None}
    if isinstance(obj, list | tuple):
        return [_canonical(v) for v in obj]
    if isinstance(obj, str | int | float | bool):
        return obj
    return repr(type(obj).__name__)


def prompt_hash(messages: list[dict[str, Any]], length: int = 16) -> str:
    """Short sha256 hex of ``messages`` in canonical JSON (sorted keys, no whitespace), for records.

    The text only: image payloads hash as a marker (:func:`image_hash` is the pixels' hash)."""
    payload = json.dumps(_canonical(messages), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:length]


def image_hash(images: Sequence[Any], length: int = 16) -> str:
    """Short sha256 hex of the decoded pixels of ``images`` (PIL images), in order; ``""`` for none.

    Each image counts as what the model is given, its RGB pixels (``convert("RGB")``), with its size,
    so the same picture stored in another file format or compression hashes the same, and one changed
    pixel does not. Records carry it beside :func:`prompt_hash` so that two runs are paired only on
    questions that showed the same figures (many Geometry3K questions share a text and differ only there).
    """
    if not images:
        return ""
    h = hashlib.sha256(f"{len(images)} images".encode())
    for im in images:
        rgb = im.convert("RGB")
        h.update(f";{rgb.width}x{rgb.height};".encode())
        h.update(rgb.tobytes())
    return h.hexdigest()[:length]
