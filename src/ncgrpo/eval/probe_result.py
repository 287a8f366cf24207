"""What :func:`ncgrpo.eval.probe.probe` measured: the figures per noise scale (:class:`SigmaProbe`),
the whole result (:class:`ProbeResult`, written as JSON by ``ncgrpo probe``), the verdict on the
marginal first-token TV (:func:`verdict`) and the terminal table (:func:`format_probe`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ncgrpo.trainer.inert import INERT_MARGINAL_THRESHOLD

__all__ = ["LIVE_FROM", "TARGET_SIGMA_MAX", "ProbeResult", "SigmaProbe", "format_probe", "verdict"]

#: the largest sigma ``target_marginal_tv`` searches
TARGET_SIGMA_MAX = 4.0
#: from this marginal first-token TV on the noise is called live; below
#: :data:`ncgrpo.trainer.inert.INERT_MARGINAL_THRESHOLD` (the trainer's inert warning), inert.
LIVE_FROM = 0.02


@dataclass
class SigmaProbe:
    """The probe's figures at one noise scale (means over prompts x rollouts unless said otherwise)."""

    sigma: float
    tv: float  # mean per-draw TV(q, q_eps)
    marginal_tv: float  # TV(q, q_bar), mean over prompts
    marginal_tv_se: float  # its Monte Carlo standard error (jackknife)
    marginal_kl: float  # KL(q_bar || q), nats, mean over prompts
    equivalent_temperature: float  # the temperature whose first-token distribution is closest to q_bar
    flip: float
    changed: float
    first_changed: float
    rel: float  # measured ||h~ - h|| / ||h|| at the site (noisy rows)
    reward_clean: float
    reward_noisy: float
    p_value: float
    n_prompts: int
    n_rollouts: int
    verdict: str = ""
    #: the first-token temperature T0 whose mean first-token TV on these prompts equals ``marginal_tv``:
    #: the matched control's starting value (``first_token_temperature``) for this sigma
    matched_temperature: float = float("nan")
    #: the older calibration, T0 whose TV equals the per-draw ``tv`` (moves rollouts far more than the noise)
    matched_temperature_per_draw: float = float("nan")
    #: marginal draws per prompt behind ``marginal_tv`` (final-norm site), or the rollouts (layer sites)
    marginal_draws: int = 0
    #: the 95% interval's half-width around ``marginal_tv`` (Student's t on the units' degrees of freedom):
    #: the ``±`` printed
    marginal_tv_ci95: float = float("nan")
    per_prompt: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ProbeResult:
    """What :func:`probe` measured. ``rows``: one :class:`SigmaProbe` per sigma, in the order given."""

    model: str
    site: str
    branch_prefix: str
    method: str
    n_prompts: int
    rollouts: int
    temperature: float
    max_new_tokens: int
    seed: int
    entropy: float  # mean clean first-token entropy, nats
    entropy_max: float
    top1: float  # mean clean probability of the argmax first token
    rows: list[SigmaProbe] = field(default_factory=list)
    wall_s: float = 0.0
    #: with ``target_marginal_tv``: the sigma whose marginal TV reaches it (final-norm site)
    target_marginal_tv: float | None = None
    target_sigma: float | None = None
    #: what made the numbers: the ncgrpo commit, dirty source, package versions (:mod:`ncgrpo.runs.provenance`)
    provenance: dict[str, Any] | None = None

    @property
    def verdict(self) -> str:
        """One line per non-zero sigma, joined by '; '."""
        lines = [r.verdict for r in self.rows if r.sigma > 0]
        return "; ".join(lines) if lines else "no sigma > 0 probed"

    @property
    def live(self) -> bool:
        return any(r.verdict.startswith("live") for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text


def verdict(sigma: float, marginal_tv: float, temperature: float | None = None) -> str:
    """``"weak at sigma 0.2: noise-averaged first-token TV 0.0068 (like temperature 1.02)"``, inert or live.

    Decided on the marginal ``TV(q, q_bar)`` (what generates the noisy rollouts), not on per-draw
    figures."""
    state = (
        "inert" if marginal_tv < INERT_MARGINAL_THRESHOLD else ("weak" if marginal_tv < LIVE_FROM else "live")
    )
    like = f" (like first-token temperature {temperature:.3g})" if temperature is not None else ""
    return f"{state} at sigma {sigma:g}: noise-averaged first-token TV {marginal_tv:.4f}{like}"


def format_probe(result: ProbeResult) -> Any:
    """A rich renderable (table + verdict) for the terminal; ``rich.console.Console().print`` it."""

    title = (
        f"probe: {result.model or 'model'} | site {result.site} | prefix {result.branch_prefix!r} | "
        f"{result.n_prompts} prompts x {result.rollouts} rollouts | T={result.temperature:g}"
    )
    table = Table(title=title)
    for col in ("sigma", "rel", "marginal TV ± 95%", "KL(q̄||q)", "like T", "TV per draw", "argmax flips %",
                "first token changed %", "rollouts changed %", "reward clean", "reward noisy", "paired p",
                "matched T0", "verdict"):  # fmt: skip
        table.add_column(col, justify="left" if col == "verdict" else "right")
    for r in result.rows:
        table.add_row(
            f"{r.sigma:g}",
            f"{r.rel:.3f}",
            f"{r.marginal_tv:.4f} ± {r.marginal_tv_ci95:.4f}",
            f"{r.marginal_kl:.2e}",
            f"{r.equivalent_temperature:.3g}",
            f"{r.tv:.4f}",
            f"{100 * r.flip:.1f}",
            f"{100 * r.first_changed:.1f}",
            f"{100 * r.changed:.1f}",
            f"{r.reward_clean:.3f}",
            f"{r.reward_noisy:.3f}",
            f"{r.p_value:.3g}",
            f"{r.matched_temperature:.3g}",
            r.verdict.split(" ", 1)[0],
        )
    lines = [
        f"clean first-token entropy {result.entropy:.4f} nats (max {result.entropy_max:.2f}); "
        f"mean top-1 probability {result.top1:.4f}; {result.wall_s:.1f} s",
        "marginal TV = TV(q, q̄), q̄ the noise-averaged first-token distribution: what the noisy half's "
        "rollouts are sampled from (per-draw TV and 'changed' describe one draw, and overstate it). "
        "like T: the first-token temperature closest to q̄; matched T0: the first-token control's T0 with "
        "the same marginal TV",
        f"verdict: {result.verdict}",
    ]
    if result.target_marginal_tv is not None:
        lines.append(
            f"target: marginal TV {result.target_marginal_tv:g} is reached at sigma {result.target_sigma:g}"
            if result.target_sigma is not None
            else f"target: marginal TV {result.target_marginal_tv:g} is not reached at any sigma <= {TARGET_SIGMA_MAX:g}"
        )
    if not result.live and result.site == "final_norm":
        lines.append(
            "hint: at the final-norm site the noise acts only through the first token; if the model opens "
            "with a format token, set branch_prefix (e.g. '<think>') so the prefill ends where reasoning begins"
        )
    return Group(table, Text("\n".join(lines)))
