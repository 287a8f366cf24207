"""The one row plan: which rows of a group are clean or noisy, and which draw each noisy row gets.

Algorithm 1, lines 2-4: a group of ``G = 2n`` rollouts of one prompt is ``n`` rows sampled from the
clean prefill (branches ``0 .. n-1``) and ``n`` rows from a perturbed one (branches ``n .. 2n-1``).
Every engine (transformers, vLLM), the TRL trainer, the rollout helper and the benchmarks build
their rows here, so the layout cannot drift between them. What differs by method (two-pass, paired,
the key rule) is read from the method object (:mod:`ncgrpo.methods`); the plan compares no names.

Names: ``branch`` is a row's index within its group (``0 .. G-1``); ``draw`` (``NoiseKey.draw``) is
the index of a noise draw within the noisy half (antithetic partners share one draw).

A row's plan depends only on its GLOBAL row index in the generation batch, its prompt id and
``(seed, step)``: never on the process, engine or batch layout that generates it (TRL's
``RepeatSampler`` puts a prompt's ``G`` rows next to each other in the global batch, so a group may
span processes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ncgrpo.core.noise import NoiseKey, RowNoise, noise_seed

__all__ = [
    "RowPlan",
    "plan_group",
    "plan_rows",
    "prompt_id_for",
    "prompt_noise_id",
    "sampling_seed",
]


@dataclass(frozen=True)
class RowPlan:
    """What one rollout row of the global generation batch is.

    ``group`` is TRL's group (``global_row // G``); ``branch = global_row % G``; ``noisy`` iff
    ``branch >= n``. ``key`` names the row's noise draw (``None`` on clean rows and for the
    first-token-temperature control); ``sign`` is ``-1`` for the second member of an antithetic pair
    (which reuses its partner's key). ``adv_group`` is the advantage group the row is normalised in.
    """

    global_row: int
    group: int
    branch: int
    noisy: bool
    prompt_id: int
    key: NoiseKey | None = None
    sign: float = 1.0
    adv_group: int = 0

    def as_tuple(self) -> tuple:
        k = self.key
        return (
            self.global_row,
            self.branch,
            self.noisy,
            self.sign,
            None if k is None else (k.seed, k.step, k.prompt_id, k.draw),
            self.adv_group,
        )


def plan_rows(
    global_rows: Sequence[int],
    prompt_ids: Sequence[int],
    *,
    num_generations: int,
    method: Any,
    seed: int,
    step: int,
    antithetic_grouping: str = "joint",
) -> list[RowPlan]:
    """Plan the rows ``global_rows`` (indices into the global generation batch) for step ``step``.

    ``method``: a rollout method (:func:`ncgrpo.methods.get_method`); the plan reads what it is: two-pass
    (``method.two_pass``), paired (``method.paired``) and which key a noisy row carries
    (``method.key_rule``). ``branch = global_row % G``; the noisy half is ``branch >= n``, and its
    ``j = branch - n``-th row:

    - clean rows: no key.
    - ``key_rule="row"`` (``latent``; ``first_token_marginal``, whose key names the row's pool of draws,
      :func:`ncgrpo.core.marginal.pool_keys`): ``key = NoiseKey(seed, step, prompt_id, draw=j)``.
    - ``key_rule="pair"`` (``antithetic`` / ``spsa``): pairs ``[+0, -0, +1, -1, ...]``: row ``j`` uses
      ``NoiseKey(seed, step, prompt_id, j // 2)`` with ``sign = +1`` for even ``j``, ``-1`` for odd.
    - ``key_rule="prompt"`` (``image``): every noisy row of a prompt carries
      ``NoiseKey(seed, step, prompt_id, 0)``: one distorted image per prompt, shared by its noisy half
      (NoisyRollout; :func:`ncgrpo.core.image_noise.prompt_image_seed`).
    - ``key_rule="none"`` (``first_token_temperature``): noisy rows carry no key.

    ``adv_group`` is ``group`` except for ``antithetic_grouping="separate"`` (paired methods), which
    splits each 2n group into two advantage groups of n rows: group ``2*group`` holds clean branches
    ``0 .. n/2-1`` and the ``+`` pair members, group ``2*group + 1`` clean branches ``n/2 .. n-1``
    and the ``-`` members. Each keeps a 50/50 clean/noisy mix (so Prop. 2's contrast is still
    there) and no ``(+eps, -eps)`` pair shares a baseline: the group mean no longer averages the pair
    into its even part, the cancellation Lemma 1 describes for the joint group.
    """
    if isinstance(method, str):
        raise TypeError(
            f"plan_rows takes the rollout method object, not its name: method=ncgrpo.methods.get_method({method!r})"
        )
    G = int(num_generations)
    method.check_group_size(G)
    if antithetic_grouping not in ("joint", "separate"):
        raise ValueError(f"antithetic_grouping must be 'joint' or 'separate', got {antithetic_grouping!r}")
    if len(global_rows) != len(prompt_ids):
        raise ValueError(f"one prompt id per row: {len(global_rows)} rows, {len(prompt_ids)} prompt ids")
    n = G // 2
    separate = method.paired and antithetic_grouping == "separate"
    out = []
    for row, pid in zip(global_rows, prompt_ids, strict=True):
        row, pid = int(row), int(pid)
        group, branch = divmod(row, G)
        noisy = method.two_pass and branch >= n
        key, sign, adv_group = None, 1.0, group
        if noisy:
            j = branch - n
            if method.key_rule == "row":
                key = NoiseKey(seed, step, pid, j)
            elif method.key_rule == "pair":
                key = NoiseKey(seed, step, pid, j // 2)
                sign = 1.0 if j % 2 == 0 else -1.0
            elif method.key_rule == "prompt":
                key = NoiseKey(seed, step, pid, 0)
        if separate:
            first = (branch < n // 2) if not noisy else (sign > 0)
            adv_group = 2 * group + (0 if first else 1)
        out.append(RowPlan(row, group, branch, noisy, pid, key, sign, adv_group))
    return out


def plan_group(n: int, sigma: float, seed: int, step: int, prompt_id: int, method: Any) -> list[RowNoise]:
    """The :class:`RowNoise` of one group of ``2n`` rows (``n`` clean, then ``n`` noisy): :func:`plan_rows`
    for rows ``0 .. 2n-1`` of one prompt, turned into hook instructions by ``method.row_noise``."""
    if n < 1:
        raise ValueError(f"n must be >= 1 (G = 2n rows per group), got {n}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    plans = plan_rows(
        range(2 * n), [prompt_id] * (2 * n), num_generations=2 * n, method=method, seed=seed, step=step
    )
    return [method.row_noise(p, sigma) for p in plans]


def sampling_seed(seed: int, step: int) -> int:
    """Seed of the token sampler for step ``step`` of run ``seed`` (independent of the noise streams)."""
    return noise_seed("sample", seed, step)


def prompt_noise_id(token_ids: Sequence[int], images: Sequence[Any] = ()) -> int:
    """A stable 63-bit prompt id from the prompt's token ids (and the pixels of its images, if any).

    Identical prompts (same tokens, same images) then share their noise draws; pass dataset indices
    or question ids when that is not wanted. (Not the records' ``prompt_hash``, a sha256 string of
    the rendered prompt: this one is an integer that only names noise streams.)
    """

    parts: list[int | str] = ["prompt", *[int(t) for t in token_ids]]
    for img in images:
        h = hashlib.blake2b(digest_size=8)
        if hasattr(img, "tobytes"):
            h.update(str(getattr(img, "size", "")).encode() + str(getattr(img, "mode", "")).encode())
            h.update(img.tobytes())
        else:
            h.update(repr(img).encode())
        parts.append("image:" + h.hexdigest())
    return noise_seed(*parts)


def prompt_id_for(
    question_id: Any = None, token_ids: Sequence[int] | None = None, images: Sequence[Any] | None = None
) -> int:
    """The prompt id a trainer uses: a hash of the ``question_id`` column when the dataset has one,
    else :func:`prompt_noise_id` of the prompt's token ids and image pixels. Independent of batch
    layout, process and Python's hash seed."""
    if question_id is not None:
        return noise_seed("question_id", str(question_id))
    if token_ids is None:
        raise ValueError("prompt_id_for needs a question_id or the prompt's token ids")
    return prompt_noise_id(list(token_ids), [im for im in (images or []) if im is not None])
