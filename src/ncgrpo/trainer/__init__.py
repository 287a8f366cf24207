"""``NCGRPOConfig`` / ``NCGRPOTrainer``: NC-GRPO on TRL's ``GRPOTrainer`` (the TRL seam).

- :mod:`~ncgrpo.trainer.config`: ``NCGRPOConfig`` (``GRPOConfig`` plus NC-GRPO's settings).
- :mod:`~ncgrpo.trainer.grpo`: ``NCGRPOTrainer``: the generation seam, the schedule, regrouping, the
  importance-sampling policy and SPSA after rewards, and every TRL override (its module docstring maps
  the paper's Algorithm 1 onto TRL).
- :mod:`~ncgrpo.trainer.vllm`: the vLLM adapter (one noise spec per request; the branch-point pass).
- :mod:`~ncgrpo.trainer.metrics`: branch-point measurements and the per-generation ``StepRecord``.
- :mod:`~ncgrpo.trainer.images`: NoisyRollout's image method.
- :mod:`~ncgrpo.trainer.checkpoints`: NC-GRPO's state in checkpoints.
- :mod:`~ncgrpo.trainer.inert`, :mod:`~ncgrpo.trainer.prefix`: the inert-noise warning and the
  ``branch_prefix`` chat-template helpers, the trainer's own.
"""

from ncgrpo.core.noise import parse_noise_site
from ncgrpo.runs.folder import STATE_FILE, checkpoint_problem, last_complete_checkpoint
from ncgrpo.trainer.config import NCGRPOConfig
from ncgrpo.trainer.grpo import NCGRPOTrainer, apply_noisy_importance_sampling
from ncgrpo.trainer.metrics import StepRecord, _LocalGen
from ncgrpo.trainer.vllm import _tp_group_rows

__all__ = [
    "STATE_FILE",
    "NCGRPOConfig",
    "NCGRPOTrainer",
    "StepRecord",
    "_LocalGen",
    "_tp_group_rows",
    "apply_noisy_importance_sampling",
    "checkpoint_problem",
    "last_complete_checkpoint",
    "parse_noise_site",
]
