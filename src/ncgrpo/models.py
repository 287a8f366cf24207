"""Loading a model the transformers way: model and processor (or tokenizer) from a folder, the
device and dtype rules, vision-tower freezing, and :func:`tokenizer_of`. Shared by ``ncgrpo train``,
``ncgrpo eval``, ``ncgrpo probe``, the benchmarks and the embedded demo. The torchvision-free Qwen VL
processors it loads are :mod:`ncgrpo.processors`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import huggingface_hub  # huggingface_hub.model_info: looked up at the call (tests stand in for it)
import torch
from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open

from ncgrpo.core.noise import parse_noise_site

__all__ = [
    "VISION_TOWER_PATHS",
    "available_memory",
    "check_model_source",
    "check_noise_site",
    "check_weight_files",
    "find_vision_tower",
    "freeze_vision_tower",
    "is_vision_language",
    "load_config",
    "load_model_and_processor",
    "load_processor",
    "resolve_device",
    "resolve_dtype",
    "set_pixel_budget",
    "text_layers",
    "tokenizer_of",
]


def available_memory() -> int | None:
    """Bytes of host memory available to a new allocation (psutil's ``available`` where installed, else
    Linux's ``MemAvailable``, else free pages), or None where none of them can be read. Counts that grow
    memory are checked against it before they allocate (``ncgrpo probe --marginal_draws``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass

    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _looks_like_a_path(name: str) -> bool:
    """Whether a ``model_name_or_path`` that is no local folder is meant as one (not a hub id ORG/NAME)."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.endswith("/") or name.count("/") > 1:
        return True
    if "/" in name and Path(name.split("/", 1)[0]).is_dir():
        return True  # runs/my-model with a local runs/: a folder, not the hub namespace "runs"

    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_model_source(
    name: str | Path, what: str = "--model_name_or_path", *, contents: bool = True
) -> None:
    """Refuse, before anything loads or is written, a model that is not there: a path that does not
    exist (at once, no hub lookup; transformers would take it for a hub id and answer with a "repo id"
    message), a file, or (``contents``) a folder with no ``config.json`` (``ncgrpo eval`` passes False:
    it also takes PEFT adapter folders and training runs, and its loader says what such a folder
    lacks). A name shaped like a hub id ``ORG/NAME`` that is
    no local folder must be in the hub cache or answer one request to the hub (refused at once where
    the hub says no such model or cannot be reached, or ``HF_HUB_OFFLINE`` is set). ``what``: the flag
    or setting named in the message. Shared by ``ncgrpo train``, ``eval`` and ``probe``."""

    name = str(name)
    p = Path(os.path.expanduser(name))
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{what} {name}: is a file; pass the folder save_pretrained wrote (or a hub id)")
        if contents and not (p / "config.json").is_file():
            raise ValueError(
                f"{what} {name}: the folder holds no config.json, so it is not a model saved with save_pretrained"
            )
        return
    if _looks_like_a_path(name):
        raise ValueError(
            f"{what} {name}: {p.absolute()} does not exist; pass a folder written by save_pretrained, or a hub "
            "id ORG/NAME"
        )

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"{what} {name}: no local folder {p.absolute()} (it does not exist), and not in the hub cache "
            f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set"
        )
    # one request, no retries: transformers' own lookup retries for ~30 s where the hub cannot be reached
    try:
        huggingface_hub.model_info(name, timeout=10)
    except GatedRepoError:
        return  # it exists; the config lookup says what access it needs
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what} {name}: no local folder {p.absolute()} (it does not exist), and no model {name} on the hub "
            "(or a private one: log in with `hf auth login`)"
        ) from None
    except Exception as e:  # noqa: BLE001 - the hub cannot be reached: the run could not load it either
        raise ValueError(
            f"{what} {name}: no local folder {p.absolute()} (it does not exist), and the hub cannot be reached "
            f"to look it up as a hub id ({type(e).__name__}: {e}); pass a local folder"
        ) from None


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer behind a processor (or the tokenizer itself)."""
    return getattr(processor, "tokenizer", processor)


#: Where VL models keep their vision tower, tried in order (Qwen2/2.5/3-VL: ``model.visual``).
VISION_TOWER_PATHS = ("model.visual", "visual", "model.vision_tower", "vision_tower", "model.vision_model")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that supports it, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def check_device(device: str | None) -> None:
    """Refuse, before any model loads, a device this machine's torch cannot use: ``cuda`` / ``cuda:N``
    without CUDA (or past the last GPU), or a spelling other than ``auto``, ``cpu``, ``cuda``, ``cuda:N``."""
    if device in (None, "auto", "cpu"):
        return
    kind, _, index = str(device).partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu or auto"
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices (cuda:0..)")


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def is_vision_language(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model_and_processor(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = "auto",
    attn_implementation: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    freeze_vision: bool = False,
) -> tuple[Any, Any]:
    """``(model, processor)`` for a vision-language checkpoint, ``(model, tokenizer)`` for a text one.

    ``path`` is a local folder (or a hub id already in the cache). ``dtype``: ``auto`` (bfloat16 on a
    GPU that has it, float32 elsewhere) or a name such as ``bfloat16``. ``device``: the model is put
    there in eval mode; ``None`` leaves it where ``from_pretrained`` put it (the Trainer moves it).
    ``min_pixels`` / ``max_pixels`` go to the image processor. ``freeze_vision``: see
    :func:`freeze_vision_tower`. The tokenizer pads on the left, which batched generation needs.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dev = resolve_device(device) if device is not None else None
    config = load_config(path)
    check_weight_files(path)  # a torn weights file is named here, not as SafetensorError inside the load
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype, dev or torch.device("cpu"))}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(path, **kwargs)
    except Exception as e:  # noqa: BLE001 - only safetensors' own error is rewritten, the rest re-raised
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(
            f"{path}: cannot read its weights ({e}); is a .safetensors file torn or truncated?"
        ) from e
    processor = load_processor(path, config=config, min_pixels=min_pixels, max_pixels=max_pixels)
    if is_vision_language(config) and freeze_vision:
        freeze_vision_tower(model)  # a text-only model has no vision tower: freeze_vision has nothing to do
    if dev is not None:
        model.to(dev).eval()
    return model, processor


def load_config(path: str | Path) -> Any:
    """The model config at ``path`` (a model folder); a FileNotFoundError that says what to pass if none."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except OSError as e:
        raise FileNotFoundError(
            f"cannot load a model config from {path!s}: {e}. Pass a folder written by save_pretrained "
            "(config.json, weights, tokenizer/processor files)."
        ) from None


def load_processor(
    path: str | Path,
    *,
    config: Any = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> Any:
    """The processor of a vision-language checkpoint, the tokenizer of a text one, without the weights
    (what :func:`load_model_and_processor` returns beside the model; ``ncgrpo eval --engine vllm``
    renders prompts with it). The tokenizer pads on the left, which batched generation needs."""
    from transformers import AutoTokenizer

    from ncgrpo import processors  # the torchvision-free Qwen VL processors (registered on import)

    config = config if config is not None else load_config(path)
    if is_vision_language(config):
        # AutoProcessor, or the image-only Qwen VL processor where torchvision is missing (a hub checkpoint)
        processor = processors.from_pretrained(path, config)
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(
                f"{path}: AutoProcessor gave {type(processor).__name__}, which has no image processor; "
                "a vision-language model needs its processor saved next to it"
            )
        set_pixel_budget(processor.image_processor, min_pixels=min_pixels, max_pixels=max_pixels)
        tok = processor.tokenizer
    else:
        processor = AutoTokenizer.from_pretrained(path)
        tok = processor
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return processor


def set_pixel_budget(image_processor: Any, *, min_pixels: int | None, max_pixels: int | None) -> None:
    """Set a Qwen-VL image processor's pixel budget in its ``size`` (``shortest_edge`` / ``longest_edge``
    are transformers 5's names for min_pixels / max_pixels), where every call reads it. Not by passing
    ``min_pixels=`` to ``from_pretrained``: the processor then hands them to every call, which
    transformers 5.2x warns is deprecated (a FutureWarning per batch). ``None`` keeps the checkpoint's."""
    if min_pixels is None and max_pixels is None:
        return
    current = getattr(image_processor, "size", None) or {}
    size = {k: v for k, v in dict(current).items() if v is not None}
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    image_processor.size = type(current)(**size) if not isinstance(current, dict) else size
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if (
            value is not None and getattr(image_processor, name, None) is not None
        ):  # transformers 4.x kept both
            setattr(image_processor, name, int(value))


def check_weight_files(path: str | Path) -> None:
    """Refuse a model folder whose ``.safetensors`` weights cannot be opened (a copy or save cut short),
    naming the file; reads only each file's header. A hub id or a folder without safetensors passes
    (``from_pretrained`` reports those)."""
    folder = Path(path)
    if not folder.is_dir():
        return

    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: the file is unreadable either way
            size = f.stat().st_size if f.exists() else 0
            raise ValueError(
                f"{f}: not a readable safetensors file ({size} bytes; {e}); the weights are torn or "
                "truncated (an interrupted save or copy?): copy them again or pick another checkpoint"
            ) from None


def find_vision_tower(model) -> tuple[str, Any] | None:
    """``(path, module)`` of the vision tower (first of :data:`VISION_TOWER_PATHS`), or ``None``."""
    for path in VISION_TOWER_PATHS:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if node is not None:
            return path, node
    return None


def freeze_vision_tower(model) -> str:
    """Set ``requires_grad=False`` on the vision tower's parameters (the paper's recipe, section 4.1);
    returns where it was found."""
    found = find_vision_tower(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__}: no vision tower at any of {', '.join(VISION_TOWER_PATHS)}; "
            "set freeze_vision_tower=false for a text-only model"
        )
    path, tower = found
    for p in tower.parameters():
        p.requires_grad_(False)
    return path


def text_layers(model_name_or_path: str | Path) -> int | None:
    """Decoder layers of the model's language stack, from its config alone (no weights); None if the
    config cannot be read here (then the trainer checks once the model is loaded)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_name_or_path)
    except Exception:  # noqa: BLE001 - not readable without the model: the trainer checks later
        return None
    n = getattr(cfg.get_text_config(), "num_hidden_layers", None)
    return int(n) if n is not None else None


def check_noise_site(noise_site: str, model_name_or_path: str | Path, config: Any = None) -> None:
    """Refuse a layer noise site past the model's decoder layers, read from its config before any
    weight is loaded (``final_norm`` fits every model). ``config``: the model's config where the caller
    has read it already (else it is read from ``model_name_or_path``)."""

    site = parse_noise_site(noise_site)
    if site == "final_norm":
        return
    if config is None:
        n_layers = text_layers(model_name_or_path)
    else:
        n = getattr(config.get_text_config(), "num_hidden_layers", None)
        n_layers = int(n) if n is not None else None
    if n_layers is not None and max(site) >= n_layers:
        raise ValueError(
            f"noise_site={noise_site!r} names layer {max(site)} but {model_name_or_path} has "
            f"{n_layers} decoder layers (0..{n_layers - 1})"
        )
