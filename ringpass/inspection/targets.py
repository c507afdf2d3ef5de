"""What ``ringpass inspect`` inspects: a user's factory, or a Hugging Face config built on the meta device.

- ``path/to/file.py:factory`` or ``package.module:factory``: a callable returning ``(model, example_inputs)``;
  it gets ``seq_len=`` / ``batch=`` when it accepts them.
- `hf_config_model`: a local Hugging Face ``config.json`` (or the folder holding it) built with random-init
  semantics on the meta device (the class its ``architectures`` names, else a causal LM, else the base model)
  (no weight is allocated or downloaded), with token ids of the asked shape.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect as pyinspect
import os
import sys
from collections.abc import Callable

import torch

from lowering import compat
from lowering.errors import InvalidInputError


def load_factory(target: str) -> Callable:
    """The callable named by ``file.py:name`` or ``module:name``."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise InvalidInputError(f"TARGET {target!r} must be path/to/file.py:factory or package.module:factory.")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise InvalidInputError(f"TARGET {target!r}: no file {where!r}.")
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # the file's neighbours import as they would
        module_name = f"ringpass_target_{os.path.splitext(os.path.basename(where))[0]}"
        spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # registered, as an import would (dataclasses look their module up)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise InvalidInputError(
            f"TARGET {target!r}: {where} has no callable {name!r} (it has {', '.join(found) or 'none'})."
        )
    return factory


def call_factory(factory: Callable, seq_len: int | None, batch: int | None) -> tuple:
    """``factory(seq_len=..., batch=...)`` with the keywords it accepts; checks it returns (model, inputs)."""
    parameters = pyinspect.signature(factory).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    kwargs = {}
    for key, value in (("seq_len", seq_len), ("batch", batch)):
        if value is None:
            continue
        if key not in parameters and not takes_any:
            raise InvalidInputError(
                f"--{key.replace('_', '-')} was given but {factory.__name__}() takes no `{key}` keyword."
            )
        kwargs[key] = value
    result = factory(**kwargs)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise InvalidInputError(
            f"{factory.__name__}() must return (model, example_inputs), got {type(result).__name__}."
        )
    return result


def hf_config_model(
    path: str,
    seq_len: int | None,
    batch: int,
    labels: bool,
    device: str = "meta",
    attention: str = "sdpa",
    dtype: torch.dtype | None = None,
) -> tuple:
    """(model on ``device``, keyword inputs) for a local Hugging Face config: on the meta device no weight is
    allocated; elsewhere the weights are randomly initialised (in ``dtype``, default the config's). The model
    trains when ``labels`` (loss included), else runs in eval; ``use_cache=False`` either way (the ring's
    regime). ``attention``: the attention implementation (``sdpa`` for a class without it: ``eager``)."""
    try:
        import transformers
    except ImportError:
        raise InvalidInputError("--hf-config needs the `transformers` package: pip install transformers") from None
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise InvalidInputError(f"--hf-config {path!r}: no such config file.")
    config_dict, _ = transformers.PretrainedConfig.get_config_dict(config_file)
    if "model_type" not in config_dict:
        raise InvalidInputError(f"--hf-config {path!r} has no `model_type`; it is not a Hugging Face model config.")
    config = transformers.AutoConfig.for_model(**config_dict)
    seq_len = seq_len or getattr(config, "max_position_embeddings", None)
    if not seq_len:
        raise InvalidInputError("--hf-config: the config names no max_position_embeddings; give --seq-len.")
    model_class = getattr(transformers, (config.architectures or [""])[0], None) or _auto_class(config, labels)
    if attention == "sdpa" and not compat.supports_sdpa(model_class):
        attention = "eager"  # the class's own attention code, which the ring rewrites too (docs/models.md)
    compat.set_attention_implementation(config, attention)
    with torch.device(device):
        model = compat.model_from_config(model_class, config, **({"dtype": dtype} if dtype is not None else {}))
    model.train(labels)
    if labels and hasattr(model, "loss_type"):
        model.loss_type = "ForCausalLM"  # GPT-2's default loss property logs, which breaks the graph
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    inputs = {"input_ids": ids}
    if "use_cache" in pyinspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    if labels:
        inputs["labels"] = torch.zeros_like(ids)  # a tensor of its own, as a user's batch has
    return model, inputs


def _auto_class(config, labels: bool) -> type:
    """The class ``AutoModelForCausalLM`` builds for ``config``; an encoder (without ``labels``): ``AutoModel``'s."""
    import transformers

    try:
        return compat.auto_model_class(config, transformers.AutoModelForCausalLM)
    except KeyError:  # not a causal LM (an encoder): the base model
        if labels:
            raise InvalidInputError(f"--labels: {config.model_type} has no causal-LM head to take labels.") from None
        return compat.auto_model_class(config, transformers.AutoModel)
