"""What a ``KVPassModel`` keeps of transformers' model conventions (docs/transformers-compat.md): ``forward`` with
a ``CausalLMOutputWithPast`` (``.logits``, ``.loss`` with ``labels``), ``dtype`` / ``device`` / ``config`` /
``generation_config``, the base model's parameters and state dict from the start, ``.to()`` / ``.half()`` /
``.cuda()`` that rebuild the rewrite over a converted copy (the model passed in is never changed), and
``save_pretrained`` / ``from_pretrained`` (the base model's files plus ``kvpass_config.json``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from kvpass.runtime.policy_json import policy_metadata, rebuild_policy, rebuildable
from kvpass.validation import refuse

KVPASS_CONFIG = "kvpass_config.json"
CONFIG_FORMAT = "kvpass-config/1"
# settings of a KVPassModel a rebuild (``.to()``) carries over
_SETTINGS = ("prefill_rows", "reuse_decode_buffers", "free_bytes", "reconstruction_prompt")
# forward() arguments transformers' causal LMs take that kvpass accepts only at their neutral value
_NEUTRAL_FORWARD = {"past_key_values": (None,), "inputs_embeds": (None,), "position_ids": (None,),
                    "cache_position": (None,), "output_attentions": (None, False),
                    "output_hidden_states": (None, False), "use_cache": (None, True, False)}


def converted_copy(model: nn.Module, fn) -> nn.Module | None:
    """``model`` with ``fn`` (what ``nn.Module._apply`` gets from ``.to()``, ``.half()``...) applied to a copy of
    every parameter and buffer, the module tree deep-copied around them (tied weights stay tied); None where ``fn``
    changes no tensor. The model itself is left as it is."""
    memo: dict[int, object] = {}
    changed = False
    with torch.no_grad():
        for _, p in model.named_parameters(remove_duplicate=True):
            new = fn(p)
            changed |= new is not p
            memo[id(p)] = p if new is p else nn.Parameter(new, requires_grad=p.requires_grad)
        for _, b in model.named_buffers(remove_duplicate=True):
            new = fn(b)
            changed |= new is not b
            memo[id(b)] = new
    if not changed:
        return None
    return copy.deepcopy(model, memo)


class TransformersCompat:
    """Mixin of ``KVPassModel`` (which holds ``model``, ``policy``, ``budget``, ``heads`` and the graphs)."""

    main_input_name = "input_ids"

    # ------------------------------------------------------------------ the base model's weights
    def parameters(self, recurse: bool = True):
        """The base model's parameters (the rewritten graphs run on them)."""
        return self.model.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.model.named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        return self.model.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.model.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        """The base model's state dict (its keys and tensors; loadable into the transformers model)."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Copy ``state_dict`` into the base model's tensors in place, the weights the graphs run on (they are
        the model passed to ``kvpass.apply``: it changes too). ``assign=True`` (new tensors the graphs would not
        see) is refused."""
        if assign:
            raise refuse("model.convert", what="load_state_dict(assign=True)",
                         why="the rewritten graphs hold the model's tensors; load with assign=False (a copy in place)")
        return self.model.load_state_dict(state_dict, strict=strict)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the base model's floating-point weights."""
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.get_output_embeddings()

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        if hasattr(self.model, "num_parameters"):
            return self.model.num_parameters(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad or not only_trainable)

    @staticmethod
    def can_generate() -> bool:
        return True

    # ------------------------------------------------------------------ forward
    def _forward_output(self, input_ids, attention_mask, labels, return_dict, logits_to_keep, extra: dict):
        """``forward``'s body: checks, the full-attention prefill graph's logits [B, T, V], the loss."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        for name, value in extra.items():
            if not any(value is neutral for neutral in _NEUTRAL_FORWARD.get(name, ())):
                raise refuse("forward.value", argument=name, name=name,
                             problem=f"={value!r} is not taken by KVPassModel.forward (input_ids, attention_mask, "
                                     "labels, return_dict, logits_to_keep; positions come from attention_mask, there "
                                     "is no transformers cache)")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise refuse("forward.value", argument="logits_to_keep", name="logits_to_keep",
                         problem=f"must be an int >= 0 (0: every position), got {logits_to_keep!r}")
        ids, pad, pos = self._prepare(input_ids, attention_mask, 0)
        if labels is not None:
            labels = _check_labels(labels, ids)
        logits = self._forward_graph()(ids, pos, pad)[0]
        loss = None if labels is None else self._loss(logits, labels)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        return out.to_tuple() if return_dict is False else out

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The base model's causal-LM loss (transformers' ``loss_function``: next-token cross entropy, labels
        -100 ignored, fp32), else the same written out."""
        fn = getattr(self.model, "loss_function", None)
        if callable(fn):
            return fn(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        shift = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                           ignore_index=-100)

    # ------------------------------------------------------------------ .to(), .half(), .cuda()
    def _apply(self, fn, recurse: bool = True):
        """``nn.Module.to`` / ``half`` / ``float`` / ``cuda`` / ``cpu``...: where ``fn`` changes any weight, the
        rewrite is rebuilt, in place, over a converted copy of the base model (``converted_copy``); the model passed
        to ``kvpass.apply`` keeps its weights, dtype and device. Under tensor parallelism refused."""
        if "_model" not in self.__dict__:          # nn.Module's own setup
            return super()._apply(fn, recurse)
        try:
            converted = converted_copy(self.model, fn)
        except (RuntimeError, TypeError, copy.Error) as err:
            raise refuse("model.convert", what="converting the model (.to / .half / .cuda)",
                         why=f"{type(err).__name__}: {err}; convert the transformers model, then kvpass.apply it") from err
        if converted is None:
            return self
        if self.heads.world > 1:
            raise refuse("model.convert", what=".to() / .half() / .cuda() under tensor parallelism",
                         why="each rank holds its shards; place and convert the model before kvpass.apply(..., tp=)")
        self._rebuild(converted)
        return self

    def _rebuild(self, model: nn.Module) -> None:
        """This KVPassModel, rewritten anew over ``model`` with the same policy, budget and options."""
        from kvpass.api import apply

        settings = {k: getattr(self, k) for k in _SETTINGS}
        new = apply(model, policy=self.given_policy, budget=self.budget, prefill_chunk=self.prefill_chunk,
                    **self.apply_options)
        self.release_decode_buffers()
        vars(self).update(vars(new))
        for name, value in settings.items():
            setattr(self, name, value)

    # ------------------------------------------------------------------ save / load
    def kvpass_config(self) -> dict:
        """What ``save_pretrained`` writes to kvpass_config.json (refused for a policy it cannot rebuild)."""
        policy = self.given_policy
        if not rebuildable(policy):
            raise refuse("save.policy", got=repr(policy),
                         why="its policy is not a registered policy of JSON hyperparameters (pass a calibration as "
                             "a path or shipped name), so from_pretrained could not rebuild it")
        return {"format": CONFIG_FORMAT, "policy": policy_metadata(policy), "budget": self.budget,
                "prefill_chunk": self.prefill_chunk, **self.apply_options}

    def save_pretrained(self, save_directory: str | Path, **kwargs) -> None:
        """The base model's ``save_pretrained(save_directory, **kwargs)`` (weights, config, generation config),
        plus ``kvpass_config.json``: policy, budget and apply options; ``kvpass.from_pretrained`` loads both.
        Refused (before writing) under tensor parallelism (the weights are shards) and for a policy it cannot
        rebuild."""
        config = self.kvpass_config()
        if self.heads.world > 1:
            raise refuse("save.policy", got="a tensor-parallel model",
                         why="its parameters are this rank's shards; save the model before kvpass.apply(..., tp=)")
        if not callable(getattr(self.model, "save_pretrained", None)):
            raise refuse("save.policy", got=type(self.model).__name__, why="the base model has no save_pretrained")
        if self.fused_linears and "state_dict" not in kwargs:     # views of fused weights: saved as plain tensors
            kwargs["state_dict"] = {k: v.contiguous().clone() for k, v in self.model.state_dict().items()}
        self.model.save_pretrained(save_directory, **kwargs)
        (Path(save_directory) / KVPASS_CONFIG).write_text(json.dumps(config, indent=1))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, policy=None, budget: float | int | None = None, model_class=None,
                        **model_kwargs):
        """Load a directory ``save_pretrained`` wrote: the transformers model (``model_class``, default
        ``AutoModelForCausalLM``, ``.from_pretrained(path, **model_kwargs)``: dtype, device_map...), then
        ``kvpass.apply`` with the saved policy, budget and options (``policy`` / ``budget`` override them)."""
        from kvpass.api import apply

        config_path = Path(path) / KVPASS_CONFIG
        if not config_path.is_file():
            raise refuse("load.config", got=str(path), why=f"no {KVPASS_CONFIG}")
        try:
            saved = json.loads(config_path.read_text())
            if saved.get("format") != CONFIG_FORMAT:
                raise ValueError(f"format {saved.get('format')!r}, not {CONFIG_FORMAT!r}")
            saved_policy = rebuild_policy(saved["policy"])
        except (ValueError, KeyError, TypeError) as err:
            raise refuse("load.config", got=str(path), why=f"{KVPASS_CONFIG}: {type(err).__name__}: {err}") from err
        if model_class is None:
            from transformers import AutoModelForCausalLM as model_class
        model = model_class.from_pretrained(path, **model_kwargs)
        return apply(model, policy=saved_policy if policy is None else policy,
                     budget=saved["budget"] if budget is None else budget, prefill_chunk=saved.get("prefill_chunk"),
                     fuse_linears=saved.get("fuse_linears"), compile=saved.get("compile"),
                     kv_dtype=saved.get("kv_dtype"))


def _check_labels(labels: object, ids: Tensor) -> Tensor:
    """labels: an integer tensor of input_ids' shape ([B, T], or [T] for one row) on its device."""
    if not isinstance(labels, Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise refuse("forward.value", argument="labels", name="labels",
                     problem=f"must be an integer tensor of input_ids' shape {tuple(ids.shape)} (-100: ignored), got "
                             f"{type(labels).__name__ if not isinstance(labels, Tensor) else labels.dtype}")
    if labels.dim() == 1:
        labels = labels[None]
    if tuple(labels.shape) != tuple(ids.shape):
        raise refuse("forward.value", argument="labels", name="labels",
                     problem=f"must have input_ids' shape {tuple(ids.shape)}, got {tuple(labels.shape)}")
    return labels.to(ids.device).long()
