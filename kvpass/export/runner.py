"""``OnnxRunner``: greedy generation with onnxruntime over the files ``kvpass.export.onnx`` wrote.

The host loop mirrors ``KVPassModel.generate``: prefill, compress each compressible layer whose
prompt exceeds its budget (else pad it to its capacity), then per token: compress the layers whose
buffers are full, run the decode step, feed ``present.*`` back as ``past.*``. Decisions come from
host-side lengths, so every graph is straight-line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvpass.cache import EMPTY_SLOT, ENTRY_FIELDS
from kvpass.export.onnx_export import METADATA

_LENGTH = ENTRY_FIELDS.index("length")


class OnnxRunner:
    """Load an export directory and generate greedily.

    out_dir: the directory ``kvpass.export.onnx`` wrote. providers: onnxruntime execution providers
    (default CPU)."""

    def __init__(self, out_dir: str | Path, providers: list[str] | None = None) -> None:
        import onnxruntime as ort

        self.dir = Path(out_dir)
        meta_path = self.dir / METADATA
        if not meta_path.exists():
            from kvpass.errors import InvalidValue

            raise InvalidValue(f"out_dir {str(self.dir)!r} has no {METADATA}; export with kvpass.export.onnx first",
                               "out_dir")
        self.meta = json.loads(meta_path.read_text())
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        providers = providers or ["CPUExecutionProvider"]
        self.sessions = {key: ort.InferenceSession(str(self.dir / f["path"]), opts, providers=providers)
                         for key, f in self.meta["files"].items()}
        self.layers = self.meta["layers"]

    # ------------------------------------------------------------------ state helpers
    @staticmethod
    def _pad_to(state: list[np.ndarray], capacity: int, meta: list[str]) -> list[np.ndarray]:
        """Append empty slots (``kvpass.cache.EMPTY_SLOT``, slot metadata 0) along axis 2 to every per-slot
        tensor (not the lengths)."""
        fills = [EMPTY_SLOT.get(f) for f in ENTRY_FIELDS] + [0.0] * len(meta)
        out = []
        for t, fill in zip(state, fills, strict=True):
            if fill is None or t.shape[2] == capacity:
                out.append(t)
                continue
            if t.shape[2] > capacity:
                raise ValueError(f"cache of {t.shape[2]} slots does not fit a capacity of {capacity}")
            shape = list(t.shape)
            shape[2] = capacity - t.shape[2]
            out.append(np.concatenate([t, np.full(shape, fill, dtype=t.dtype)], axis=2))
        return out

    def _compress(self, layer: dict, tensors: list[np.ndarray], policy_state: dict[str, np.ndarray]
                  ) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """Run the layer's compress graph: (cache tensors + slot metadata, per-layer state) -> the same.
        State the policy creates on its first compression starts as zeros (its documented default)."""
        sess = self.sessions[f"compress_{layer['budget']}"]
        names = [i.name for i in sess.get_inputs()]
        b = tensors[0].shape[0]
        seeds = layer.get("state_seed", {})
        state = [policy_state[k] if k in policy_state else
                 np.zeros((b, *seeds[k]["shape"]), dtype=np.dtype(seeds[k]["dtype"])) for k in layer.get("state", [])]
        outs = sess.run(None, dict(zip(names, tensors + state, strict=True)))
        width = len(tensors)
        return list(outs[:width]), dict(zip(layer.get("state", []), outs[width:], strict=True))

    # ------------------------------------------------------------------ generate
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 20,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> np.ndarray:
        """Greedy generation. input_ids: [B, T] int (numpy or torch); attention_mask: [B, T] 0/1 with left
        padding. eos / pad ids default to the exported model's generation config, as in
        ``KVPassModel.generate``. Returns sequences [B, T + new] int64 (rows that finished early are filled
        with the pad id; generation stops when every row has finished)."""
        import torch

        from kvpass.validation import as_input_ids, check_max_new_tokens, left_pads, refuse

        def host(x):                   # numpy, lists and tensors alike, as a CPU tensor (its dtype kept: checked)
            return x.cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))

        max_new_tokens = check_max_new_tokens(max_new_tokens)
        ids_t = as_input_ids(host(input_ids), torch.device("cpu"), self.meta.get("vocab_size"))
        mask_t, _ = left_pads(None if attention_mask is None else host(attention_mask), ids_t)
        ids, mask = ids_t.numpy(), mask_t.numpy().astype(np.int64)
        pad = (mask == 0).sum(-1).astype(np.int64)
        b, t = ids.shape
        longest = int(t - pad.min())
        if longest + max_new_tokens > self.meta["max_length"]:
            raise refuse("max_new_tokens.context", prompt=longest, got=max_new_tokens,
                         context=f"{self.meta['max_length']} (the exported max_length)")
        pos = np.clip(np.cumsum(mask, -1) - 1, 0, None).astype(np.int64)
        if eos_token_id is None:
            eos_token_id = self.meta.get("eos_token_id")
        if pad_token_id is None:
            pad_token_id = self.meta.get("pad_token_id")
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        pad_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)

        outs = self.sessions["prefill"].run(None, {"input_ids": ids, "position_ids": pos, "pad": pad})
        logits, flat = outs[0], outs[1:]
        states, policy_states, host_len, start = [], [], [], 0
        for layer in self.layers:
            width, extra = len(ENTRY_FIELDS) + len(layer["meta"]), layer.get("prefill_state", [])
            state = list(flat[start: start + width])
            policy_state = dict(zip(extra, flat[start + width: start + width + len(extra)], strict=True))
            start += width + len(extra)
            length = longest
            if layer["compressible"] and length > layer["budget"]:
                state, policy_state = self._compress(layer, state, policy_state)
                length = int(state[_LENGTH].max())
            else:
                state = self._pad_to(state, layer["capacity"], layer["meta"])
            states.append(state)
            policy_states.append(policy_state)
            host_len.append(length)

        decode = self.sessions["decode"]
        in_names = [i.name for i in decode.get_inputs()]
        pos = pos[:, -1:] + 1
        unfinished = np.ones(b, dtype=bool)
        tokens = []
        for step in range(max_new_tokens):
            tok = logits[:, -1].astype(np.float32).argmax(-1).astype(np.int64)
            tok = np.where(unfinished, tok, pad_id)
            tokens.append(tok)
            if eos:
                unfinished &= ~np.isin(tok, eos)
                if not unfinished.any():
                    break
            if step == max_new_tokens - 1:
                break
            for i, layer in enumerate(self.layers):
                if layer["compressible"] and host_len[i] >= layer["capacity"]:
                    states[i], policy_states[i] = self._compress(layer, states[i], policy_states[i])
                    host_len[i] = int(states[i][_LENGTH].max())
            feed = [tok[:, None], pos] + [x for s in states for x in s]
            outs = decode.run(None, dict(zip(in_names, feed, strict=True)))
            logits, flat, start = outs[0], outs[1:], 0
            for i, layer in enumerate(self.layers):
                width = len(ENTRY_FIELDS) + len(layer["meta"])
                states[i] = list(flat[start: start + width])
                start += width
                host_len[i] += 1
            pos = pos + 1
        return np.concatenate([ids, np.stack(tokens, axis=1)], axis=1)
