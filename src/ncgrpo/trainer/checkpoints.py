"""NC-GRPO's state in Trainer checkpoints (``ncgrpo_state.pt``: method, step, SPSA's ``mu``)
and the renamed-weights workaround for resuming Qwen VL models (completeness of a
checkpoint is :mod:`ncgrpo.runs.folder`'s)."""

from __future__ import annotations

import os

import torch

from ncgrpo.runs.folder import STATE_FILE


class CheckpointState:
    """Checkpoint state of :class:`~ncgrpo.trainer.NCGRPOTrainer` (a mixin)."""

    def save_nc_state(self, checkpoint_dir: str) -> None:
        """Write ``ncgrpo_state.pt`` (method, step, SPSA's ``mu``) into a checkpoint folder, atomically
        (a temporary file renamed into place), so it is either whole or absent."""
        os.makedirs(checkpoint_dir, exist_ok=True)
        path = os.path.join(checkpoint_dir, STATE_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        state = {
            "rollout_method": self.method,
            "global_step": self.state.global_step,
            "spsa_mu": self.spsa_mu,
            "first_token_temperature_t0": self.first_token_t0,
        }
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load_nc_state(self, checkpoint: str) -> None:
        """Restore SPSA's ``mu`` / the calibrated first-token ``T0`` from a checkpoint folder (other methods
        keep no state)."""
        auto = self.method == "first_token_temperature" and self.args.first_token_temperature_auto
        if self.method != "spsa" and not auto:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if auto:
            state = torch.load(path, map_location="cpu", weights_only=True) if os.path.exists(path) else {}
            t0 = state.get("first_token_temperature_t0")
            if t0 is None:
                raise ValueError(
                    f"{path} holds no calibrated first_token_temperature_t0, so the resumed run would calibrate T0 "
                    "again on another batch; resume from a checkpoint of this run, or set first_token_temperature "
                    "by hand"
                )
            self.first_token_t0 = float(t0)
            return
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint was not written by an NC-GRPO spsa run, so the steering vector "
                "mu cannot be restored"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("spsa_mu") is None:
            raise ValueError(
                f"{path} holds no spsa_mu (written by rollout_method={state.get('rollout_method')!r})"
            )
        self.spsa_mu = state["spsa_mu"].float()

    @staticmethod
    def _renamed_checkpoint_keys(model) -> dict[str, str]:
        """``{saved name: module name}`` where ``save_pretrained`` renames keys; ``{}`` if it does not."""
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # pragma: no cover - other transformers versions
            return {}
        own = dict(model.state_dict())
        by_id = {id(v): k for k, v in own.items()}
        try:
            saved = revert_weight_conversion(model, own)
        except Exception:  # noqa: BLE001 - a model the conversion table cannot handle: leave it to the Trainer
            return {}
        if saved is own:
            return {}
        mapping = {k: by_id[id(v)] for k, v in saved.items() if id(v) in by_id}
        if len(mapping) != len(own) or all(k == v for k, v in mapping.items()):
            return {}  # not a pure renaming (or no renaming): leave it to the Trainer
        return mapping
