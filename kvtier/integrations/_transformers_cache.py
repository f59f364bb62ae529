"""A ``transformers`` model's KV as kvtier sees it: its attention geometry as a block
layout, the keyword its cache goes under, and a ``DynamicCache``'s layers read and
filled without an extra copy."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvtier.paged import PagedKVLayout

__all__ = ["cache_keyword", "cache_layers", "fill_layer", "paged_layout"]


def paged_layout(
    model_config: Any, dtype: torch.dtype, tokens_per_block: int = 16
) -> PagedKVLayout:
    """A block layout for the attention geometry of a ``transformers`` model config."""
    text = (
        model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    )
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return PagedKVLayout(
        num_layers=text.num_hidden_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        tokens_per_block=tokens_per_block,
    )


def cache_keyword(model: Any) -> str:
    """The keyword ``model(...)`` and ``model.generate(...)`` take the cache under.

    transformers renamed ``past_key_values`` to ``cache`` in its 5.x series and warns
    about the old name; this answers whichever the installed version's model takes.
    """
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def fill_layer(cache: Any, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make layer ``index`` of an empty ``cache`` hold ``keys`` and ``values``.

    ``update`` would copy them once more (it appends to what the layer holds); a plain
    DynamicLayer is handed the tensors as they are instead, as it would hold the result
    of its own first ``update``. Any other kind of layer goes through ``update``.
    """
    cache.update(keys[:, :, :0], values[:, :, :0], index)
    layer = cache.layers[index]
    if type(layer) is DynamicLayer and layer.keys is not None and layer.keys.shape[-2] == 0:
        layer.keys, layer.values = keys, values
    else:
        cache.update(keys, values, index)


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), ``(1, heads, tokens, dim)``, from a DynamicCache."""
    layers = []
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise ValueError(f"layer {i} of the cache is a sliding window: it cannot be stored")
        keys, values = layer.keys, layer.values
        if keys is None or keys.numel() == 0:
            raise ValueError(f"layer {i} of the cache holds no tokens")
        if keys.shape[0] != 1:
            raise ValueError(
                f"the cache holds a batch of {keys.shape[0]} sequences; store takes one"
            )
        layers.append((keys, values))
    return layers
