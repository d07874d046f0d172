"""Outlier-head calibration files (docs/policies.md §1.10): which KV heads keep their full cache.

``kvpass calibrate`` (kvpass/calibrate.py) measures, for every layer l and KV head g, the fraction
p(l, g) of A-set entries that one Chunked Soft Matching step leaves without an edge of cosine >= 0.8,
averaged over calibration sequences, and writes the heads with the largest p as "outliers" into a
small JSON file. A policy given the file (``Chelsea(calibration=...)``) keeps those heads full; the
runtime gives them every token in their own dense sub-group of the layer (split-group layout, §0.6 b)
and lowers the budget of the other heads so the total stays that of the nominal budget (§1.10):

    R' = (R * H - O) / (H - O)        H = KV heads of the compressible layers, O = outlier heads

File layout (JSON, one per model)::

    {"format": "kvpass-chelsea-calibration", "version": 1,
     "model": "smollm2", "model_type": "llama", "layers": 30, "kv_heads": 3, "head_dim": 64,
     "p": [[p(0, 0), p(0, 1), p(0, 2)], ...],     # [L][Hkv]; null for sliding-window layers
     "outliers": [[layer, kv_head], ...],          # largest p first
     "settings": {"samples": 16, "length": 4096, "chunk": 256, "threshold": 0.8, ...}}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvpass.validation import refuse

if TYPE_CHECKING:
    from kvpass.rewrites.attention_sites import AttentionSite

FORMAT = "kvpass-chelsea-calibration"
VERSION = 1
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "calibrations"   # kvpass/calibrations/<model>.json
OUTLIER_RATIO = 0.04           # §1.2: 4% of the KV heads keep the full cache


@dataclass(frozen=True)
class Calibration:
    """The content of one calibration file (see the module docstring).

    p: [L][Hkv] fraction of A-set entries without an edge, None for layers that are not calibrated
    (sliding-window layers, never compressed). outliers: (layer, kv_head) pairs, largest p first.
    settings: how it was measured, as (name, value) pairs (kept hashable: policies are frozen)."""

    model: str
    model_type: str
    layers: int
    kv_heads: int
    head_dim: int
    p: tuple[tuple[float | None, ...], ...] = field(repr=False)
    outliers: tuple[tuple[int, int], ...]
    settings: tuple[tuple[str, object], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        _check(len(self.p) == self.layers and all(len(row) == self.kv_heads for row in self.p),
               f"p must be {self.layers} x {self.kv_heads} (layers x kv_heads)")
        seen = set()
        for pair in self.outliers:
            _check(len(pair) == 2 and 0 <= pair[0] < self.layers and 0 <= pair[1] < self.kv_heads,
                   f"outlier {list(pair)} is not a (layer, kv_head) of a {self.layers} x {self.kv_heads} model")
            _check(tuple(pair) not in seen, f"outlier {list(pair)} is listed twice")
            seen.add(tuple(pair))

    def to_dict(self) -> dict[str, object]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "model_type": self.model_type,
                "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "p": [list(row) for row in self.p], "outliers": [list(pair) for pair in self.outliers],
                "settings": dict(self.settings)}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        p_rows = ",\n    ".join(json.dumps(list(row)) for row in self.p)     # full precision: exact round trip
        data["p"] = "@P@"           # one layer per line: the file stays readable
        text = json.dumps(data, indent=2).replace('"@P@"', f"[\n    {p_rows}\n  ]")
        path.write_text(text + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_dict(cls, data: object, source: str = "calibration") -> Calibration:
        """Validate a parsed file; ValueError naming ``source`` and the offending key otherwise."""
        try:
            _check(isinstance(data, dict), "the top level must be a JSON object")
            _check(data.get("format") == FORMAT, f"'format' must be {FORMAT!r} (a file of `kvpass calibrate`)")
            _check(data.get("version") == VERSION, f"'version' must be {VERSION}, got {data.get('version')!r}")
            for key in ("layers", "kv_heads", "head_dim"):
                _check(isinstance(data.get(key), int) and data[key] >= 1, f"'{key}' must be an int >= 1")
            for key in ("model", "model_type"):
                _check(isinstance(data.get(key), str), f"'{key}' must be a string")
            p = data.get("p")
            _check(isinstance(p, list) and all(isinstance(row, list) for row in p), "'p' must be a list of lists")
            for row in p:
                for x in row:
                    _check(x is None or (isinstance(x, (int, float)) and 0.0 <= x <= 1.0),
                           f"'p' entries must be numbers in [0, 1] or null, got {x!r}")
            outliers = data.get("outliers")
            _check(isinstance(outliers, list) and all(isinstance(o, list) and len(o) == 2
                                                      and all(isinstance(i, int) for i in o) for o in outliers),
                   "'outliers' must be a list of [layer, kv_head] int pairs")
            settings = data.get("settings", {})
            _check(isinstance(settings, dict), "'settings' must be an object")
            return cls(model=data["model"], model_type=data["model_type"], layers=data["layers"],
                       kv_heads=data["kv_heads"], head_dim=data["head_dim"],
                       p=tuple(tuple(None if x is None else float(x) for x in row) for row in p),
                       outliers=tuple((int(a), int(b)) for a, b in outliers),
                       settings=tuple((str(k), _frozen(v)) for k, v in settings.items()))
        except _Malformed as err:
            raise refuse("calibration.format", got=source, reason=str(err)) from None

    def heads_by_layer(self, sites: Sequence[AttentionSite]) -> dict[int, tuple[int, ...]]:
        """{layer: outlier KV heads, ascending} for the model whose attention sites are ``sites``.
        Raises ValueError when the file was made for a model of another shape."""
        where = f"calibration of {self.model!r} ({self.model_type}, {self.layers} layers x {self.kv_heads} KV heads)"
        if len(sites) != self.layers:
            raise refuse("calibration.model", where=where, reason=f"does not fit a model with {len(sites)} layers")
        for site in sites:
            if (site.n_kv_heads, site.head_dim) != (self.kv_heads, self.head_dim):
                raise refuse("calibration.model", where=f"{where}, head dim {self.head_dim},",
                             reason=f"does not fit layer {site.layer} of this model ({site.n_kv_heads} KV heads, "
                                    f"head dim {site.head_dim})")
        by_layer: dict[int, list[int]] = {}
        for layer, head in self.outliers:
            if sites[layer].window is not None:
                raise refuse("calibration.model", where=where,
                             reason=f"marks KV head {head} of layer {layer} as an outlier, but layer {layer} is a "
                                    "sliding-window layer (never compressed)")
            by_layer.setdefault(layer, []).append(head)
        return {layer: tuple(sorted(heads)) for layer, heads in sorted(by_layer.items())}


class _Malformed(Exception):
    pass


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise _Malformed(message)


def _frozen(value: object) -> object:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((str(k), _frozen(v)) for k, v in value.items())
    return value


def load_calibration(source: str | os.PathLike | Calibration) -> Calibration:
    """A calibration from a JSON file path, or from the name of one shipped with kvpass
    (``"smollm2"`` -> kvpass/calibrations/smollm2.json). A Calibration passes through."""
    if isinstance(source, Calibration):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise refuse("calibration.type", got=source)
    path = Path(source)
    if not path.is_file():
        shipped = SHIPPED_DIR / f"{source}.json"
        if not shipped.is_file():
            names = sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))
            raise refuse("calibration.missing", got=str(source), names=", ".join(names) or "none shipped")
        path = shipped
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise refuse("calibration.format", got=str(path), reason=f"not JSON ({err})") from None
    return Calibration.from_dict(data, source=str(path))


def select_outliers(p: Sequence[Sequence[float | None]], ratio: float = OUTLIER_RATIO,
                    forced_layers: Sequence[int] = ()) -> tuple[tuple[int, int], ...]:
    """The outlier heads of §1.10 step 4 from p [L][Hkv] (None: not eligible): every head of
    ``forced_layers`` first (the Llama-2 layer-0 rule), then the heads with the largest p until
    ceil(ratio * eligible heads) are chosen. Ties go to the lower (layer, head) [OURS]."""
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"outlier ratio must lie in (0, 1), got {ratio}")
    if any(not 0 <= layer < len(p) for layer in forced_layers):
        raise ValueError(f"forced layers {list(forced_layers)} must lie in 0..{len(p) - 1}")
    eligible = [(layer, g) for layer, row in enumerate(p) for g, x in enumerate(row) if x is not None]
    count = math.ceil(ratio * len(eligible))
    chosen = [(layer, g) for layer in forced_layers for g in range(len(p[layer])) if p[layer][g] is not None]
    if len(chosen) != sum(len(p[layer]) for layer in forced_layers):
        raise ValueError(f"forced layers {list(forced_layers)} include a layer that is not calibrated")
    rest = sorted((pair for pair in eligible if pair not in chosen), key=lambda lg: (-p[lg[0]][lg[1]], lg))
    return tuple(chosen + rest[:max(count - len(chosen), 0)])
