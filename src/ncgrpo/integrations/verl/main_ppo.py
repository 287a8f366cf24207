"""``python -m ncgrpo.integrations.verl.main_ppo [hydra args]``: verl 0.9.1's ``main_ppo`` training with
NC-GRPO's task runner (:data:`ncgrpo.integrations.verl.workers.NCGRPOTaskRunner`: the NC-GRPO agent-loop
manager and the sync trainer with the per-half metrics). Everything else is verl's: its Hydra config,
its overrides, its checks. See docs/verl.md and recipes/verl/."""

from __future__ import annotations


def main() -> None:
    import verl.trainer.main_ppo as verl_main

    from ncgrpo.integrations.verl.workers import NCGRPOTaskRunner

    # verl's main() runs `run_ppo(config, task_runner_class=TaskRunnerV1)` with the module global, which
    # its run_ppo documents as the recipe's seam ("task_runner_class: For recipe to change TaskRunner").
    verl_main.TaskRunnerV1 = NCGRPOTaskRunner
    verl_main.main()


if __name__ == "__main__":
    main()
