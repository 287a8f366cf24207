"""NC-GRPO on verl 0.9.1 (``pip install "ncgrpo[verl]"``; docs/verl.md).

Launch (verl's ``main_ppo`` with NC-GRPO's task runner; every verl override works as usual)::

    python -m ncgrpo.integrations.verl.main_ppo --config-path "$PWD/recipes/verl" \\
        --config-name geo3k_qwen2_5_vl_7b_latent_sigma0.2

The pure part (:mod:`.config`: the ``ncgrpo:`` block, the session plan, the prompt id, the per-half
metrics, the checks of verl's config) imports no verl; its public names (``config.__all__``) are this
package's too. The verl classes (:mod:`.workers`: :class:`NCGRPOAgentLoopWorker`,
:class:`NCGRPOAgentLoopManager`, :class:`NCGRPOTrainerSync`, ``NCGRPOTaskRunner``) import verl and Ray,
on first access of their names here, so
``agent_loop_manager_class=ncgrpo.integrations.verl.NCGRPOAgentLoopManager`` resolves.
"""

from __future__ import annotations

from typing import Any

from ncgrpo.integrations.verl import config as _config
from ncgrpo.integrations.verl.config import *  # noqa: F403  (the pure part's names, config.__all__)

_VERL_CLASSES = (
    "FirstRequestNoiseClient",
    "NCGRPOAgentLoopManager",
    "NCGRPOAgentLoopWorker",
    "NCGRPOTaskRunner",
    "NCGRPOTrainerSync",
    "read_target_solves",
)
__all__ = [*_config.__all__, *_VERL_CLASSES]


def __getattr__(name: str) -> Any:
    if name in _VERL_CLASSES:
        from ncgrpo.integrations.verl import workers

        return getattr(workers, name)
    raise AttributeError(f"module 'ncgrpo.integrations.verl' has no attribute {name!r}")
