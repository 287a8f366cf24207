"""The run folder's one home.

- :mod:`ncgrpo.runs.folder`: the layout of a run folder (file names), atomic writers, the JSON-lines
  reader, the ``run.json`` reader, run identity, checkpoint completeness and the folder lock (plain
  files; used by every command).
- :mod:`ncgrpo.runs.provenance`: what made a run (the ncgrpo commit, whether its source was dirty, the
  versions of Python, torch, transformers, TRL, peft, vLLM, accelerate), recorded in every run.json
  beside the identity, never part of it; a resume or append under another one warns and is recorded.
- :mod:`ncgrpo.runs.identity`: a training run's identity (every setting ncgrpo declares but a short list
  of what may change on resume), shared by ``ncgrpo train --resume`` and the demo's reruns.

The run driver, which builds and trains an ``NCGRPOTrainer`` into a run folder, sits above the trainer:
:mod:`ncgrpo.driver`.
"""
