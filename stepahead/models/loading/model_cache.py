"""The conversion cache: what loading a GGUF file derives, kept so later starts read only that.

The first load of a GGUF checkpoint parses its metadata (its vocabulary field by field: seconds),
builds a Hugging Face tokenizer from it (seconds more) and dequantizes every tensor. All of that is
written once into an entry of the cache, a plain model folder: `config.json`, the tokenizer's files,
`model.safetensors` in the dtype the engine runs and, for a quantized file, the codes of its quantized
tensors (`quantized_weights.st`), which later loads map from disk.

- Where: `$STEPAHEAD_CACHE`, default `~/.cache/stepahead`; `STEPAHEAD_CACHE=off` (or the engine's
  `--no-model-cache`) turns it off.
- Key: the source file's size and mtime, a hash of its first MiB (the GGUF header), the dtype and
  CONVERTER_VERSION (raise it whenever the conversion's output changes).
- Integrity: `manifest.json`, written last, lists every file with its size and a SHA-256 (of the whole
  file when small, of its size, head and tail when large). An entry whose manifest is missing or does
  not match is removed with a warning and rebuilt, never loaded.
- Concurrency: an entry is built in a temporary folder beside its final place and renamed into it
  (atomic on one filesystem); when two processes build the same entry, the second rename fails and
  that process uses the winner's entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 3  # 2: the quantized codes (gguf_quantized.QUANT_FILE); 3: Q5_0 and k-quant codes too
MANIFEST = "manifest.json"
_HEADER_BYTES = 1 << 20
_WHOLE_HASH_LIMIT = 16 << 20  # files up to this size are hashed whole
_SAMPLE_BYTES = 4 << 20  # larger ones: their size, first and last 4 MiB


def cache_root() -> Path | None:
    """The cache folder, or None when the cache is turned off."""
    configured = os.environ.get("STEPAHEAD_CACHE", "")
    if configured.lower() in ("off", "0", "false", "none"):
        return None
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "stepahead"


def entry_key(source: Path, dtype: str) -> str:
    stat = source.stat()
    digest = hashlib.sha256()
    with source.open("rb") as f:
        digest.update(f.read(_HEADER_BYTES))
    digest.update(f"{stat.st_size}:{stat.st_mtime_ns}:{dtype}:v{CONVERTER_VERSION}".encode())
    return f"{source.stem}-{digest.hexdigest()[:24]}"


def file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= _WHOLE_HASH_LIMIT:
            digest.update(f.read())
        else:
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(size - _SAMPLE_BYTES)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": file_fingerprint(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"converter_version": CONVERTER_VERSION, "files": files}, indent=1))


def entry_problem(folder: Path) -> str | None:
    """Why the entry cannot be used, or None when every file matches its manifest."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable manifest ({e})"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
        if file_fingerprint(path) != expected["sha256"]:
            return f"{name} does not match its hash"
    return None


def cached_folder(source: Path, dtype: str, build: Callable[[Path], None]) -> Path | None:
    """The cache entry for (source, dtype), built with build(folder) if it is missing or damaged.

    Returns None when the cache is off or cannot be written (the caller then loads the source itself).
    """
    root = cache_root()
    if root is None:
        return None
    final = root / entry_key(source, dtype)
    if final.is_dir():
        problem = entry_problem(final)
        if problem is None:
            return final
        logger.warning("model cache entry %s is damaged (%s): rebuilding it", final, problem)
        shutil.rmtree(final, ignore_errors=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    except OSError as e:
        logger.warning("model cache %s is not writable (%s): loading %s without it", root, e, source)
        return None
    try:
        build(building)
        _write_manifest(building)
        try:
            os.rename(building, final)
        except OSError:  # another process finished the same entry first: use that one
            if entry_problem(final) is not None:
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final
