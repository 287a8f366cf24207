"""ncgrpo: Noise-Contrastive GRPO (latent-space rollout diversification for RLVR)."""

__version__ = "0.1.0"
