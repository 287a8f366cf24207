"""Whether ``ncgrpo train`` takes ``use_peft`` (LoRA) here: the GPU check's ``lora`` part runs only then.

    python scripts/gpu_check_lora_probe.py

Exit 0 when ``ModelArguments(use_peft=True)`` is accepted (ncgrpo builds a LoRA adapter and peft imports);
exit 77 with a last line ``SKIP: <reason>`` when it is refused (an ncgrpo without LoRA support, or no
peft), which scripts/gpu_check.sh records as a skipped part with that reason. Detected at run time, so
the plan needs no edit when the support lands or leaves.
"""

from __future__ import annotations

import sys

SKIP_RC = 77


def probe() -> str | None:
    """None when LoRA training is available, else the reason it is not."""
    try:
        from ncgrpo.commands.train_settings import ModelArguments
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"ncgrpo.commands.train_settings does not import: {type(e).__name__}: {e}"
    try:
        ModelArguments(model_name_or_path="gpu-check-probe", use_peft=True)
    except (ValueError, TypeError) as e:
        return f"ncgrpo train refuses use_peft here: {e}"
    try:
        import peft  # noqa: F401
    except ImportError as e:
        return f"peft does not import: {e}"
    return None


def main() -> int:
    reason = probe()
    if reason is not None:
        print(f"SKIP: {reason}")
        return SKIP_RC
    print("LoRA: ncgrpo train accepts use_peft; peft imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
