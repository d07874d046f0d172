"""A resumable JSON store of evaluation cases: ``{"meta": {...}, "cases": [{...}, ...]}``.

Every case has a ``key`` (a string naming everything that determines its result); a re-run skips
keys already stored. The file is rewritten atomically after each added case, so an interrupted run
loses at most the case in flight. Parallel workers (``--jobs``) each write a shard
``<name>.shard<i>.json``; ``Store`` reads shards too and ``merge_shards`` folds them in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


class Store:
    """Cases by key, persisted to ``path`` (created with its parent directory on first write)."""

    def __init__(self, path: str | Path, meta: dict[str, Any] | None = None, write_path: str | Path | None = None):
        self.path = Path(path)
        self.write_path = Path(write_path) if write_path else self.path
        self.meta: dict[str, Any] = {"schema": SCHEMA_VERSION}
        self.cases: dict[str, dict[str, Any]] = {}
        for p in [self.path, *shard_paths(self.path)]:
            if p.exists():
                data = json.loads(p.read_text(encoding="utf-8"))
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
        self.write_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.write_path.with_suffix(self.write_path.suffix + ".tmp")
        body = {"meta": self.meta, "cases": sorted(self.cases.values(), key=lambda c: c["key"])}
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.write_path)

    def select(self, **match: Any) -> list[dict[str, Any]]:
        """Cases whose fields equal every ``match`` item."""
        return [c for c in self.cases.values() if all(c.get(k) == v for k, v in match.items())]


def shard_paths(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.stem}.shard*{path.suffix}")) if path.parent.exists() else []


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
