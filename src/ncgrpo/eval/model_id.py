"""Which model a folder's records are of: :func:`model_id_of`, an id from the contents of a model's weight
files and of the small files that change its answers (a hub id: of its cached snapshot).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ncgrpo.eval.model_load import adapter_base

__all__ = [
    "LOAD_OPTIONS",
    "MODEL_ID_FILES",
    "MODEL_ID_RULE",
    "NOT_WEIGHTS",
    "file_sha256",
    "model_id_of",
    "weight_files",
]

#: How :func:`model_id_of` makes an id (run.json ``model_id_rule``): from the weight files' contents.
#: Folders written before the field existed hashed the weight files' names and sizes only
#: (:data:`ncgrpo.eval.evaluate.LEGACY_DEFAULTS`); appending to them is refused, as their records cannot be shown to be
#: of the weights at hand.
MODEL_ID_RULE = "weights-sha256"

#: processor); their bytes are part of :func:`model_id_of`. Training state (``trainer_state.json``,
#: ``optimizer.pt``, ``training_args.bin``, ...) is not.
MODEL_ID_FILES = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
)
#: ``*.bin`` files of a checkpoint that are not weights.
NOT_WEIGHTS = frozenset({"training_args.bin"})

_HASHES: dict[tuple[str, int, int, int, int], str] = {}  # (path, size, mtime_ns, inode, device) -> sha256


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a model folder: ``*.safetensors`` and ``*.bin`` (full models and PEFT
    adapters, sharded or not; not ``training_args.bin``), sorted by name."""
    p = Path(path)
    found = [*p.glob("*.safetensors"), *p.glob("*.bin")]
    return sorted(f for f in found if f.is_file() and f.name not in NOT_WEIGHTS)


def file_sha256(path: str | Path, chunk: int = 1 << 24) -> str:
    """sha256 hex of a file's bytes, read in ``chunk``-byte pieces (a 15 GB shard never sits in memory).
    Cached for the process by (path, size, mtime, inode): a model's weights are read once per
    evaluation, and a rewritten file (``train --overwrite``) changes its mtime and is read again."""
    f = Path(path)
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    got = _HASHES.get(key)
    if got is None:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
        got = _HASHES[key] = h.hexdigest()
    return got


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of a cached hub model (the revision ``from_pretrained`` loads offline),
    or None when there is none here."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a repo id: the id is the name alone
        return None


#: keys ``save_pretrained`` copies into a tokenizer's or processor's JSON from how it was LOADED (hub
#: access options), which change no answer: a model saved in a process with ``HF_HUB_OFFLINE`` set writes
#: ``"local_files_only": true``, the same model saved elsewhere ``false``
LOAD_OPTIONS = frozenset(
    {"local_files_only", "cache_dir", "token", "use_auth_token", "force_download", "proxies"}
)


def _answer_bytes(f: Path) -> bytes:
    """What of a small model file can change an answer: a JSON file without :data:`LOAD_OPTIONS` (keys
    sorted), any other file as it is."""
    data = f.read_bytes()
    if f.suffix != ".json":
        return data
    try:
        obj = json.loads(data)
    except ValueError:
        return data  # not JSON after all: hashed as it is
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in LOAD_OPTIONS}
    return json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()


def model_id_of(path: str | Path) -> str:
    """A short stable id for a model folder: its name, ``@``, and 12 hex digits of a sha256 over the
    contents of its weight files (:func:`weight_files`) and of the small files that change its
    answers (:data:`MODEL_ID_FILES`). Two folders of the same name with other weights (another seed,
    a retrained run) get other ids; a PEFT adapter folder's id includes its base model's. A hub id is hashed from its cached snapshot (``ID@hash``: another
    revision is another model); one not cached here is its own id."""
    p = Path(path)
    label = p.name
    if not p.exists():
        snapshot = _hub_snapshot(str(path))
        if snapshot is None:
            return str(path)
        p, label = snapshot, str(path)  # a cached hub id: the revision on disk, by its contents
    h = hashlib.sha256(f"ncgrpo model id ({MODEL_ID_RULE})\n".encode())
    for small in MODEL_ID_FILES:
        f = p / small
        if f.is_file():
            h.update(f"{small}\0{hashlib.sha256(_answer_bytes(f)).hexdigest()}\n".encode())
    for w in weight_files(p):
        h.update(f"{w.name}\0{w.stat().st_size}\0{file_sha256(w)}\n".encode())
    try:
        base = adapter_base(p)
    except ValueError:  # an unreadable adapter config: the load names it
        base = None
    if base is not None:  # a PEFT adapter is its base's weights too
        h.update(f"base\0{model_id_of(base)}\n".encode())
    return f"{label}@{h.hexdigest()[:12]}"
