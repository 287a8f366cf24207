"""``antithetic``: the noisy half as ``n/2`` pairs ``(+eps, -eps)`` sharing one key (section 3.5), in the
joint group (or, with ``antithetic_grouping='separate'``, in two advantage groups that split each pair)."""

from __future__ import annotations

from typing import Any

from ncgrpo.methods.base import register_method
from ncgrpo.methods.latent import Latent


@register_method
class Antithetic(Latent):
    name = "antithetic"
    summary = "eq. (2) noise as (+eps, -eps) pairs sharing one draw (section 3.5)"
    label = "Antithetic"
    slug = "antithetic"
    in_demo_by_default = False
    paired = True
    key_rule = "pair"
    noise_mode = "antithetic"

    def card_settings(self, args: Any) -> list[str]:
        return [f"antithetic_grouping {args.antithetic_grouping}"]
