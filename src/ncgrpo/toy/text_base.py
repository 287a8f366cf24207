"""The embedded base's language model as a text-only causal LM, and small text data for it: what a
text recipe's ``--smoke`` form trains on (:func:`ensure_text_base_model`, :func:`arithmetic_rows`,
:func:`ensure_text_smoke_data`).

The embedded base (:func:`ncgrpo.toy.base_model.ensure_base_model`) is a 3-layer Qwen2.5-VL. Its
language model is a Qwen2 decoder: with text-only inputs its multimodal RoPE gives every token the same
position on all three axes, which is Qwen2's 1-D RoPE, so the same weights as a ``Qwen2ForCausalLM``
give the same logits (checked when it is built). Saved with the base's tokenizer and chat template and
no ``vision_config``, it loads as a hub text checkpoint does (``AutoModelForCausalLM``,
``AutoTokenizer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from ncgrpo import models
from ncgrpo.runs.folder import atomic_write_text
from ncgrpo.toy import base_model
from ncgrpo.toy.base_model import _file_lock, build_into

__all__ = ["arithmetic_rows", "ensure_text_base_model", "ensure_text_smoke_data"]

_VERSION = 1  # of the conversion below: a change gives a new cache folder
#: Marks a complete build (written last).
_DONE = "text_base.json"


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "ncgrpo"


def _base_hash(base: Path) -> str:
    h = hashlib.sha256(f"v{_VERSION}".encode())
    for name in sorted(p.name for p in base.iterdir() if p.is_file()):
        h.update(name.encode())
        h.update((base / name).read_bytes())
    return h.hexdigest()[:12]


def ensure_text_base_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the embedded base's language model as a text-only ``Qwen2ForCausalLM`` (with its
    tokenizer), built on first use into ``cache_dir`` (default ``~/.cache/ncgrpo``)
    ``/text-base-<hash of the base>``; concurrent callers wait on a lock and the build is renamed into
    place, so nobody sees half of it."""

    base = base_model.ensure_base_model()
    root = _cache_root(cache_dir)
    target = root / f"text-base-{_base_hash(base)}"
    if (target / _DONE).is_file():
        return target
    with _file_lock(root / f".{target.name}.lock"):
        if (target / _DONE).is_file():
            return target
        build_into(target, lambda folder: _build(base, folder), prefix=".text-base-build-")
    return target


def _build(base: Path, out: Path) -> None:
    vl, processor = models.load_model_and_processor(str(base), dtype="float32", device="cpu")
    text = vl.config.text_config.to_dict()
    rope = dict(text.get("rope_parameters") or {})
    rope.pop("mrope_section", None)
    drop = ("model_type", "architectures", "layer_types", "transformers_version", "dtype", "rope_parameters")
    config = Qwen2Config(**{k: v for k, v in text.items() if k not in drop}, rope_parameters=rope)
    config.architectures = ["Qwen2ForCausalLM"]
    model = Qwen2ForCausalLM(config)
    prefix = "model.language_model."
    weights = {}
    for k, v in vl.state_dict().items():
        if k.startswith(prefix):
            weights["model." + k[len(prefix) :]] = v
        elif k.startswith("lm_head."):
            weights[k] = v
    model.load_state_dict(weights, strict=True)
    model.eval()
    tok = AutoTokenizer.from_pretrained(base)
    ids = tok("What is 3 + 4?", return_tensors="pt")
    with torch.no_grad():  # the conversion is exact on text (module docstring)
        diff = (vl(**ids).logits - model(**ids).logits).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"the embedded base's language model as Qwen2 differs from it by {diff} in logits")
    model.generation_config = GenerationConfig.from_pretrained(base)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # a tokenizer alone: no processor of the VL base named (AutoProcessor then gives the tokenizer back)
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("processor_class", None)
    cfg.pop("image_token", None)
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    template = getattr(processor, "chat_template", None) or tok.chat_template
    if template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template)
    (out / _DONE).write_text(
        json.dumps({"from": str(base), "version": _VERSION, "max_logit_diff": diff}) + "\n"
    )


def arithmetic_rows(
    n: int = 16, *, seed: int = 0, prompt_column: str = "prompt", answer_column: str | None = None
) -> list[dict[str, Any]]:
    """``n`` one-line addition word problems ("What is 17 + 25?") as data-file rows: the question in
    ``prompt_column``, the sum (text) in ``answer_column`` (default ``answer``)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {prompt_column: f"What is {a} + {b}?", answer_column or "answer": str(a + b), "id": str(i)}
        )
    return rows


def ensure_text_smoke_data(
    prompt_column: str = "prompt",
    answer_column: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """A JSONL of :func:`arithmetic_rows` in the given columns, written once (atomically) under
    ``cache_dir`` (default ``~/.cache/ncgrpo``) ``/text-smoke/``: a text recipe's ``--smoke`` data."""

    rows = arithmetic_rows(16, prompt_column=prompt_column, answer_column=answer_column)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = _cache_root(cache_dir) / "text-smoke" / f"arithmetic-{digest}.jsonl"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    return path
