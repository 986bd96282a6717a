"""Gradient tensor lists of real models, in backward order (reverse of forward order).

ResNets are written out here (torchvision's layout: conv weights without bias, each
followed by a BatchNorm weight and bias). Transformer models are instantiated from
``transformers`` configs on the meta device: parameter shapes only, no weights, no
downloads. Tied parameters (GPT-2's ``lm_head`` and ``wte``) count once, as they do in
``model.parameters()``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

__all__ = ["MODELS", "model_tensors", "resnet_tensors"]

Tensors = list[tuple[str, int]]


def resnet_tensors(blocks: tuple[int, int, int, int], num_classes: int = 1000) -> Tensors:
    """Bottleneck ResNet (He et al.) parameters in forward order, torchvision names."""
    out: Tensors = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    inplanes = 64
    for stage, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        for b in range(count):
            p = f"layer{stage}.{b}."
            out += [
                (p + "conv1.weight", planes * inplanes), (p + "bn1.weight", planes), (p + "bn1.bias", planes),
                (p + "conv2.weight", planes * planes * 9), (p + "bn2.weight", planes), (p + "bn2.bias", planes),
                (p + "conv3.weight", planes * 4 * planes), (p + "bn3.weight", planes * 4), (p + "bn3.bias", planes * 4),
            ]
            if b == 0:  # projection shortcut
                out += [(p + "downsample.0.weight", planes * 4 * inplanes),
                        (p + "downsample.1.weight", planes * 4), (p + "downsample.1.bias", planes * 4)]
            inplanes = planes * 4
    return out + [("fc.weight", num_classes * inplanes), ("fc.bias", num_classes)]


def _hf(model_cls: str, config_cls: str, **config) -> Callable[[], Tensors]:
    def build() -> Tensors:
        import torch
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        with torch.device("meta"):
            model = getattr(transformers, model_cls)(cfg)
        return [(name, p.numel()) for name, p in model.named_parameters()]
    return build


#: name -> builder of the forward-order ``(name, numel)`` list.
MODELS: dict[str, Callable[[], Tensors]] = {
    "resnet50": lambda: resnet_tensors((3, 4, 6, 3)),
    "resnet152": lambda: resnet_tensors((3, 8, 36, 3)),
    "gpt2": _hf("GPT2LMHeadModel", "GPT2Config"),
    "gpt2-large": _hf("GPT2LMHeadModel", "GPT2Config", n_embd=1280, n_layer=36, n_head=20),
    "bert-base": _hf("BertForQuestionAnswering", "BertConfig"),
    "bert-large": _hf("BertForQuestionAnswering", "BertConfig", hidden_size=1024,
                      num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "vit-large": _hf("ViTForImageClassification", "ViTConfig", hidden_size=1024,
                     num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                     num_labels=1000),
}


@lru_cache(maxsize=None)
def model_tensors(name: str) -> tuple[tuple[str, int], ...]:
    """``(parameter name, numel)`` of model ``name`` in backward order."""
    try:
        build = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
    return tuple(reversed(build()))
