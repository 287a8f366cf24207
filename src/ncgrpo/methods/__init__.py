"""Rollout methods, one module each, registered by name (:mod:`ncgrpo.methods.base`).

``get_method(name)`` is how every other part of ncgrpo learns what a method is and does; a new method is
one module that subclasses :class:`RolloutMethod` and registers itself (docs/extending.md). Importing
this package registers the built-in methods, in the order the paper and ``--help`` list them.
"""

# isort: off
from ncgrpo.methods import (  # noqa: F401  (registers the built-ins, in this order)
    vanilla,
    latent,
    image,
    antithetic,
    spsa,
    first_token_temperature,
    first_token_marginal,
)

# isort: on
from ncgrpo.methods.base import (
    Generation,
    GenerationPlan,
    RolloutMethod,
    baseline_method,
    get_method,
    method_help,
    method_names,
    methods,
    register_method,
    unregister_method,
)

__all__ = [
    "Generation",
    "GenerationPlan",
    "RolloutMethod",
    "baseline_method",
    "get_method",
    "method_help",
    "method_names",
    "methods",
    "register_method",
    "unregister_method",
]
