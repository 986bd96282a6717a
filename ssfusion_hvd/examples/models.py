"""The evaluation's models and their synthetic inputs (no downloads, random init).

* ``gpt2``: GPT-2 small (124M parameters, 148 gradient tensors, the 38.6M-element tied
  token embedding the largest) built from ``transformers.GPT2Config()``; synthetic token
  sequences, language-model loss.
* ``resnet``: a CIFAR-style ResNet-18 (11.2M parameters, 62 tensors) defined here;
  synthetic 32x32 RGB images, 10 classes.
* ``resnet50``: ResNet-50 for ImageNet (25.6M parameters, 161 tensors, torchvision's
  layout) defined here; synthetic 224x224 RGB images, 1000 classes. A GPU model: a CPU
  iteration takes seconds.
* ``demo``: the default model of ``examples/train.py`` (150k parameters) on 8x8 images.

``build(name, batch, seq_len, seed, rank, device)`` returns the model (on ``device``) and a
``loss(step, module=None)`` closure that draws the step's synthetic batch on ``device``,
deterministically from (seed, rank, step)
and runs it forward through ``module`` (default: the model; a DDP wrapper around it for the
peers, whose gradients are synchronized only when the forward pass goes through it).
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssfusion_hvd.examples.data import DigitsNet

__all__ = ["MODELS", "ResNet18", "ResNet50", "build", "rank_device"]


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (3x3 stem, no max-pool), as commonly trained on CIFAR."""

    def __init__(self, classes: int = 10, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            layers += [_Basic(cin, cout, stride), _Basic(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = 4 * planes
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """ResNet-50 (He et al.) for 224x224 ImageNet inputs, in torchvision's parameter layout
    (``ssfusion_hvd.plan.models``' ``resnet50`` lists the same tensors)."""

    def __init__(self, classes: int = 1000, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        cin, stages = 64, []
        for i, count in enumerate(blocks):
            planes = 64 * 2 ** i
            layer = []
            for b in range(count):
                layer.append(_Bottleneck(cin, planes, 2 if b == 0 and i > 0 else 1))
                cin = 4 * planes
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _gen(seed: int, rank: int, step: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)


def _gpt2(batch: int, seq_len: int, seed: int, rank: int, device: torch.device):
    import transformers

    cfg = transformers.GPT2Config()  # GPT-2 small: 12 layers, 768 wide, 50257 tokens
    model = transformers.GPT2LMHeadModel(cfg).to(device)

    def loss(step: int, module=None) -> torch.Tensor:
        tokens = torch.randint(cfg.vocab_size, (batch, seq_len), generator=_gen(seed, rank, step, device),
                               device=device)
        return (module or model)(input_ids=tokens, labels=tokens).loss
    return model, loss


def _images(model: nn.Module, shape, classes: int, batch: int, seed: int, rank: int,
            device: torch.device):
    model = model.to(device)

    def loss(step: int, module=None) -> torch.Tensor:
        g = _gen(seed, rank, step, device)
        x = torch.rand((batch,) + shape, generator=g, device=device)
        y = torch.randint(classes, (batch,), generator=g, device=device)
        return F.cross_entropy((module or model)(x), y)
    return model, loss


#: name -> (builder(batch, seq_len, seed, rank, device) -> (model, loss(step)), default batch)
MODELS: dict = {
    "gpt2": (_gpt2, 2),
    "resnet": (lambda b, t, s, r, d: _images(ResNet18(), (3, 32, 32), 10, b, s, r, d), 16),
    "resnet50": (lambda b, t, s, r, d: _images(ResNet50(), (3, 224, 224), 1000, b, s, r, d), 32),
    "demo": (lambda b, t, s, r, d: _images(DigitsNet(), (1, 8, 8), 10, b, s, r, d), 32),
}


def rank_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device for ``--device kind``: the CPU, or GPU ``local_rank`` modulo the
    GPUs visible (ranks of one host may share one), made current."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def build(name: str, batch: int = 0, seq_len: int = 64, seed: int = 0, rank: int = 0,
          device="cpu") -> Tuple[nn.Module, Callable[[int], torch.Tensor]]:
    """``(model, loss(step))`` of evaluation model ``name``; ``batch=0`` is its default.
    Parameters are initialized from ``seed`` alone (on the CPU, then moved to ``device``),
    identically on every rank."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    builder, default_batch = MODELS[name]
    torch.manual_seed(seed)
    return builder(batch or default_batch, seq_len, seed, rank, torch.device(device))
