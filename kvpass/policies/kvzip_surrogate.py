"""KVzip's reconstruction scores predicted from each entry's own key and value (docs/policies.md §6.13, "predicted"):
a per-(layer, KV head) linear model, fitted once per model by ``kvpass calibrate kvzip``, so a context is scored
with no pass beyond its prefill (in the spirit of KVzap, which fits a surrogate of KVzip's scores on hidden states).

For entry t of KV head g in layer l, with its post-RoPE key k and value v [D]:

    x_t = [ v_t ,  log(1 + k_t[i]^2 + k_t[i + D/2]^2) for i < D/2 ,  1 ]          (3D/2 + 1 features)
    log score_t ~ x_t . w[l, g]

The key enters through the energies of its rotary pairs (i, i + D/2), which RoPE rotates but does not change, so
the features do not depend on the entry's position. ``fit`` solves ridge regression, (X^T X + lambda I) w = X^T y,
in float64 per (layer, head), on log(KVzip score + 1e-6) of calibration text.

File format (JSON): {"format": "kvzip-surrogate/1", "model": {...shape}, "features": FEATURES, "ridge": lambda,
"text": what it was fitted on, "layers": {"<layer>": [[w_0 .. w_F-1] per KV head]}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

FORMAT = "kvzip-surrogate/1"
FEATURES = "value, log1p of the key's rotary-pair energies, 1"
SHIPPED = Path(__file__).resolve().parents[1] / "calibrations"
EPS = 1e-6


def features(k: Tensor, v: Tensor) -> Tensor:
    """k, v: [..., T, D] -> [..., T, 3D/2 + 1] fp32 (module docstring)."""
    pairs = k.float().unflatten(-1, (2, -1))                       # [..., T, 2, D/2]: rotate_half's pairs
    energy = (pairs ** 2).sum(-2).log1p()
    return torch.cat([v.float(), energy, torch.ones_like(energy[..., :1])], dim=-1)


def model_shape(model) -> dict:
    """What a surrogate must match: the model type, layers, KV heads and head size."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"model_type": cfg.model_type, "layers": cfg.num_hidden_layers, "kv_heads": heads, "head_dim": dim}


@dataclass(frozen=True)
class KVzipSurrogate:
    """Per layer, the weights [Hkv, F] of the linear model (module docstring)."""

    weights: dict[int, Tensor]
    shape: dict
    text: str = ""
    ridge: float = 1.0

    def predict(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """k, v: [B, Hkv, T, D] -> predicted scores [B, Hkv, T] fp32 (exp of the linear model: > 0)."""
        w = self.weights[layer].to(k.device)                         # [Hkv, F]
        return torch.einsum("bhtf,hf->bht", features(k, v), w).exp()

    @classmethod
    def fit(cls, samples: dict[int, list[tuple[Tensor, Tensor, Tensor]]], shape: dict, ridge: float = 1.0,
            text: str = "") -> KVzipSurrogate:
        """``samples``: per layer, (k, v [Hkv, T, D], KVzip scores [Hkv, T]) of calibration sequences."""
        weights = {}
        for layer, items in samples.items():
            x = torch.cat([features(k, v) for k, v, _ in items], dim=1).double()         # [Hkv, N, F]
            y = torch.cat([torch.log(s.double() + EPS) for _, _, s in items], dim=1)     # [Hkv, N]
            gram = x.transpose(1, 2) @ x + ridge * torch.eye(x.shape[-1], dtype=x.dtype)
            weights[layer] = torch.linalg.solve(gram, x.transpose(1, 2) @ y[..., None])[..., 0].float()
        return cls(weights, shape, text, ridge)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        body = {"format": FORMAT, "model": self.shape, "features": FEATURES, "ridge": self.ridge, "text": self.text,
                "layers": {str(la): [[round(float(x), 7) for x in row] for row in w.tolist()]
                           for la, w in sorted(self.weights.items())}}
        path.write_text(json.dumps(body, indent=0) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, name_or_path: str | Path) -> KVzipSurrogate:
        """A surrogate file, or the name of one shipped in kvpass/calibrations (``kvzip-<name>.json``)."""
        from kvpass.validation import refuse

        path = Path(name_or_path)
        if not path.is_file():
            path = SHIPPED / f"kvzip-{name_or_path}.json"
        if not path.is_file():
            raise refuse("kvzip.surrogate", got=str(name_or_path), names=", ".join(shipped_names()) or "none")
        body = json.loads(path.read_text(encoding="utf-8"))
        if body.get("format") != FORMAT:
            raise refuse("file.format", name="KVzip surrogate", got=str(path), reason=f"format is not {FORMAT}")
        weights = {int(la): torch.tensor(rows, dtype=torch.float32) for la, rows in body["layers"].items()}
        return cls(weights, body["model"], body.get("text", ""), body.get("ridge", 1.0))

    def check(self, model) -> None:
        """Refuse a surrogate fitted on a model of another shape."""
        from kvpass.validation import refuse

        if model_shape(model) != self.shape:
            raise refuse("kvzip.surrogate_model", got=str(self.shape), model=str(model_shape(model)))


def shipped_names() -> list[str]:
    return sorted(p.stem.removeprefix("kvzip-") for p in SHIPPED.glob("kvzip-*.json"))


def shipped_for(model) -> str | None:
    """The name of the one shipped surrogate fitted on a model of ``model``'s shape, or None."""
    shape = model_shape(model)
    found = [n for n in shipped_names() if KVzipSurrogate.load(n).shape == shape]
    return found[0] if len(found) == 1 else None
