"""``branch_prefix``: text appended to the generation prompt so the prefill ends where reasoning begins.

Why (a departure from the paper, off by default): at the paper's site the displacement reaches only
the first-token logits (section 3.1, "Where the perturbation acts"). When a model opens every answer
with a format token (``<think>`` under NoisyRollout's prompt), that first token is nearly certain and
the noise changes no rollout. Appending the format token to the prompt -- what thinking-model chat
templates already do with ``"<think>\\n"`` -- moves the branch point to the first *reasoning* token.

Two places see it, and nothing else changes:

* the prompt: :func:`prefixed_chat_template` appends ``{% if add_generation_prompt %}PREFIX{% endif %}``
  to a chat template, so every renderer of the prompt (TRL's generation and its loss forward, the
  probe, SFT encoding) produces the same tokens, prefix included, with no per-call-site plumbing;
  :func:`with_branch_prefix` applies it to a processor/tokenizer (a shallow copy; the original is
  untouched); :func:`training_processor` is the copy the trainer holds from construction on, whose
  checkpoints keep the plain template;
* the reward: :func:`prefix_completions` puts the prefix back in front of each completion before the
  reward functions and the format check read it, so ``<think>...</think>...\\boxed{}`` keeps its
  meaning although ``<think>`` is now part of the prompt.

Evaluation keeps the plain prompt (the paper evaluates every model on the same prompt, and a
prefix-trained model must still be compared with vanilla on equal terms); pass the prefix to the
evaluator explicitly to evaluate with it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

__all__ = ["prefix_completions", "prefixed_chat_template", "training_processor", "with_branch_prefix"]

_MARK = "{# ncgrpo branch_prefix #}"  # no whitespace control: the template's own output is untouched


def prefixed_chat_template(template: str, prefix: str) -> str:
    """``template`` whose generation prompt is followed by ``prefix`` (verbatim, via a raw block).

    Idempotent for the same prefix; a template that already carries a different branch prefix is
    refused (two prefixes would silently stack)."""
    if not prefix:
        return template
    if "endraw" in prefix:
        raise ValueError(
            f"branch_prefix may not contain 'endraw' (it is inserted in a raw block): {prefix!r}"
        )
    block = f"{_MARK}{{% if add_generation_prompt %}}{{% raw %}}{prefix}{{% endraw %}}{{% endif %}}"
    if _MARK in template:
        if template.endswith(block):
            return template
        raise ValueError("this chat template already carries a different branch_prefix")
    return template + block


def _set_template(obj: Any, prefix: str) -> None:
    tmpl = getattr(obj, "chat_template", None)
    if isinstance(tmpl, str):
        obj.chat_template = prefixed_chat_template(tmpl, prefix)
    elif isinstance(tmpl, dict):  # named templates: prefix every one
        obj.chat_template = {k: prefixed_chat_template(v, prefix) for k, v in tmpl.items()}


def with_branch_prefix(processor: Any, prefix: str) -> Any:
    """A shallow copy of ``processor`` (a transformers processor or tokenizer) whose chat template(s)
    end the generation prompt with ``prefix``; its tokenizer is copied too. ``""`` returns it as is."""
    if not prefix:
        return processor
    if (
        getattr(processor, "chat_template", None) is None
        and getattr(getattr(processor, "tokenizer", None), "chat_template", None) is None
    ):
        raise ValueError("branch_prefix needs a chat template; this processor/tokenizer has none")
    out = copy.copy(processor)
    _set_template(out, prefix)
    tok = getattr(processor, "tokenizer", None)
    if tok is not None and tok is not processor:
        tok = copy.copy(tok)
        _set_template(tok, prefix)
        out.tokenizer = tok
    return out


def prefix_completions(completions: Sequence[Any], prefix: str) -> list[Any]:
    """Completions with ``prefix`` in front, in the form they came in: strings, or TRL's conversational
    ``[{"role": "assistant", "content": str | [parts]}]`` (the first text part gets the prefix)."""
    if not prefix:
        return list(completions)
    out: list[Any] = []
    for c in completions:
        if isinstance(c, str):
            out.append(prefix + c)
        elif isinstance(c, (list, tuple)) and c and isinstance(c[0], dict):
            msgs = [dict(m) for m in c]
            m = msgs[0]
            content = m.get("content")
            if isinstance(content, str) or content is None:
                m["content"] = prefix + (content or "")
            else:
                parts = [dict(p) for p in content]
                for p in parts:
                    if p.get("type") == "text":
                        p["text"] = prefix + (p.get("text") or "")
                        break
                else:
                    parts.insert(0, {"type": "text", "text": prefix})
                m["content"] = parts
            out.append(msgs)
        else:
            raise TypeError(f"cannot prefix a completion of type {type(c).__name__}")
    return out


def training_processor(processor: Any, prefix: str) -> Any:
    """The processor a trainer renders prompts with: :func:`with_branch_prefix`'s copy, whose
    ``save_pretrained`` is the original's, so every checkpoint (``Trainer._save``, hub pushes, FSDP
    saves) keeps the plain template: a saved model is evaluated on the plain prompt unless asked.
    Built once when the trainer is; ``""`` returns ``processor`` itself."""
    if not prefix:
        return processor
    out = with_branch_prefix(processor, prefix)
    out.save_pretrained = processor.save_pretrained  # bound to the original: saves the plain template
    return out
