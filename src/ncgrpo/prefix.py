"""Moved to :mod:`ncgrpo.trainer.prefix` (the trainer's own); this name stays for one release."""

from ncgrpo.trainer.prefix import *  # noqa: F403
from ncgrpo.trainer.prefix import __all__  # noqa: F401
