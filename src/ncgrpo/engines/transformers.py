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
  ``get_seq_length() == 0``), or the first forward on a cache :func:`shared_prefill_generate` prefilled
  with the prompt minus its last token (:func:`at_branch_point`): that forward computes only the last
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
  :func:`shared_prefill_generate`'s direct prefix pass is never perturbed).
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
import warnings
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

__all__ = [
    "BranchPoint",
    "NoiseHook",
    "PrefillRecord",
    "SiteRecord",
    "SharedPrefill",
    "at_branch_point",
    "branch_point_capture",
    "head_function",
    "share_prompt_prefill",
    "shared_prefill_generate",
    "cut_after_eos",
    "eos_token_ids",
    "find_text_stack",
    "prefill_noise",
    "unwrap_model",
]

Site = Literal["final_norm"] | int | Sequence[int]

# Where the language-model stack (the module owning ``.layers`` and the final ``.norm``) lives,
# relative to the unwrapped top-level model. VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) first,
# then text-only causal LMs (Qwen2, Qwen3, Llama, ...).
_STACK_PATHS = ("model.language_model", "model")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP-style ``.module`` wrappers and PEFT ``PeftModel``/``LoraModel`` layers.

    Returns the transformers model whose ``forward`` ``generate`` calls. Cheap and duck-typed: a
    PEFT model exposes ``get_base_model()``; DDP and ``DataParallel`` expose ``.module``.
    """
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
            if inner is not model:
                model = inner
                continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and not hasattr(model, "lm_head"):
            model = inner
            continue
        break
    return model


def _get_path(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_text_stack(model: nn.Module) -> tuple[nn.Module, nn.Module, str]:
    """``(top, stack, path)``: the unwrapped top-level model, its language-model stack, and the
    stack's attribute path. The stack is the module whose forward returns the final-norm output."""
    top = unwrap_model(model)
    for path in _STACK_PATHS:
        stack = _get_path(top, path)
        if isinstance(stack, nn.Module) and isinstance(getattr(stack, "norm", None), nn.Module):
            layers = getattr(stack, "layers", None)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return top, stack, path
    looked = " or ".join(f"model.{p}.norm" for p in _STACK_PATHS)
    raise NotImplementedError(
        f"prefill_noise does not know where the language-model stack of {type(top).__name__} is: it looked "
        f"for {looked} (a module with a final `.norm` and decoder `.layers`). Supported: Qwen2-VL, "
        "Qwen2.5-VL, Qwen3-VL and text-only Qwen2/Qwen3/Llama causal LMs."
    )


def eos_token_ids(model: nn.Module, generation_config: Any = None) -> set[int]:
    """The end-of-sequence token ids ``generate`` stops at: ``generation_config``'s if it names any,
    else the model's own ``generation_config``'s (empty when neither does)."""
    for cfg in (generation_config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is None:
            continue
        ids = {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
        if ids:
            return ids
    return set()


def cut_after_eos(rows: Sequence[Sequence[int]], eos: set[int]) -> list[list[int]]:
    """Each row of generated ids up to and including its first EOS (``generate`` pads finished rows
    after their EOS)."""
    out = []
    for ids in rows:
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        out.append(list(ids[:cut]))
    return out


#: Attributes :func:`shared_prefill_generate` sets on the cache it prefills: ``_PREFIX_PASS`` while the
#: prompt minus its last token is computed (every hook stays inert), then ``_BRANCH_AT``: the cache
#: length at which the next forward is the branch point (the last prompt token).
_PREFIX_PASS = "_ncgrpo_prefix_pass"
_BRANCH_AT = "_ncgrpo_branch_at"


def at_branch_point(cache: Any) -> bool:
    """Whether a forward with KV cache ``cache`` computes the prompt's last position for the first time:
    an empty cache (the ordinary prefill) or a cache :func:`shared_prefill_generate` filled with the
    prompt minus its last token and nothing since. False during that shared prefix pass itself and on
    every decode step. Every branch-point hook (the noise, the controls) decides with this."""
    if cache is None:
        return True
    if getattr(cache, _PREFIX_PASS, False):
        return False
    n = cache.get_seq_length()
    return n == 0 or n == getattr(cache, _BRANCH_AT, -1)


@dataclass
class BranchPoint:
    """What :func:`branch_point_capture` read at the first ``lm_head`` call (the prefill)."""

    logits: torch.Tensor | None = None  # [B, V] float32, last position, before any temperature
    states: torch.Tensor | None = None  # [B, d] the LM head's input there (model dtype)
    extra: Any = None  # what ``on_branch`` returned


def head_function(module: nn.Module, who: str, otherwise: str = "") -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head ``module`` as a plain function (``F.linear`` on its weights: no forward hooks run,
    so it can be called from inside the head's own forward hook). Called where the weights are not
    gathered (a DeepSpeed ZeRO-3 partition), it raises, naming ``who`` needs them and ``otherwise``."""

    def head(x: torch.Tensor) -> torch.Tensor:
        if module.weight.numel() == 0:  # a ZeRO-3 partition: not gathered even inside the forward
            raise RuntimeError(
                f"{who} reads the LM head's weights inside the prefill, but they are partitioned there "
                f"(DeepSpeed ZeRO-3 with ds3_gather_for_generation=False). Set ds3_gather_for_generation=True"
                + (f", {otherwise}." if otherwise else ".")
            )
        return torch.nn.functional.linear(x, module.weight, getattr(module, "bias", None))

    return head


@contextmanager
def branch_point_capture(model: nn.Module, on_branch: Callable | None = None) -> Iterator[BranchPoint]:
    """Read the branch point (the prompt's last position) of the next forward of ``model``: an
    ``lm_head`` forward hook keeps the first call's last-position logits and the head's input there.
    The hook runs inside the forward, so it also works where weights are only gathered during
    ``generate`` (ZeRO-3); it is removed on exit. ``on_branch(head, logits, states)``, if given, runs
    there too (``head``: the LM head as a plain function, no hooks, its weights as gathered for the
    forward) and its result is kept in ``point.extra``: computations that need the LM head's weights
    after the prefill (the first-token marginal) must happen here, not after ``generate`` returns."""
    point = BranchPoint()

    def capture(module, args, output):
        if point.logits is None:
            handle.remove()  # only the first call is read: the decode steps run without this hook
            point.logits = output[:, -1].detach().float()
            point.states = args[0][:, -1].detach()
            if on_branch is not None:
                head = head_function(
                    module,
                    "NC-GRPO's first-token marginal (noise/first_token_marginal_tv, first_token_temperature_auto)",
                    "or marginal_tv_draws=0 and no first_token_temperature_auto",
                )
                point.extra = on_branch(head, point.logits, point.states)

    handle = find_text_stack(model)[0].lm_head.register_forward_hook(capture)
    try:
        yield point
    finally:
        handle.remove()


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
    ) -> None:
        self.rows = list(rows)
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
) -> Iterator[NoiseHook]:
    """Perturb the prefill of ``model`` (eq. 2 at ``site``) for the rows flagged in ``rows``.

    ``rows``: one :class:`~ncgrpo.core.noise.RowNoise` per row of the prefill batch (after
    ``num_return_sequences`` expansion). ``site``: ``"final_norm"`` (the paper's site) or a decoder
    layer index / list of indices (propagating variant; the top-most gets ``sigma``, the next
    ``sigma * layer_decay`` ...). ``steer``: eq. (6)'s ``mu`` ``# [d]`` added to noisy rows.
    ``positions``: ``"auto"`` or ``"all"`` (final-norm site; see the module docstring).
    ``timing``: measure the hook bodies and the prefill forward (synchronizes CUDA).

    Every hook handle is removed on exit, also when the body raises.
    """
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
    hook = NoiseHook(rows, layers, layer_decay, steer, positions, timing)
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


# --------------------------------------------------------------------------------------------------
# one prefill per group
# --------------------------------------------------------------------------------------------------
@dataclass
class SharedPrefill:
    """What one :func:`shared_prefill_generate` call did: ``rows`` generated, ``unique`` prompts
    prefilled (``shared``), or why it fell back to the repeated prefill (``reason``); ``prefix_s``: the
    seconds of the shared prefix pass (vision tower included; CUDA-synchronized)."""

    rows: int
    unique: int
    shared: bool
    reason: str = ""
    prefix_s: float = 0.0


#: Per-row inputs :func:`shared_prefill_generate` knows how to slice to the unique prompts.
_ROW_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
#: Image inputs of the Qwen-VL family (flat patches + one grid row per image).
_IMAGE_KEYS = ("pixel_values", "image_grid_thw")
_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"share_prompt_prefill: the prompt is prefilled once per row: {reason}", stacklevel=3)


def _image_rows(
    top: nn.Module, input_ids: torch.Tensor, grid: torch.Tensor
) -> list[tuple[int, int, int, int]] | None:
    """Per row, ``(patch_start, patch_end, image_start, image_end)``: the slice of the flat
    ``pixel_values`` and of ``image_grid_thw`` its images own (Qwen-VL layout: images in row order,
    ``prod(grid)`` patches each, ``prod(grid) / merge**2`` image tokens each); None when the layout
    cannot be read (the caller falls back)."""
    cfg = top.config
    image_token = getattr(cfg, "image_token_id", None)
    merge = getattr(getattr(cfg, "vision_config", None), "spatial_merge_size", None)
    if image_token is None or merge is None:
        return None
    patches = grid.prod(-1).tolist()
    tokens = [p // (merge * merge) for p in patches]
    per_row = (input_ids == image_token).sum(1).tolist()
    out, img, start = [], 0, 0
    for need in per_row:
        got, end, img0 = 0, start, img
        while got < need and img < len(tokens):
            got += tokens[img]
            end += patches[img]
            img += 1
        if got != need:
            return None
        out.append((start, end, img0, img))
        start = end
    return out if img == len(tokens) else None


def _groups(top: nn.Module, kwargs: dict) -> tuple[list[int], torch.Tensor, list | None] | str:
    """``(first, index, spans)``: the first row of each run of identical consecutive rows (same tokens,
    mask and image pixels), each row's run, and the rows' :func:`_image_rows` (None without images); or
    the reason the batch cannot be shared."""
    ids = kwargs["input_ids"]
    R = ids.shape[0]
    rows = [kwargs[k] for k in _ROW_KEYS if isinstance(kwargs.get(k), torch.Tensor)]
    pix, spans = None, None
    if any(kwargs.get(k) is not None for k in _IMAGE_KEYS):
        if not all(isinstance(kwargs.get(k), torch.Tensor) for k in _IMAGE_KEYS):
            return "pixel_values without image_grid_thw (or the reverse)"
        spans = _image_rows(top, ids, kwargs["image_grid_thw"])
        if spans is None:
            return "the image tokens do not match image_grid_thw"
        pix = kwargs["pixel_values"]
    # row r equals row r - 1 in every per-row input: one comparison per input, read once
    same = torch.ones(max(R - 1, 0), dtype=torch.bool, device=ids.device)
    for t in rows if R > 1 else ():
        same &= (t[1:] == t[:-1]).reshape(R - 1, -1).all(1)
    first, index, g = [0], [0], 0
    for r, equal in enumerate(same.tolist(), start=1):
        if equal and pix is not None:
            (a0, a1, _, _), (b0, b1, _, _) = spans[r], spans[r - 1]
            equal = a1 - a0 == b1 - b0 and torch.equal(pix[a0:a1], pix[b0:b1])
        if not equal:
            first.append(r)
            g += 1
        index.append(g)
    if len(first) == R:
        return "no two consecutive rows share a prompt"
    return first, torch.tensor(index, dtype=torch.long, device=ids.device), spans


def _refusal(top: nn.Module, kwargs: dict, generation_config: Any) -> str:
    """Why this ``generate`` call cannot share the prompt's prefill ("" if it can)."""
    hook = _HOOKED.get(top)
    if hook is not None and hook.layers is not None:
        return "a layer noise site writes the noise into the KV cache, so every row needs its own prefill"
    if hook is not None and hook.positions == "all":
        return 'positions="all" perturbs every prompt position, which only a full prefill computes'
    if not isinstance(kwargs.get("input_ids"), torch.Tensor) or kwargs["input_ids"].dim() != 2:
        return "generate was not given 2-D input_ids"
    if kwargs["input_ids"].shape[1] < 2:
        return "a one-token prompt has no prefix to share"
    known = set(_ROW_KEYS) | set(_IMAGE_KEYS)
    other = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in known]
    if other or kwargs.get("past_key_values") is not None or kwargs.get("inputs_embeds") is not None:
        return f"generate got inputs it cannot share ({other or 'a cache or inputs_embeds'})"
    cfg = generation_config if generation_config is not None else getattr(top, "generation_config", None)
    merged = {k: kwargs.get(k, getattr(cfg, k, None)) for k in ("num_return_sequences", "num_beams", "cache_implementation", "prefill_chunk_size", "use_cache")}  # fmt: skip
    if (merged["num_return_sequences"] or 1) > 1 or (merged["num_beams"] or 1) > 1:
        return "num_return_sequences / num_beams > 1 (pass the rows repeated, as TRL does)"
    if merged["cache_implementation"] not in (None, "dynamic"):
        return f"cache_implementation={merged['cache_implementation']!r} (only the dynamic cache is expanded)"
    if merged["prefill_chunk_size"] is not None or merged["use_cache"] is False:
        return "chunked prefill or use_cache=False"
    if getattr(top.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    mm = kwargs.get("mm_token_type_ids")
    if isinstance(mm, torch.Tensor) and bool(mm[:, -1].ne(0).any()):
        return "a prompt ends in an image token"
    return ""


def shared_prefill_generate(model: nn.Module, generate: Callable | None = None, /, **kwargs: Any):
    """``generate(**kwargs)`` with one prefill per prompt instead of one per row.

    The batch holds each prompt's rows next to each other (TRL's ``RepeatSampler`` order; the image
    method's noisy half has other pixels, so it is its own run). Runs of identical consecutive rows
    (tokens, mask, image pixels) are prefilled once, prompt minus its last token, vision tower
    included, with the position ids ``generate`` would give them (Qwen-VL's 3-D positions and
    ``rope_deltas``); the ``DynamicCache`` is expanded to the rows (``batch_select_indices``, the
    general ``batch_repeat_interleave``) and so is ``rope_deltas``; then ``generate`` runs on the full
    rows from that cache, so its first forward computes only the last prompt token. The branch-point
    hooks (:func:`prefill_noise` at the final-norm site, the controls, :func:`branch_point_capture`) act
    on that forward (:func:`at_branch_point`) exactly as on a full prefill: the first-token logits agree
    with the repeated path within float rounding (tested: greedy tokens identical).

    Falls back to ``generate(**kwargs)`` (a warning once per reason) where sharing is not exact or not
    supported: a layer noise site (the noise is in the cache), ``positions="all"``, beams /
    ``num_return_sequences`` > 1, a non-dynamic cache, inputs it does not know (videos, embeddings).
    ``generate``: the callable to run (default ``model.generate``). The returned output is
    ``generate``'s; :data:`SharedPrefill` of the call is on ``model``'s top as ``_ncgrpo_last_shared``.
    """
    from transformers import DynamicCache

    top = unwrap_model(model)
    generate = generate if generate is not None else model.generate
    reason = _refusal(top, kwargs, kwargs.get("generation_config"))
    grouped = _groups(top, kwargs) if not reason else reason
    R = kwargs["input_ids"].shape[0] if isinstance(kwargs.get("input_ids"), torch.Tensor) else 0
    if isinstance(grouped, str):
        if reason:
            _warn_once(reason)
        top._ncgrpo_last_shared = SharedPrefill(rows=R, unique=R, shared=False, reason=grouped)
        return generate(**kwargs)
    first, index, spans = grouped
    t0 = time.perf_counter()
    ids = kwargs["input_ids"]
    sel = torch.tensor(first, dtype=torch.long, device=ids.device)
    mask = kwargs.get("attention_mask")
    u_kw: dict[str, Any] = {}
    for k in ("attention_mask", "mm_token_type_ids", "token_type_ids"):
        if isinstance(kwargs.get(k), torch.Tensor):
            u_kw[k] = kwargs[k][sel]
    if spans is not None:
        u_kw["pixel_values"] = torch.cat([kwargs["pixel_values"][spans[r][0] : spans[r][1]] for r in first])
        u_kw["image_grid_thw"] = torch.cat(
            [kwargs["image_grid_thw"][spans[r][2] : spans[r][3]] for r in first]
        )
    u_ids = ids[sel]
    with torch.no_grad():
        # generate's own position ids for the unique prompts (Qwen-VL: 3-D, and sets rope_deltas)
        pos_kw = dict(u_kw)
        position_ids = top._prepare_position_ids_for_generation(u_ids, pos_kw)
        fwd: dict[str, Any] = {"input_ids": u_ids[:, :-1], "position_ids": position_ids[..., :-1]}
        # generate drops an all-ones mask (no padding anywhere in the batch); so does the prefix pass
        if mask is not None and not bool((mask == 1).all()):
            fwd["attention_mask"] = u_kw["attention_mask"][:, :-1]
        for k in ("mm_token_type_ids", "token_type_ids"):
            if k in u_kw:
                fwd[k] = u_kw[k][:, :-1]
        for k in _IMAGE_KEYS:
            if k in u_kw:
                fwd[k] = u_kw[k]
        cache = DynamicCache(config=top.config.get_text_config(decoder=True))
        setattr(cache, _PREFIX_PASS, True)
        base = getattr(top, top.base_model_prefix)
        try:
            base(**fwd, past_key_values=cache, use_cache=True)
        finally:
            setattr(cache, _PREFIX_PASS, False)
        if len(first) != R:
            cache.batch_select_indices(index)
        setattr(cache, _BRANCH_AT, cache.get_seq_length())
        deltas = getattr(base, "rope_deltas", None)
        if isinstance(deltas, torch.Tensor) and deltas.shape[0] == len(first):
            base.rope_deltas = deltas[index.to(deltas.device)]
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    prefix_s = time.perf_counter() - t0
    call = {k: v for k, v in kwargs.items() if k not in _IMAGE_KEYS}
    call["past_key_values"] = cache
    top._ncgrpo_last_shared = SharedPrefill(rows=R, unique=len(first), shared=True, prefix_s=prefix_s)
    return generate(**call)


@contextmanager
def share_prompt_prefill(model: nn.Module, enabled: bool = True) -> Iterator[list[SharedPrefill]]:
    """Route ``model.generate`` through :func:`shared_prefill_generate` inside the block (an instance
    attribute over the class method, removed on exit): for callers that do not call ``generate``
    themselves (TRL's ``_generate_single_turn``). Yields the list of :class:`SharedPrefill` records, one
    per ``generate`` call. ``enabled=False``: no change (the records stay empty)."""
    top = unwrap_model(model)
    calls: list[SharedPrefill] = []
    if not enabled:
        yield calls
        return
    had = "generate" in top.__dict__
    previous = top.__dict__.get("generate")
    original = top.generate

    def generate(*args: Any, **kwargs: Any):
        if len(args) > 1:  # more positional arguments than input_ids: the plain path, every argument kept
            return original(*args, **kwargs)
        if args:  # generate(input_ids, ...) positionally
            kwargs = {"input_ids": args[0], **kwargs}
        out = shared_prefill_generate(top, original, **kwargs)
        calls.append(top._ncgrpo_last_shared)
        return out

    top.generate = generate
    try:
        yield calls
    finally:
        if had:
            top.generate = previous
        else:
            del top.generate
