"""Adapters that run NC-GRPO inside other RL frameworks (optional extras; none is imported by the library).

- :mod:`ncgrpo.integrations.verl`: verl 0.9 (Ray, the v1 trainer): an agent-loop worker that gives the
  noisy half of every rollout group the vLLM plugin's noise spec (``pip install "ncgrpo[verl]"``;
  docs/verl.md).
"""
