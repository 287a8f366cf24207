"""``NCGRPOConfig`` / ``NCGRPOTrainer``: NC-GRPO on TRL's ``GRPOTrainer`` (the TRL seam).

- :mod:`~ncgrpo.trainer.config`: ``NCGRPOConfig`` (``GRPOConfig`` plus NC-GRPO's settings).
- :mod:`~ncgrpo.trainer.grpo`: ``NCGRPOTrainer(GRPOTrainer)``: the generation seam, the schedule, regrouping,
  the importance-sampling policy and SPSA after rewards, and every TRL override, in the class's last
  section (its module docstring maps the paper's Algorithm 1 onto TRL).
- :mod:`~ncgrpo.trainer.vllm`: the vLLM adapter (one noise spec per request; the branch-point pass).
- :mod:`~ncgrpo.trainer.generation`: the generation machinery: branch-point hooks and what they record,
  the noise-averaged first-token TV, the prompt-only pass, the control's T0 calibration.
- :mod:`~ncgrpo.trainer.metrics`: the after-rewards metrics, the branch point's TV / agreement statistics
  and the importance-sampling policy (the per-generation records, ``Generation`` and ``StepRecord``, are
  :mod:`ncgrpo.methods.base`'s).
- :mod:`~ncgrpo.trainer.images`: NoisyRollout's image method and the images vLLM gets.
- :mod:`~ncgrpo.trainer.checkpoints`: NC-GRPO's state in checkpoints.
- :mod:`~ncgrpo.trainer.shared_loss`: ``share_prompt_loss``'s packed loss-side forward.
- :mod:`~ncgrpo.trainer.checks`: what the trainer refuses or warns about (PEFT on vLLM, LoRA dropout,
  prompt lengths).
- :mod:`~ncgrpo.trainer.inert`, :mod:`~ncgrpo.trainer.prefix`: the inert-noise warning and the
  ``branch_prefix`` chat-template helpers, the trainer's own.

The modules other than ``grpo`` hold plain functions the class calls; none is a base class of it.
"""

from ncgrpo.methods.base import StepRecord
from ncgrpo.trainer.config import NCGRPOConfig
from ncgrpo.trainer.grpo import NCGRPOTrainer
from ncgrpo.trainer.metrics import apply_noisy_importance_sampling

__all__ = [
    "NCGRPOConfig",
    "NCGRPOTrainer",
    "StepRecord",
    "apply_noisy_importance_sampling",
]
