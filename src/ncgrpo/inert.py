"""Moved to :mod:`ncgrpo.trainer.inert` (the trainer's own); this name stays for one release."""

from ncgrpo.trainer.inert import *  # noqa: F403
from ncgrpo.trainer.inert import __all__  # noqa: F401
