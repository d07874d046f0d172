"""``OnnxRunner``: greedy generation with onnxruntime over the files ``kvpass.export.onnx`` wrote.

The host loop mirrors ``KVPassModel.generate``: prefill, resolve each row's budgets as the runtime does
(``kvpass.export.budgets.prompt_budgets``: a fraction of its prompt + new tokens, the policy's per-layer split
of its own prompt), compress each compressible layer whose prompt exceeds its budget (else pad it to its
capacity), then per token: compress the layers whose buffers are full, run the decode step, feed ``present.*``
back as ``past.*``. Decisions come from host-side lengths, so every graph is straight-line.

The runtime budgets each row as if it ran alone; the runner runs the rows of one prompt length and one set of
budgets as one batch (without padding), so a left-padded batch gives each row the tokens it gets alone.
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
        self.runtime = self.meta.get("budgets") == "runtime"
        self._policy = None

    # ------------------------------------------------------------------ budgets
    @property
    def policy(self):
        """The exported policy, rebuilt from the metadata (for its per-layer budgets and head capacities)."""
        if self._policy is None:
            from kvpass.export.budgets import rebuild_policy

            self._policy = rebuild_policy(self.meta["policy"])
        return self._policy

    def _row_budgets(self, flat: list[np.ndarray], row: int, total: int):
        """The runtime's ``PromptBudgets`` of batch row ``row`` of a prefill's outputs ``flat`` (the row alone)."""
        import torch

        from kvpass.budget import budget_tokens
        from kvpass.export.budgets import PromptBudgets, prompt_budgets
        from kvpass.export.graphs import from_flat
        from kvpass.validation import refuse

        interval, spec = self.meta["interval"], self.meta["budget"]
        if self.meta["layer_budgets"] == "uniform" and self.meta["head_capacity"] == "budget":
            keep = budget_tokens(spec, total)
            if keep < self.meta["min_budget"]:
                raise refuse("budget.minimum", got=keep, source=f" (from {spec!r} of {total})",
                             policy=self.meta["policy"]["name"], minimum=self.meta["min_budget"])
            n = len(self.layers)
            return PromptBudgets(keep, (keep,) * n, (min(keep + interval, total),) * n, (0,) * n)
        caches, start = [], 0
        for layer in self.layers:
            names = [*ENTRY_FIELDS, *layer["meta"], *layer.get("prefill_state", [])]
            part = [torch.from_numpy(np.ascontiguousarray(x[row: row + 1])) for x in flat[start: start + len(names)]]
            caches.append(from_flat(part, tuple(layer["meta"]), tuple(layer.get("prefill_state", []))))
            start += len(names)
        return prompt_budgets(self.policy, spec, caches, total, interval)

    def _check_budgets(self, got, prompt: int, total: int) -> None:
        """Refuse (rule ``export.budgets``) a row whose runtime budgets the exported graphs cannot run: other than
        the fixed ones, or outside the range the runtime-budget compress graph was traced and checked for."""
        from kvpass.validation import refuse

        if not self.runtime:
            fixed = tuple(layer["budget"] for layer in self.layers)
            # a layer whose entries (at most total - 1) stay within both budgets is never compressed either way
            if any(a != b and total - 1 > min(a, b) for a, b in zip(got.layers, fixed, strict=True)):
                raise refuse("export.budgets", prompt=prompt, total=total, got=list(got.layers),
                             why=f"the export fixed {list(fixed)} (budgets='fixed'); export with budgets='runtime'")
            return
        ranges = self.meta["budget_ranges"]
        for keep, cap, extra in zip(got.layers, got.capacities, got.extras, strict=True):
            inputs = ([prompt] if prompt > keep else []) + ([cap] if total - 1 >= cap - extra else [])
            if not inputs:                          # this layer is never compressed
                continue
            for name, value in (("budget", keep), ("capacity", cap), *(("slots", n) for n in inputs)):
                lo, hi = ranges[name]
                if not lo <= value <= hi:
                    raise refuse("export.budgets", prompt=prompt, total=total, got=list(got.layers),
                                 why=f"the compress graph was traced for {name} in [{lo}, {hi}], not {value}")

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

    def _compress(self, layer: dict, tensors: list[np.ndarray], policy_state: dict[str, np.ndarray], keep: int,
                  capacity: int) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """Run the layer's compress graph to ``keep`` entries in ``capacity`` slots: (cache tensors + slot
        metadata, per-layer state) -> the same. State the policy creates on its first compression starts as
        zeros (its documented default)."""
        sess = self.sessions["compress" if self.runtime else f"compress_{layer['budget']}"]
        names = [i.name for i in sess.get_inputs()]
        b = tensors[0].shape[0]
        seeds = layer.get("state_seed", {})
        state = [policy_state[k] if k in policy_state else
                 np.zeros((b, *seeds[k]["shape"]), dtype=np.dtype(seeds[k]["dtype"])) for k in layer.get("state", [])]
        shape_inputs = [np.empty(keep, np.float32), np.empty(capacity, np.float32)] if self.runtime else []
        outs = sess.run(None, dict(zip(names, shape_inputs + tensors + state, strict=True)))
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

        from kvpass.validation import as_input_ids, check_max_new_tokens, check_token_ids, left_pads, refuse

        def host(x):                   # numpy, lists and tensors alike, as a CPU tensor (its dtype kept: checked)
            return x.cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))

        max_new_tokens = check_max_new_tokens(max_new_tokens)
        ids_t = as_input_ids(host(input_ids) if not isinstance(input_ids, (list, tuple)) else input_ids,
                             torch.device("cpu"), self.meta.get("vocab_size"))
        mask_t, _ = left_pads(None if attention_mask is None else host(attention_mask), ids_t)
        ids, mask = ids_t.numpy(), mask_t.numpy().astype(np.int64)
        pad = (mask == 0).sum(-1).astype(np.int64)
        b, t = ids.shape
        longest = int(t - pad.min())
        if longest + max_new_tokens > self.meta["max_length"]:
            raise refuse("max_new_tokens.context", prompt=longest, got=max_new_tokens,
                         context=f"{self.meta['max_length']} (the exported max_length)")
        eos = check_token_ids("eos_token_id", self.meta.get("eos_token_id") if eos_token_id is None else eos_token_id)
        pads = check_token_ids("pad_token_id", self.meta.get("pad_token_id") if pad_token_id is None else pad_token_id)
        pad_id = pads[0] if pads else (eos[0] if eos else 0)

        by_length: dict[int, list[int]] = {}
        for row in range(b):
            by_length.setdefault(int(t - pad[row]), []).append(row)
        new: dict[int, np.ndarray] = {}
        for n, rows in by_length.items():
            group = ids[rows][:, t - n:]
            outs = self.sessions["prefill"].run(None, {"input_ids": group,
                                                       "position_ids": np.tile(np.arange(n, dtype=np.int64), (len(rows), 1)),
                                                       "pad": np.zeros(len(rows), dtype=np.int64)})
            plans: dict = {}
            for i in range(len(rows)):
                got = self._row_budgets(outs[1:], i, n + max_new_tokens) if self.meta["compresses"] else None
                if got is not None:
                    self._check_budgets(got, n, n + max_new_tokens)
                plans.setdefault(got, []).append(i)
            for got, part in plans.items():
                logits = outs[0][part]
                flat = [x[part] for x in outs[1:]]
                tokens = self._decode(logits, flat, n, n + max_new_tokens, got, max_new_tokens, eos, pad_id)
                for i, tok in zip(part, tokens, strict=True):
                    new[rows[i]] = tok
        steps = max(len(x) for x in new.values())
        out = np.full((b, steps), pad_id, dtype=np.int64)
        for row, tok in new.items():
            out[row, :len(tok)] = tok
        return np.concatenate([ids, out], axis=1)

    def _decode(self, logits: np.ndarray, flat: list[np.ndarray], prompt: int, total: int, got, max_new_tokens: int,
                eos: list[int], pad_id: int) -> np.ndarray:
        """One group of rows (one prompt length, one set of budgets ``got``, None for ``full``) from its prefill's
        outputs to its new tokens [b, n]."""
        states, policy_states, host_len, start = [], [], [], 0
        if got is None:
            budgets = [None] * len(self.layers)
        else:                                   # fixed: the exported budgets (equal to the runtime's where it matters)
            budgets = got.layers if self.runtime else [layer["budget"] for layer in self.layers]
        caps = [self.layers[i]["capacity"] if not self.runtime else got.capacities[i] for i in range(len(self.layers))]
        due_at = [min(c, total) - (got.extras[i] if got is not None else 0) for i, c in enumerate(caps)]
        for i, layer in enumerate(self.layers):
            width, extra = len(ENTRY_FIELDS) + len(layer["meta"]), layer.get("prefill_state", [])
            state = list(flat[start: start + width])
            policy_state = dict(zip(extra, flat[start + width: start + width + len(extra)], strict=True))
            start += width + len(extra)
            length = prompt
            if layer["compressible"] and length > budgets[i]:
                state, policy_state = self._compress(layer, state, policy_state, budgets[i], caps[i])
                length = min(int(state[_LENGTH].max()), budgets[i])
            else:
                state = self._pad_to(state, caps[i], layer["meta"])
            states.append(state)
            policy_states.append(policy_state)
            host_len.append(length)

        decode = self.sessions["decode"]
        in_names = [i.name for i in decode.get_inputs()]
        rows = logits.shape[0]
        pos = np.full((rows, 1), prompt, dtype=np.int64)
        unfinished = np.ones(rows, dtype=bool)
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
                if layer["compressible"] and host_len[i] >= due_at[i]:
                    states[i], policy_states[i] = self._compress(layer, states[i], policy_states[i], budgets[i], caps[i])
                    host_len[i] = min(int(states[i][_LENGTH].max()), budgets[i])
            feed = [tok[:, None], pos] + [x for s in states for x in s]
            outs = decode.run(None, dict(zip(in_names, feed, strict=True)))
            logits, flat, start = outs[0], outs[1:], 0
            for i, layer in enumerate(self.layers):
                width = len(ENTRY_FIELDS) + len(layer["meta"])
                states[i] = list(flat[start: start + width])
                start += width
                host_len[i] += 1
            pos = pos + 1
        return np.stack(tokens, axis=1)
