"""The warm-up's reasoning traces of the synthetic suite's questions (:mod:`ncgrpo.toy.synthetic`): the
correct derivations, the image-blind shortcut, the mix the warm-up trains on, and the tokenizer's corpus."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping

from ncgrpo.data.types import MATH_PROMPT, Question
from ncgrpo.toy.suite import content_hash
from ncgrpo.toy.synthetic import LETTERS, _article, _plural

__all__ = [
    "DIRECT_SHARE",
    "SHORTCUT_ANSWERS",
    "corpus",
    "reasoning_trace",
    "reasoning_traces",
    "shortcut_trace",
    "trace_variant",
    "warmup_trace",
]


# ------------------------------------------------------------------------------ traces and corpus


def reasoning_traces(q: Question) -> list[str]:
    """Every correct derivation the warm-up may use for ``q``, each ending in ``\\boxed{answer}``.

    In-domain kinds have four genuinely different openings (state what the image shows first, write
    the computation straight away, name the rule first, ...), so the first reasoning token after
    ``<think>`` is a real decision of the base model -- the branch point NC-GRPO's prefill noise acts
    on. Out-of-domain kinds have one, written so that each step reads one fact from the image or the
    text: compare states which side is bigger before answering "bigger" or "smaller" (as one step,
    the tiny base answered "left" to every compare question; split, it answers 91.5% right), colour
    reads the shape's colour, then names the option that has it, POPE restates the object before
    deciding. (A colour trace that walked the options until the read colour came up taught the tiny
    base to read the colour but not to stop: it walked on to D on 87% of the test questions.)
    Entry 0 is the canonical trace (:func:`reasoning_trace`). All
    match NoisyRollout's format regex ``<think>.*</think>.*\\boxed{.*}.*``. The warm-up also teaches
    a fifth, wrong opening on purpose (:func:`shortcut_trace`, :func:`warmup_trace`).
    """
    spec = q.metadata["spec"]
    scene, ask = spec["scene"], spec["ask"]
    kind, ans = ask["kind"], q.answer
    if kind == "sides":
        n = len(scene["vertices"])
        bodies = [
            f"the shape has {n} corners, so it has {n} sides.",
            f"I count {n} corners. {n} corners means {n} sides.",
            f"{n} corners, so {n} sides.",
            f"counting the corners gives {n}, so the shape has {n} sides.",
        ]
    elif kind == "angle_sum":
        n = len(scene["vertices"])
        bodies = [
            f"the shape has {n} sides. ({n} - 2) * 180 = {ans}",
            f"I count {n} corners. ({n} - 2) * 180 = {ans}",
            f"({n} - 2) * 180 = {ans}",
            f"sum of angles is (sides - 2) * 180. the shape has {n} sides. ({n} - 2) * 180 = {ans}",
        ]
    elif kind == "perimeter":
        a, b, c = (lab["text"] for lab in scene["labels"])
        bodies = [
            f"the sides are {a}, {b} and {c}. {a} + {b} + {c} = {ans}",
            f"{a} + {b} + {c} = {ans}",
            f"perimeter is the sum of the sides. {a} + {b} + {c} = {ans}",
            f"I read {a}, {b} and {c}. {a} + {b} + {c} = {ans}",
        ]
    elif kind == "missing_angle":
        a, b = (lab["text"] for lab in scene["labels"])
        s = int(a) + int(b)
        bodies = [
            f"the angles are {a} and {b}. 180 - {a} - {b} = {ans}",
            f"180 - {a} - {b} = {ans}",
            f"{a} + {b} = {s}. 180 - {s} = {ans}",
            f"angles sum to 180. 180 - {a} - {b} = {ans}",
        ]
    elif kind == "count":
        bodies = [f"I count {ans} {_plural(ask['shape'], int(ans))}."]
    elif kind == "tallest":
        h = [str(bar["height"]) for bar in scene["bars"]]
        bodies = [f"the bars are {h[0]}, {h[1]}, {h[2]} and {h[3]} high. the tallest is bar {ans}."]
    elif kind == "bar_value":
        bodies = [f"the {ask['colour']} bar reaches {ans}."]
    elif kind == "compare":  # read which side is bigger first, then answer the question asked
        left, right = sorted(scene["objects"], key=lambda ob: ob["x"])
        bigger = "left" if left["r"] > right["r"] else "right"
        bodies = [f"the {bigger} {ask['shape']} is bigger. so the {ask['which']} one is the {ans} one."]
    elif kind == "colour":  # read the colour, then name the option that has it
        colour = ask["options"][LETTERS.index(ans)]
        bodies = [f"the {ask['shape']} is {colour}. {ans} is {colour}. so {ans}."]
    elif kind == "exists":  # restate what to look for right before deciding
        there = f"there is {_article(ask['colour'])}" if ans == "yes" else "there is no"
        target = f"{_article(ask['colour'])} {ask['colour']} {ask['shape']}"
        bodies = [f"looking for {target}. {there} {ask['colour']} {ask['shape']} in the image."]
    else:
        raise ValueError(f"no trace template for ask kind {kind!r}")
    return [f"<think>{body}</think> \\boxed{{{ans}}}" for body in bodies]


def reasoning_trace(q: Question, variant: int = 0) -> str:
    """A short correct derivation from the spec, ending in ``\\boxed{answer}``: opening ``variant`` of
    :func:`reasoning_traces` (taken modulo their number). Matches NoisyRollout's format regex
    ``<think>.*</think>.*\\boxed{.*}.*``."""
    traces = reasoning_traces(q)
    return traces[variant % len(traces)]


#: The careless answer of :func:`shortcut_trace`: per in-domain kind, one common value, whatever the figure.
SHORTCUT_ANSWERS = {"sides": "4", "angle_sum": "360", "perimeter": "12", "missing_angle": "60"}
#: Share of in-domain warm-up traces that take the shortcut instead of deriving.
DIRECT_SHARE = 0.3


def shortcut_trace(q: Question) -> str | None:
    """The habit the warm-up teaches on purpose, for RL to unlearn: no derivation, and an answer that
    ignores the figure (``<think>answer: 4.</think> \\boxed{4}`` for every "how many sides" question;
    :data:`SHORTCUT_ANSWERS`). ``None`` for out-of-domain kinds.

    Why: GRPO can only sharpen what the base model already samples. With every warm-up trace correct,
    the tiny base's errors were misreadings of the figure, which a 60-step RL run cannot fix (measured:
    vanilla GRPO's greedy in-domain accuracy 29.5 / 22.0 / 31.5 over three seeds against the base's
    28.0; every opening forced after ``<think>`` scored 27-29%). Here, as with a real instruct model
    that often answers without working, the base's most likely opening is a worse strategy than others
    it also samples; group-relative advantages (eq. 1) reward the derivations, and the decision sits
    at the first reasoning token, the branch point the prefill noise perturbs."""
    guess = SHORTCUT_ANSWERS.get(q.metadata["spec"]["ask"]["kind"])
    if guess is None:
        return None
    return f"<think>answer: {guess}.</think> \\boxed{{{guess}}}"


def trace_variant(q: Question) -> int:
    """The warm-up's opening for ``q``: a fixed pseudo-random pick from its content, independent of
    its answer. In-domain: the shortcut (returned as ``len(reasoning_traces(q))``) with probability
    :data:`DIRECT_SHARE`, else one of the derivations, each equally likely. Out of domain: 0."""
    key = q.metadata.get("hash") or content_hash(q.benchmark, q.problem, q.metadata.get("spec", {}))
    u = int(hashlib.sha256(f"trace-variant/{key}".encode()).hexdigest()[:8], 16) / 16**8
    n = len(reasoning_traces(q))
    if shortcut_trace(q) is None:
        return 0
    if u < DIRECT_SHARE:
        return n
    return min(n - 1, int((u - DIRECT_SHARE) / (1 - DIRECT_SHARE) * n))


def warmup_trace(q: Question) -> str:
    """The completion the supervised warm-up trains on for ``q`` (:func:`trace_variant` picks it)."""
    k = trace_variant(q)
    traces = reasoning_traces(q)
    return shortcut_trace(q) if k == len(traces) else traces[k]


def corpus(suite: Mapping[str, Iterable[Question]]) -> Iterator[str]:
    """Texts for tokenizer training: the math prompt, then every problem and its reasoning trace."""
    yield MATH_PROMPT
    for questions in suite.values():
        for q in questions:
            yield q.problem
            yield from reasoning_traces(q)
            if (short := shortcut_trace(q)) is not None:
                yield short
