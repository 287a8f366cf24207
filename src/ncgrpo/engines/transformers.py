"""The transformers engine hook: NC-GRPO's prefill perturbation around ``model.generate``.

Paper section 3.1, "Where the perturbation acts": the hook fires on the tensor *returned* by the
language-model stack (the output of the text model's final norm, before ``lm_head``) in the prefill
forward only. The KV cache is written inside that call from clean activations, so the perturbation
moves the first-token logits of the flagged rows and nothing else; every decode step is untouched
(algorithm lines 4-7). ``site=<layer index>`` is the propagating variant the paper names but does not
evaluate: the INPUT of decoder layer ``l`` is perturbed at prefill, so the displacement reaches the
KV cache of layer ``l`` and every layer above (several layers get depth-decayed scales).

The noise itself comes from :mod:`ncgrpo.core.noise` (eq. 2 via :func:`~ncgrpo.core.noise.perturb_rows`); this
module only decides *where* and *when* it is applied::

    rows = [RowNoise(), RowNoise(0.2, NoiseKey(seed, step, prompt_id, 0))]
    with prefill_noise(model, rows) as hook:
        out = model.generate(**inputs, max_new_tokens=64)
    hook.last.rel          # [B] measured ||h~ - h|| / ||h|| per row (0 on clean rows)

Rules:

- prefill = a forward of the text model whose KV cache is empty (``past_key_values`` is None or has
  ``get_seq_length() == 0``), or the first forward on a cache
  :func:`~ncgrpo.engines.shared_prefill.shared_prefill_generate` prefilled with the prompt minus its
  last token (:func:`~ncgrpo.engines.branch_point.at_branch_point`): that forward computes only the last
  prompt position, the one whose state reaches the first-token logits. ``use_cache=False`` is
  refused: without a cache every decode step
  re-runs the whole sequence and cannot be told from a prefill. Chunked prefill
  (``prefill_chunk_size``) and continuing from a non-empty cache are not supported (the hook stays
  inert on a non-empty cache).
- Only the top-level model's pre-hook runs on every forward. The stack's hooks are removed after a
  prefill that came through the top-level forward (``generate``'s first forward) and registered again,
  in their place, by the next top-level forward that is a branch point: the decode steps run the stack
  without hook calls. A prefill of the stack called directly keeps them (the next such call is
  perturbed too); so do modules that carry other forward hooks. A prefill run on the stack directly
  *after* a top-level prefill in the same ``with`` block is not perturbed (no caller does that:
  :func:`~ncgrpo.engines.shared_prefill.shared_prefill_generate`'s direct prefix pass is never perturbed).
- Inputs must be left-padded (what ``generate`` wants for decoder-only models); the 2-D attention
  mask is read from the top-level forward so that each prompt's noise depends only on its real tokens.
  A noisy row with padding after its first real token (right padding) is a ``ValueError`` naming
  ``tokenizer.padding_side = "left"``: its last position is padding, where no noise is drawn, so it
  would otherwise sample from clean logits without a word.
- ``positions="auto"`` (final-norm site) perturbs only the positions whose states reach the logits
  (``generate`` passes ``logits_to_keep=1``: the last prompt token). Because every position's noise
  depends only on (key, distance from the end of the prompt) this is bit-identical to
  ``positions="all"`` (eq. 2 applied to every prompt token, as the paper writes it) at a fraction of
  the cost. Layer sites always perturb every prompt token (all of them reach the KV cache).
- Layer sites draw their noise from a per-layer key (``seed`` replaced by
  ``noise_seed("layer", seed, l)``), so different layers get independent draws while antithetic
  partners still share theirs.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ncgrpo.core.noise import (
    RowNoise,
    depth_decayed_sigmas,
    noise_seed,
    perturb_rows,
    perturb_selected,
    relative_perturbation,
)
from ncgrpo.engines.branch_point import at_branch_point, find_text_stack

__all__ = [
    "NoiseHook",
    "PrefillRecord",
    "SiteRecord",
    "prefill_noise",
]

Site = Literal["final_norm"] | int | Sequence[int]


@dataclass
class SiteRecord:
    """What one injection site did in one prefill. Tensors are float32 on the CPU.

    ``rel`` ``# [B]``: mean measured ``||h~_t - h_t|| / ||h_t||`` over the perturbed tokens (0 on clean
    rows); ``clean_last`` / ``noisy_last`` ``# [B, d]``: the site's state at the last prompt token
    before / after the perturbation (identical on clean rows), the inputs of the eq. (4) metric.
    """

    rel: torch.Tensor
    clean_last: torch.Tensor
    noisy_last: torch.Tensor


@dataclass
class PrefillRecord:
    """One prefill forward under the hook.

    ``sites`` maps ``"final_norm"`` or a layer index to its :class:`SiteRecord`; the ``rel`` /
    ``clean_last`` / ``noisy_last`` shortcuts read the primary site: the final norm, or the top-most
    layer (the one with the full sigma). ``final_last`` ``# [B, d]`` is the stack's returned state at
    the last prompt token as the logits see it (perturbed at the final-norm site, propagated from the
    layers below otherwise). ``hook_s`` / ``prefill_s``: seconds spent in the hook bodies and in the
    whole prefill forward of the top-level model, vision tower and ``lm_head`` included (only when
    ``timing=True``; else NaN).
    """

    sites: dict[str | int, SiteRecord] = field(default_factory=dict)
    primary: str | int = "final_norm"
    final_last: torch.Tensor | None = None
    hook_s: float = float("nan")
    prefill_s: float = float("nan")

    @property
    def rel(self) -> torch.Tensor:
        return self.sites[self.primary].rel

    @property
    def clean_last(self) -> torch.Tensor:
        return self.sites[self.primary].clean_last

    @property
    def noisy_last(self) -> torch.Tensor:
        return self.sites[self.primary].noisy_last


def _last_index(mask: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """Index of each row's last real token. ``# [B]``"""
    if mask is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=device)
    pos = torch.arange(T, device=mask.device)
    last = torch.where(mask.ne(0), pos, -1).amax(1)  # [B] -1: no real token
    idx = torch.where(last >= 0, last, T - 1)  # (an all-padding row: the last position)
    return idx.to(device=device, dtype=torch.long)


def _gather_last(h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``h[b, idx[b]]`` as float32 on the CPU. ``# [B, d]``"""
    return h[torch.arange(h.shape[0], device=h.device), idx].detach().float().cpu()


def _layer_rows(rows: Sequence[RowNoise], layer: int) -> list[RowNoise]:
    """Per-layer keys so different layers draw independent noise (antithetic partners still share)."""
    out = []
    for r in rows:
        if r.key is None:
            out.append(r)
        else:
            key = dataclasses.replace(r.key, seed=noise_seed("layer", r.key.seed, layer))
            out.append(dataclasses.replace(r, key=key))
    return out


class NoiseHook:
    """The handle ``prefill_noise`` yields: configuration plus one :class:`PrefillRecord` per prefill."""

    def __init__(
        self,
        rows: Sequence[RowNoise],
        layers: list[int] | None,
        layer_decay: float,
        steer: torch.Tensor | None,
        positions: Literal["auto", "all"],
        timing: bool,
        resolve: Callable[[torch.Tensor], Sequence[RowNoise]] | None = None,
    ) -> None:
        self.rows = list(rows)
        #: called once, at the final-norm site's prefill, with the clean branch-point states ``# [B, d]``
        #: before any noise; returns the rows' noise (the target schedule's sigma_k, solved on them)
        self.resolve = resolve
        self.layers = layers  # None: final-norm site
        self.scales = depth_decayed_sigmas(layers, layer_decay) if layers else {}
        self._layer_rows = {layer: _layer_rows(self.rows, layer) for layer in layers} if layers else {}
        self.steer = steer
        self.positions = positions
        self.timing = timing
        self.records: list[PrefillRecord] = []
        self.any_noisy = any(r.noisy for r in self.rows)
        self._noisy = [b for b, r in enumerate(self.rows) if r.noisy]  # the rows eq. (2) acts on
        # state of the forward in flight
        self._active = False
        self._mask: torch.Tensor | None = None
        self._logits_to_keep: Any = None
        self._top_mask: torch.Tensor | None = None
        self._current: PrefillRecord | None = None
        self._t0 = 0.0
        self._timed: PrefillRecord | None = None
        # the stack's hooks (stack_pre, the layer hooks, stack_post): see _arm / _disarm
        self._targets: list[tuple[nn.Module, str, Callable]] = []
        self._handles: list[Any] = []
        self._via_top = False  # the prefill in flight came through the top-level forward (top_pre)

    @property
    def last(self) -> PrefillRecord:
        if not self.records:
            raise RuntimeError("no prefill has run under this hook yet")
        return self.records[-1]

    # -- helpers -----------------------------------------------------------------------------------
    def _sync(self, device: torch.device) -> None:
        if self.timing and device.type == "cuda":
            torch.cuda.synchronize(device)

    def _check_batch(self, B: int) -> None:
        if len(self.rows) != B:
            raise ValueError(
                f"prefill_noise got {len(self.rows)} RowNoise entries but the prefill batch has {B} rows; pass "
                "one RowNoise per row of the expanded batch (prompts x num_return_sequences, in generate's "
                "repeat_interleave order)"
            )

    def _check_left_padded(self, mask: torch.Tensor) -> None:
        """Refuse padding after a noisy row's first real token (right padding).

        With right padding the last prompt position of a shorter row is padding: ``generate`` reads the
        first-token logits there, and eq. (2) draws no noise on masked positions, so such a row would
        silently sample from clean (and wrong) logits.
        """
        self._check_batch(mask.shape[0])
        seen = mask.ne(0).long().cumsum(1) > 0
        bad = (seen & mask.eq(0)).any(1).cpu().tolist()
        rows = [b for b, (r, is_bad) in enumerate(zip(self.rows, bad, strict=True)) if r.noisy and is_bad]
        if rows:
            raise ValueError(
                f"prefill_noise: noisy row {rows[0]} is right-padded (attention-mask zeros after its "
                f"first real token; {len(rows)} noisy row(s) in all): generate would read its first-token "
                "logits at a padding position, where eq. (2) draws no noise. Pad on the left: "
                'tokenizer.padding_side = "left" (or processor.tokenizer.padding_side = "left"), as '
                "generate expects for decoder-only models."
            )

    def _mask_for(self, B: int, T: int, device: torch.device) -> torch.Tensor | None:
        m = self._mask
        if m is not None and tuple(m.shape) == (B, T):
            return m.to(device)
        return None

    # -- arming: the stack's hooks are registered only while a prefill can come -------------------------
    def _arm(self, *, prepend: bool) -> None:
        """Register the stack's hooks (``prepend``: ahead of every other hook on those modules; used on
        re-arming, when every other hook there was registered after this hook's first registration)."""
        self._handles = [
            (m.register_forward_pre_hook if kind == "pre" else m.register_forward_hook)(
                fn, with_kwargs=True, prepend=prepend
            )
            for m, kind, fn in self._targets
        ]

    def _disarm(self) -> None:
        """Remove the stack's hooks after a prefill that came through the top-level forward: the decode
        steps that follow run the stack without them (about 5 us of hook calls each); :meth:`top_pre`
        re-arms them at the next top-level forward that is a branch point. Only where they are the only
        forward hooks on their modules, so that re-arming them in front (``prepend``) restores the order
        every hook runs in."""
        ours = {h.id for h in self._handles}
        for m in {id(m): m for m, _, _ in self._targets}.values():
            if not (set(m._forward_pre_hooks) | set(m._forward_hooks)) <= ours:
                return
        self._remove_stack_hooks()

    def _remove_stack_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hook bodies -------------------------------------------------------------------------------
    def top_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        branch = at_branch_point(kwargs.get("past_key_values"))
        if not self._handles:  # disarmed after a prefill: only a new branch point re-arms
            if not branch:
                return None
            self._arm(prepend=True)
        self._via_top = branch
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            mask = args[1]
        self._top_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        self._logits_to_keep = kwargs.get("logits_to_keep", 0)
        if self.timing:  # the prefill clock starts at the top-level forward (vision tower included)
            x = kwargs.get("input_ids")
            x = kwargs.get("inputs_embeds") if x is None else x
            x = args[0] if x is None and args and isinstance(args[0], torch.Tensor) else x
            if x is not None:
                self._sync(x.device)
            self._t0 = time.perf_counter()

    def top_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        rec, self._timed = self._timed, None
        if rec is not None:
            logits = getattr(output, "logits", None)
            if isinstance(logits, torch.Tensor):
                self._sync(logits.device)
            rec.prefill_s = time.perf_counter() - self._t0

    def stack_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(getattr(module, "config", None), "use_cache", True)
        if cache is None and use_cache is False:
            raise RuntimeError(
                "prefill_noise needs the KV cache to tell the prefill from decode steps; call generate with "
                "use_cache=True (the default). Without a cache every step re-runs the whole sequence."
            )
        prefill = at_branch_point(cache)
        self._active = prefill
        if not prefill:
            return
        mask = kwargs.get("attention_mask")
        self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else self._top_mask
        if self.any_noisy and self._mask is not None:
            self._check_left_padded(self._mask)
        self._current = PrefillRecord(primary="final_norm" if self.layers is None else max(self.layers))
        if self.timing:
            self._current.hook_s = 0.0

    def layer_pre(self, layer: int):
        def fn(module: nn.Module, args: tuple, kwargs: dict):
            if not self._active:
                return None
            if args:
                h = args[0]
            else:
                h = kwargs["hidden_states"]
            t = self._tic(h.device)
            B, T, _ = h.shape
            self._check_batch(B)
            mask = self._mask_for(B, T, h.device)
            idx = _last_index(mask, B, T, h.device)
            rows = self._layer_rows[layer]
            if self.any_noisy:
                h_new, rel = perturb_rows(
                    h, rows, attention_mask=mask, steer=self.steer, sigma_scale=self.scales[layer]
                )
            else:
                h_new, rel = h, torch.zeros(B)
            self._current.sites[layer] = SiteRecord(rel, _gather_last(h, idx), _gather_last(h_new, idx))
            self._toc(h.device, t)
            if args:
                return (h_new, *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = h_new
            return args, kwargs

        return fn

    def stack_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if not self._active:
            return None
        self._active = False
        rec = self._current
        h = output[0] if isinstance(output, tuple) else output.last_hidden_state  # [B, T, d]
        t = self._tic(h.device)
        B, T, _ = h.shape
        self._check_batch(B)
        mask = self._mask_for(B, T, h.device)
        idx = _last_index(mask, B, T, h.device)
        new_output = None
        if self.layers is None:
            if self.resolve is not None:  # the rows' noise decided on this prefill's own clean states
                resolve, self.resolve = self.resolve, None
                self._set_rows(resolve(_gather_last(h, idx)))
            k = self._keep(T)
            if not self.any_noisy:
                h_new, rel = h, torch.zeros(B)
            elif k == 1:  # the branch point alone reaches the logits (generate's logits_to_keep=1)
                h_new, rel = self._perturb_last(h, None if mask is None else mask[:, -1])
            elif k < T:
                # fast path: only the last k positions reach the logits. Reverse positions of a suffix
                # are the same as in the full prompt, so these are exactly the values a full pass gives.
                tail_mask = None if mask is None else mask[:, T - k :]
                tail, rel = perturb_rows(h[:, T - k :], self.rows, attention_mask=tail_mask, steer=self.steer)
                h_new = torch.cat([h[:, : T - k], tail], dim=1)
            else:
                h_new, rel = perturb_rows(h, self.rows, attention_mask=mask, steer=self.steer)
            rec.final_last = _gather_last(h_new, idx)
            rec.sites["final_norm"] = SiteRecord(rel, _gather_last(h, idx), rec.final_last)
            if h_new is not h:
                if isinstance(output, tuple):
                    new_output = (h_new, *output[1:])
                else:
                    output.last_hidden_state = h_new
                    new_output = output
        else:
            rec.final_last = _gather_last(h, idx)
        self._toc(h.device, t)
        if self.timing:
            self._timed = rec  # top_post stops the prefill clock after lm_head
        self.records.append(rec)
        self._current = None
        if self._via_top:  # a top-level caller (generate): the decode steps run without the stack's hooks
            self._disarm()
        self._via_top = False
        return new_output

    def _set_rows(self, rows: Sequence[RowNoise]) -> None:
        rows = list(rows)
        if len(rows) != len(self.rows) or not all(isinstance(r, RowNoise) for r in rows):
            raise ValueError(
                f"prefill_noise's resolve returned {len(rows)} rows for {len(self.rows)}, or not RowNoise"
            )
        self.rows = rows
        self.any_noisy = any(r.noisy for r in rows)
        self._noisy = [b for b, r in enumerate(rows) if r.noisy]

    def _perturb_last(
        self, h: torch.Tensor, last_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``perturb_rows`` on the last position alone (``h`` ``# [B, T, d]``; ``last_mask`` ``# [B]`` the
        attention mask there): the same values (eq. 2 is row-wise; each noisy row's one eps is
        ``draw_eps(key, [0], d)``) through :func:`~ncgrpo.core.noise.perturb_selected`, whose draws of one
        position for many keys are one call (:func:`~ncgrpo.core.noise.draw_eps_keys`).
        Returns ``(h_new, rel)`` as :func:`~ncgrpo.core.noise.perturb_rows` does: a new tensor, ``# [B]``."""
        B, T, d = h.shape
        noisy = self._noisy
        if last_mask is not None:  # a padding position gets no noise (only an all-padding row has one)
            real = last_mask.ne(0).cpu().tolist()
            noisy = [b for b in noisy if real[b]]
        out, rel = h.clone(), torch.zeros(B, dtype=torch.float32)
        if not noisy:
            return out, rel
        bi = torch.tensor(noisy, device=h.device)
        h_sel = h[bi, T - 1]  # [N, d]
        new = perturb_selected(h_sel, [(self.rows[b], [0]) for b in noisy], steer=self.steer)  # [N, d]
        out[bi, T - 1] = new
        rel[noisy] = relative_perturbation(h_sel, new).cpu()
        return out, rel

    def _keep(self, T: int) -> int:
        """How many trailing positions reach the logits (``positions="auto"``); T means all."""
        if self.positions == "all":
            return T
        k = self._logits_to_keep
        if isinstance(k, int) and 0 < k < T:
            return k
        return T

    def _tic(self, device: torch.device) -> float:
        if not self.timing:
            return 0.0
        self._sync(device)
        return time.perf_counter()

    def _toc(self, device: torch.device, t: float) -> None:
        if not self.timing or self._current is None:
            return
        self._sync(device)
        self._current.hook_s += time.perf_counter() - t


def _normalize_site(site: Site, n_layers: int) -> list[int] | None:
    if isinstance(site, str):
        if site != "final_norm":
            raise ValueError(
                f"unknown noise site {site!r}; use 'final_norm', a layer index or a list of them"
            )
        return None
    layers = [int(site)] if isinstance(site, int) else [int(s) for s in site]
    if not layers:
        raise ValueError("site: empty list of layers")
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad:
        raise ValueError(
            f"site layers {bad} out of range: the model has {n_layers} decoder layers (0..{n_layers - 1})"
        )
    return layers


#: Modules (the text model's top) a ``prefill_noise`` hook is active on, and that hook: one per model.
_HOOKED: weakref.WeakKeyDictionary[nn.Module, NoiseHook] = weakref.WeakKeyDictionary()


@contextmanager
def prefill_noise(
    model: nn.Module,
    rows: Sequence[RowNoise],
    *,
    site: Site = "final_norm",
    layer_decay: float = 0.5,
    steer: torch.Tensor | None = None,
    positions: Literal["auto", "all"] = "auto",
    timing: bool = False,
    resolve: Callable[[torch.Tensor], Sequence[RowNoise]] | None = None,
) -> Iterator[NoiseHook]:
    """Perturb the prefill of ``model`` (eq. 2 at ``site``) for the rows flagged in ``rows``.

    ``rows``: one :class:`~ncgrpo.core.noise.RowNoise` per row of the prefill batch (after
    ``num_return_sequences`` expansion). ``site``: ``"final_norm"`` (the paper's site) or a decoder
    layer index / list of indices (propagating variant; the top-most gets ``sigma``, the next
    ``sigma * layer_decay`` ...). ``steer``: eq. (6)'s ``mu`` ``# [d]`` added to noisy rows.
    ``positions``: ``"auto"`` or ``"all"`` (final-norm site; see the module docstring).
    ``timing``: measure the hook bodies and the prefill forward (synchronizes CUDA). ``resolve``
    (final-norm site): called once, at the prefill, with the clean branch-point states ``# [B, d]`` (the
    last prompt position, before any noise); the rows it returns replace ``rows`` for that prefill (the
    target schedule solves sigma_k there: :mod:`ncgrpo.trainer.target`). ``rows`` until then: the
    left-padding check of noisy rows runs on them.

    Every hook handle is removed on exit, also when the body raises.
    """
    if resolve is not None and site != "final_norm":
        raise ValueError("prefill_noise: resolve decides the rows at the final-norm site only")
    if positions not in ("auto", "all"):
        raise ValueError(f"positions must be 'auto' or 'all', got {positions!r}")
    bad = [i for i, r in enumerate(rows) if not isinstance(r, RowNoise)]
    if bad:
        raise TypeError(f"rows must be RowNoise entries; row {bad[0]} is {type(rows[bad[0]]).__name__}")
    top, stack, _ = find_text_stack(model)
    if top in _HOOKED:
        # A second hook would perturb the already-perturbed states: the noise applied twice.
        raise RuntimeError(
            "prefill_noise is already active on this model; nested hooks would apply the noise twice "
            "(exit the outer `with prefill_noise(...)` first, or give both row sets to one call)"
        )
    layers = _normalize_site(site, len(stack.layers))
    hook = NoiseHook(rows, layers, layer_decay, steer, positions, timing, resolve)
    handles = []
    _HOOKED[top] = hook
    try:
        handles.append(top.register_forward_pre_hook(hook.top_pre, with_kwargs=True))
        hook._targets = [(stack, "pre", hook.stack_pre)]
        hook._targets += [(stack.layers[layer], "pre", hook.layer_pre(layer)) for layer in layers or []]
        hook._targets.append((stack, "post", hook.stack_post))
        hook._arm(prepend=False)
        if timing:
            handles.append(top.register_forward_hook(hook.top_post, with_kwargs=True))
        yield hook
    finally:
        for h in handles:
            h.remove()
        hook._remove_stack_hooks()
        hook._active = False
        _HOOKED.pop(top, None)
