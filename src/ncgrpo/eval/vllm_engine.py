"""``ncgrpo eval --engine vllm``: the evaluation's greedy decoding on vLLM's offline engine.

The same protocol as the transformers engine (:mod:`ncgrpo.eval.evaluate`): the same prompts (the
same chat template rendered by the same tokenizer or processor, tokenized the same way), greedy
decoding (``temperature=0``), no noise (no request carries the plugin's ``extra_args``, so the NC-GRPO
plugin leaves every row untouched), the same stop tokens and repetition penalty as the model's
``generation_config.json``, the completion decoded from its token ids by the same tokenizer, and the
same scorer and records. On a float32 model the greedy tokens equal transformers' (the vLLM test
suite checks this record for record).

Batching is vLLM's: the pending questions are submitted to the engine, which schedules them
(``batch_size`` = vLLM's ``max_num_seqs``, the sequences decoded at once; four times as many are
kept queued, topped up every step: :meth:`VLLMEvalEngine.stream_greedy`), and the questions that
finish in an engine step are handed back right away, so :func:`~ncgrpo.eval.evaluate.evaluate`
appends their records (one fsync per step) and a kill loses only the unfinished ones.

Text models take token-id prompts; a vision-language model takes the rendered text, which holds one
placeholder per image, with the question's images as ``multi_modal_data`` (vLLM's processor expands
each placeholder once; never the processor's already expanded ids, see
:mod:`ncgrpo.engines.vllm_multimodal`). Both are tested against the transformers engine, the vision
path on a tiny Qwen2.5-VL (it needs the torchvision scripts/setup_vllm.sh installs).

The engine is built as the repository's other vLLM users build it on a CPU (tests/engines/test_vllm.py,
benchmarks/bench_vllm_rollout.py): ``enforce_eager`` and an explicit KV-cache size (unless
``VLLM_CPU_KVCACHE_SPACE`` is set), here sized for ``batch_size`` sequences of the longest prompt
plus ``max_new_tokens``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from ncgrpo.data.prompts import render_prompt
from ncgrpo.data.types import Question
from ncgrpo.models import (
    check_weight_files,
    is_vision_language,
    load_config,
    load_processor,
    resolve_dtype,
    tokenizer_of,
)

#: ``settings`` below is a :class:`ncgrpo.eval.evaluate.DecodingSettings` (not imported: evaluate imports
#: this module, lazily, for ``--engine vllm``)
_Settings = Any

__all__ = [
    "VLLMEvalEngine",
    "check_generation_config",
    "greedy_sampling_params",
    "load_vllm_engine",
    "vllm_prompts",
]

#: generation_config.json fields that change greedy outputs and that this engine does not carry
#: over to vLLM: refused rather than silently dropped.
_UNMIRRORED = ("no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
               "forced_bos_token_id", "forced_eos_token_id", "sequence_bias", "min_new_tokens")  # fmt: skip


def vllm_prompts(
    processor: Any, questions: Sequence[Question], settings: _Settings, *, vision_language: bool
) -> list[dict[str, Any]]:
    """vLLM prompts for ``questions``: ``{"prompt_token_ids": ids}`` for a text model (the ids the
    transformers engine feeds ``generate``: the rendered chat, no special tokens added), and
    ``{"prompt": text, "multi_modal_data": {"image": [RGB images]}}`` for a vision-language model
    (vLLM expands each image placeholder of the rendered text; a question without images gets the
    text alone)."""
    tok = tokenizer_of(processor)
    out: list[dict[str, Any]] = []
    for q in questions:
        text = render_prompt(
            processor, q, system_prompt=settings.system_prompt, math_prompt=settings.math_prompt
        )
        if q.images and not vision_language:
            raise ValueError(f"{q.uid}: the question has images but the model is text-only")
        if vision_language:
            prompt: dict[str, Any] = {"prompt": text}
            if q.images:
                prompt["multi_modal_data"] = {"image": [im.convert("RGB") for im in q.images]}
            out.append(prompt)
        else:
            out.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
    return out


def _generation_config(path: str | Path) -> Any:
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers' defaults
        return GenerationConfig()


def check_generation_config(generation_config: Any) -> None:
    """Refuse a generation config with a setting that changes greedy outputs and that
    :func:`greedy_sampling_params` does not carry over to vLLM (``_UNMIRRORED``)."""
    for name in _UNMIRRORED:
        v = getattr(generation_config, name, None)
        if v not in (None, 0, [], {}):
            raise ValueError(
                f"generation_config.json sets {name}={v!r}, which --engine vllm does not carry over; "
                "evaluate with --engine transformers or remove the setting"
            )


def greedy_sampling_params(generation_config: Any, tokenizer: Any, settings: _Settings):
    """vLLM ``SamplingParams`` that decode as ``model.generate(do_sample=False, num_beams=1,
    max_new_tokens=...)`` does with this generation config: argmax, stop at any of its EOS ids (and the
    tokenizer's), its repetition penalty, token ids only (the caller decodes them)."""
    check_generation_config(generation_config)
    from vllm import SamplingParams

    gc = generation_config
    eos = gc.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return SamplingParams(
        n=1,
        temperature=0.0,
        max_tokens=settings.max_new_tokens,
        stop_token_ids=eos,
        repetition_penalty=float(gc.repetition_penalty or 1.0),
        detokenize=False,
        skip_special_tokens=True,
    )


def _external_id(request_id: str) -> str:
    """The id :meth:`vllm.LLM.enqueue` gave a request (its counter), from an internal or external id."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and len(tail) == 8 else request_id


class VLLMEvalEngine:
    """A vLLM ``LLM`` that answers evaluation questions greedily (see the module docstring).

    ``engine_name`` marks it for :func:`ncgrpo.eval.evaluate.evaluate` (run.json ``engine``)."""

    engine_name = "vllm"
    #: requests kept in vLLM, as a multiple of ``batch_size`` (its ``max_num_seqs``)
    queue_factor = 4

    def __init__(self, llm: Any, processor: Any, generation_config: Any, *, vision_language: bool) -> None:
        self.llm = llm
        self.processor = processor
        self.generation_config = generation_config
        self.is_vision_language = vision_language

    def stream_greedy(
        self, questions: Sequence[Question], settings: _Settings
    ) -> Iterator[tuple[list[Question], list[str]]]:
        """Submit the questions, then yield ``(questions, outputs)`` for the requests that finish in each
        engine step, in finishing order; an output is its token ids decoded by the tokenizer with special
        tokens skipped, as the transformers engine decodes.

        At most :attr:`queue_factor` x ``batch_size`` requests are in vLLM at a time (all of them when
        there are fewer), topped up after every step: vLLM always has a full batch waiting, and a long
        evaluation does not render and preprocess every prompt (every image) before the first answer."""
        if not questions:
            return
        tok = tokenizer_of(self.processor)
        params = greedy_sampling_params(self.generation_config, tok, settings)
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine has requests of another caller in flight")
        depth = self.queue_factor * settings.batch_size
        todo = list(questions)[::-1]  # popped from the end: submitted in order
        # enqueue returns vLLM's internal ids ("<id>-<8 random chars>"); outputs carry the "<id>" given
        pending: dict[str, tuple[str, Question]] = {}

        def top_up() -> None:
            batch = [todo.pop() for _ in range(min(len(todo), depth - len(pending)))]
            if not batch:
                return
            prompts = vllm_prompts(self.processor, batch, settings, vision_language=self.is_vision_language)
            ids = self.llm.enqueue(
                prompts, params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}
            )
            pending.update({_external_id(i): (i, q) for i, q in zip(ids, batch, strict=True)})

        try:
            top_up()
            while engine.has_unfinished_requests():
                done = [o for o in engine.step() if o.finished]
                if done:
                    answered = [pending.pop(_external_id(o.request_id))[1] for o in done]
                    texts = [tok.decode(list(o.outputs[0].token_ids), skip_special_tokens=True) for o in done]
                    top_up()  # before the caller writes: vLLM is not left idle meanwhile
                    yield answered, texts
        finally:
            if pending:  # an error or a closed generator: drop what is still queued
                engine.abort_request([i for i, _ in pending.values()], internal=True)
        if pending or todo:
            raise RuntimeError(f"vLLM finished without answering {len(pending) + len(todo)} question(s)")

    def close(self) -> None:
        """Stop the engine's processes now (not at interpreter exit)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def __enter__(self) -> VLLMEvalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _platform_device(device: str | None) -> str:
    """``cuda`` or ``cpu``: vLLM's platform, checked against ``--device``."""
    from vllm.platforms import current_platform

    kind = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda_alike() else None
    if kind is None:
        raise ValueError(
            f"--engine vllm: vLLM runs on {current_platform.device_type!r} here, not cpu or cuda"
        )
    if device in (None, "auto") or device == kind:
        return kind
    if str(device).startswith("cuda:") and kind == "cuda":
        raise ValueError(
            f"--engine vllm --device {device}: vLLM takes the GPU from CUDA_VISIBLE_DEVICES; "
            f"run with CUDA_VISIBLE_DEVICES={device.partition(':')[2]} --device cuda"
        )
    raise ValueError(
        f"--engine vllm --device {device}: this vLLM build runs on {kind}; use --device {kind} or auto"
    )


def _kv_bytes_per_token(config: Any, dtype: Any) -> int:
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def load_vllm_engine(
    path: str | Path,
    *,
    dtype: str = "auto",
    device: str = "auto",
    settings: _Settings,
    questions: Sequence[Question] = (),
    seed: int = 0,
) -> tuple[VLLMEvalEngine, Any]:
    """``(engine, processor)``: a :class:`VLLMEvalEngine` on the model folder ``path`` and the
    tokenizer / processor that renders its prompts. ``dtype`` ``auto``: float32 on a CPU, bfloat16 on
    a GPU that has it (as the transformers engine). A text model's context is sized to the longest
    prompt of ``questions`` plus ``max_new_tokens``."""

    kind = _platform_device(device)
    torch_dtype = resolve_dtype(dtype, torch.device(kind))
    config = load_config(path)
    check_weight_files(path)
    vision_language = is_vision_language(config)
    processor = load_processor(path, config=config)
    generation_config = _generation_config(path)
    check_generation_config(generation_config)  # refused before the engine starts
    max_pos = getattr(config.get_text_config(), "max_position_embeddings", None)
    max_model_len = None
    if not vision_language and questions:
        longest = max(
            len(p["prompt_token_ids"])
            for p in vllm_prompts(processor, questions, settings, vision_language=False)
        )
        max_model_len = longest + settings.max_new_tokens
        if max_pos is not None:
            max_model_len = min(max_model_len, int(max_pos))
    kwargs: dict[str, Any] = dict(
        model=str(path),
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[torch_dtype],
        seed=seed,
        max_num_seqs=settings.batch_size,
        max_model_len=max_model_len,
    )
    if vision_language:  # images only, as many per prompt as the most any question has
        kwargs["limit_mm_per_prompt"] = {"image": max([len(q.images) for q in questions] + [1]), "video": 0}
    if kind == "cpu":
        kwargs["enforce_eager"] = True
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            tokens = settings.batch_size * (max_model_len or int(max_pos or 4096))
            # block rounding (up to one block of 128 tokens per sequence) plus one spare block
            tokens += 128 * (settings.batch_size + 1)
            kwargs["kv_cache_memory_bytes"] = tokens * _kv_bytes_per_token(config, torch_dtype)
    from vllm import LLM

    llm = LLM(**kwargs)
    return VLLMEvalEngine(llm, processor, generation_config, vision_language=vision_language), processor
