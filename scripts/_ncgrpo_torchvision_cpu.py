"""torchvision beside a CPU-only torch: import it without its C++ operators.

Installed by scripts/setup_vllm.sh into a vLLM environment whose torch is a ``+cpu`` build, as
``_ncgrpo_torchvision_cpu.py`` plus a ``.pth`` line that imports it at interpreter start-up (so vLLM's
engine and worker processes get it too). Nowhere else.

Why: PyPI has one torchvision wheel per release for x86_64 Linux, built against the CUDA torch; its
``_C.so`` links ``libc10_cuda.so`` / ``libtorch_cuda.so``, which a ``+cpu`` torch does not ship, so it
does not load. torchvision expects that case (``torchvision.extension._has_ops()`` is then False and
each C++ operator, ``nms``, ``roi_align``, ``deform_conv2d`` ..., raises torchvision's own "Couldn't
load custom C++ ops" error when called), except that ``import torchvision`` then imports
``torchvision._meta_registrations`` and ``torchvision._autograd_registrations``, which register fake
and autograd kernels for those operators and fail because they were never defined
(``RuntimeError: operator torchvision::nms does not exist``). Those two modules only concern the
missing operators, so when the operators did not load this finder gives them an empty module instead;
everything else of torchvision (``transforms``, ``io`` decoders aside) is pure Python on torch and
works. vLLM's Qwen2-VL family needs only that (``transformers``' Qwen2-VL image and video processors
use ``torchvision.transforms.v2.functional``). When ``_C`` does load (a CUDA torch, or a real CPU
torchvision build), the finder does nothing.

Nothing is imported at start-up beyond ``importlib``: the check runs when torchvision is imported.
"""

import importlib.abc
import importlib.machinery
import sys

_OPS_ONLY = ("torchvision._meta_registrations", "torchvision._autograd_registrations")


class _EmptyModule(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__doc__ = "not loaded: torchvision's C++ operators are unavailable beside this CPU-only torch"


class _SkipOpRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _OPS_ONLY:
            return None
        extension = sys.modules.get("torchvision.extension")
        if extension is None or extension._has_ops():
            return None
        return importlib.machinery.ModuleSpec(name, _EmptyModule())


if not any(isinstance(f, _SkipOpRegistrations) for f in sys.meta_path):
    sys.meta_path.insert(0, _SkipOpRegistrations())
