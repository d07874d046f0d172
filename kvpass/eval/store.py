"""A resumable JSON store of evaluation cases: ``{"meta": {...}, "cases": [{...}, ...]}``.

Every case has a ``key`` (a string naming everything that determines its result); a re-run skips
keys already stored. The file is rewritten atomically after each added case, so an interrupted run
loses at most the case in flight. Parallel workers (``--jobs``) each write a shard; ``Store`` reads
shards too and ``merge_shards`` folds them in.

A path ending in ``.json.gz`` is gzip-compressed JSON (compact, keys sorted, no timestamp in the gzip
header: the same content gives the same bytes); any other path is plain JSON (indent 1, keys sorted).
The shards of ``<name>.json`` are ``<name>.shard<tag>.json`` and those of ``<name>.json.gz`` are
``<name>.shard<tag>.json.gz`` (``shard_path``): a shard keeps its store's format.

Standard library only: the peers runners load this file by path in a venv without kvpass's runtime
(``benchmarks/peers/cases.py``).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
GZIP_SUFFIX = ".json.gz"


def is_gzip(path: str | Path) -> bool:
    """Whether ``path`` names a gzip-compressed JSON file (its name ends in ``.json.gz``)."""
    return Path(path).name.endswith(GZIP_SUFFIX)


def split_name(path: str | Path) -> tuple[str, str]:
    """``path``'s file name as (base, store suffix): 'x.json.gz' -> ('x', '.json.gz'), 'x.json' -> ('x', '.json');
    a name with another suffix keeps it ('x.txt' -> ('x', '.txt')), one with none gets ''."""
    path = Path(path)
    if is_gzip(path):
        return path.name[: -len(GZIP_SUFFIX)], GZIP_SUFFIX
    return path.stem, path.suffix


def read_json(path: str | Path) -> Any:
    """The JSON value in ``path`` (gunzipped first when its name ends in ``.json.gz``)."""
    path = Path(path)
    if is_gzip(path):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def json_bytes(obj: Any, gzipped: bool) -> bytes:
    """``obj`` serialised with sorted keys: gzip of compact JSON (header mtime 0, so deterministic) or
    plain JSON with indent 1."""
    if gzipped:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
        return gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)
    return json.dumps(obj, indent=1, sort_keys=True).encode("utf-8")


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` to ``path`` atomically (a ``.tmp`` beside it, then ``os.replace``), gzipped when the
    name ends in ``.json.gz``; creates the parent directory. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(json_bytes(obj, is_gzip(path)))
    os.replace(tmp, path)
    return path


class Store:
    """Cases by key, persisted to ``path`` (created with its parent directory on first write)."""

    def __init__(self, path: str | Path, meta: dict[str, Any] | None = None, write_path: str | Path | None = None):
        self.path = Path(path)
        self.write_path = Path(write_path) if write_path else self.path
        self.meta: dict[str, Any] = {"schema": SCHEMA_VERSION}
        self.cases: dict[str, dict[str, Any]] = {}
        for p in [self.path, *shard_paths(self.path)]:
            if p.exists():
                data = read_json(p)
                self.meta.update(data.get("meta", {}))
                for case in data.get("cases", []):
                    self.cases[case["key"]] = case
        if meta:
            self.meta.update(meta)

    def __contains__(self, key: str) -> bool:
        return key in self.cases

    def __len__(self) -> int:
        return len(self.cases)

    def add(self, case: dict[str, Any]) -> None:
        """Store one case (it must carry ``key``) and rewrite the file."""
        if "key" not in case:
            raise ValueError("a case needs a 'key'")
        self.cases[case["key"]] = case
        self.save()

    def add_many(self, cases: list[dict[str, Any]]) -> None:
        """Store several cases and rewrite the file once."""
        for case in cases:
            if "key" not in case:
                raise ValueError("a case needs a 'key'")
            self.cases[case["key"]] = case
        if cases:
            self.save()

    def save(self) -> None:
        write_json(self.write_path, {"meta": self.meta,
                                     "cases": sorted(self.cases.values(), key=lambda c: c["key"])})

    def select(self, **match: Any) -> list[dict[str, Any]]:
        """Cases whose fields equal every ``match`` item."""
        return [c for c in self.cases.values() if all(c.get(k) == v for k, v in match.items())]


def shard_path(path: str | Path, tag: int | str) -> Path:
    """The shard ``tag`` of the store ``path``: 'x.json' -> 'x.shard<tag>.json',
    'x.json.gz' -> 'x.shard<tag>.json.gz'."""
    base, suffix = split_name(path)
    return Path(path).with_name(f"{base}.shard{tag}{suffix}")


def shard_paths(path: str | Path) -> list[Path]:
    """Every shard of the store ``path`` on disk (same format as the store), sorted by name."""
    path = Path(path)
    base, suffix = split_name(path)
    if not path.parent.exists():
        return []
    return sorted(p for p in path.parent.glob(f"{base}.shard*{suffix}") if is_gzip(p) == is_gzip(path))


def merge_shards(path: str | Path) -> Store:
    """Fold every shard of ``path`` into it and delete the shards."""
    path = Path(path)
    store = Store(path)
    store.save()
    for p in shard_paths(path):
        p.unlink()
    return store


def case_key(**fields: Any) -> str:
    """A stable key from the fields that determine a case: 'budget=0.2|depth=0.5|...'."""
    return "|".join(f"{k}={fields[k]}" for k in sorted(fields))
