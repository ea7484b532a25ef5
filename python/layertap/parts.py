"""Datasets of several parts: the directories (or shard files) that many writers on many machines
fill, read as one dataset (docs/FORMAT.md, "Datasets of several parts").

A dataset's parts come from a list given to ``layertap.open([...])`` or from a *manifest*, a small
JSON file named ``layertap-dataset.json`` in a directory::

    {"layertap_dataset": 1, "parts": ["engine-0", "engine-1", "/mnt/node7/hs"]}

Opening that directory opens every part listed, in that order (relative paths are relative to the
manifest's directory; ``"."`` is the directory's own shards). The dataset order is the parts in
order, then each part's shards by file name, then records in file order: a key written by two
writers is looked up as the first of its records in that order, and ``verify`` reports the others.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass

from layertap._files import write_atomic
from layertap._spec.format import SHARD_SUFFIX
from layertap.errors import FormatError, InvalidInputError

MANIFEST_NAME = "layertap-dataset.json"
#: The manifest version this reader knows (``"layertap_dataset"``).
MANIFEST_VERSION = 1
#: A manifest larger than this is not a manifest (it lists paths, not data).
MAX_MANIFEST_BYTES = 16 << 20


@dataclass(frozen=True)
class Parts:
    """What a path (or list of paths) given to ``layertap.open`` names."""

    name: str
    """How the dataset is called in messages: the path given, or the paths joined by ``", "``."""
    paths: list[str]
    """The parts in dataset order: directories of shards, or shard files."""
    root: str | None
    """The directory that shard names are shown relative to (the manifest's), or None: by
    file name."""
    manifest: str | None = None
    """The manifest file the parts were listed in, if one."""


def _not_found(path: str, why: str = "") -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "No such file or directory" + why, path)


def read_manifest(manifest: str | os.PathLike) -> list[str]:
    """The parts a manifest file lists, as paths (relative ones joined to the manifest's
    directory). Raises FormatError naming the manifest when it is not one."""
    manifest = os.fspath(manifest)
    try:
        with open(manifest, "rb") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise _not_found(manifest) from None
    if len(text) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{manifest}: larger than {MAX_MANIFEST_BYTES} bytes: not a dataset manifest", manifest)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise FormatError(f"{manifest}: not a dataset manifest (not JSON: {e})", manifest) from None
    if not isinstance(obj, dict) or "layertap_dataset" not in obj:
        raise FormatError(f'{manifest}: not a dataset manifest (no "layertap_dataset" member)', manifest)
    version = obj["layertap_dataset"]
    if version != MANIFEST_VERSION:
        raise FormatError(
            f"{manifest}: manifest version {version!r}; this layertap reads version {MANIFEST_VERSION}", manifest
        )
    parts = obj.get("parts")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, str) and p for p in parts):
        raise FormatError(f'{manifest}: "parts" must be a non-empty list of paths', manifest)
    base = os.path.dirname(os.path.abspath(manifest))
    return [os.path.normpath(os.path.join(base, p)) for p in parts]


def write_manifest(directory: str | os.PathLike, parts: list[str], **extra) -> str:
    """Writes ``directory/layertap-dataset.json`` listing ``parts`` (paths inside ``directory``
    are stored relative to it, so the whole tree can be moved), atomically: a reader sees the
    old manifest or the new one. ``extra`` members are stored beside (readers ignore them).
    Returns the manifest's path."""
    directory = os.path.abspath(os.fspath(directory))
    if not parts:
        raise InvalidInputError("a manifest lists at least one part")
    stored = []
    for p in parts:
        full = os.path.abspath(os.path.join(directory, os.fspath(p)))
        rel = os.path.relpath(full, directory)
        stored.append(full if rel == ".." or rel.startswith(".." + os.sep) else rel)
    if len(set(stored)) != len(stored):
        raise InvalidInputError(f"a manifest lists each part once: {stored}")
    path = os.path.join(directory, MANIFEST_NAME)
    body = json.dumps({"layertap_dataset": MANIFEST_VERSION, "parts": stored, **extra}, indent=1) + "\n"
    write_atomic(path, body, durable=True)
    return path


def _is_manifest_file(path: str) -> bool:
    """A file given by path: a manifest (a JSON object) rather than a shard."""
    if os.path.basename(path) == MANIFEST_NAME or path.endswith(".json"):
        return True
    with open(path, "rb") as f:
        return f.read(1) == b"{"


def _expand(path: str) -> tuple[list[str], str | None, str | None]:
    """(parts, manifest, root) of one path given by the caller."""
    if os.path.isdir(path):
        manifest = os.path.join(path, MANIFEST_NAME)
        if not os.path.isfile(manifest):
            return [path], None, None
    elif not os.path.exists(path):
        raise _not_found(path)
    elif _is_manifest_file(path):
        manifest = path
    else:
        return [path], None, None
    parts = read_manifest(manifest)
    home = os.path.dirname(os.path.abspath(manifest))
    for p in parts:
        if not os.path.exists(p):
            raise _not_found(p, f" (a part listed in {manifest})")
        if p != home and os.path.isdir(p) and os.path.exists(os.path.join(p, MANIFEST_NAME)):
            raise FormatError(f"{manifest}: part {p} holds a manifest of its own; list its parts instead", manifest)
        if os.path.isfile(p) and not p.endswith(SHARD_SUFFIX):
            raise FormatError(f"{manifest}: part {p} is neither a directory nor a *{SHARD_SUFFIX} shard", manifest)
    return parts, manifest, home


def resolve(path: str | os.PathLike | list | tuple) -> Parts:
    """The parts that ``path`` names: a directory (its manifest's parts when it has one, else
    itself), a shard file, a manifest file, or a list of those (concatenated in order). Raises
    FileNotFoundError for a missing path or part, FormatError for a bad manifest,
    InvalidInputError for an empty list or a part named twice."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise InvalidInputError("layertap.open: an empty list of paths")
        given = [os.fspath(p) for p in path]
    else:
        given = [os.fspath(path)]
    expanded = [_expand(g) for g in given]
    paths = [p for parts, _, _ in expanded for p in parts]
    seen: dict[str, str] = {}
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            raise InvalidInputError(f"{p}: the same part is given twice ({seen[real]}); each record would repeat")
        seen[real] = p
    if len(given) == 1:
        _, manifest, root = expanded[0]
        return Parts(given[0], paths, root, manifest)
    # Several paths: shard names relative to the directory they share, when they share one.
    dirs = [os.path.abspath(p if os.path.isdir(p) else os.path.dirname(p)) for p in paths]
    return Parts(", ".join(given), paths, os.path.commonpath(dirs) if len(paths) > 1 else None)


__all__ = ["MANIFEST_NAME", "Parts", "read_manifest", "resolve", "write_manifest"]
