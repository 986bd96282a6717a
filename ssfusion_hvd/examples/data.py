"""The default model and data: scikit-learn's bundled handwritten digits (no download).

1,797 8x8 grey images of 10 digits (UCI optical digits test set, shipped inside
scikit-learn). A fixed stratified split holds out 20 % for testing; the training part is
sharded by rank with equal shard sizes, so every rank runs the same number of steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Split:
    x: torch.Tensor  # (N, 1, 8, 8) float32 in [0, 1]
    y: torch.Tensor  # (N,) int64


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """(train, test) splits of the digits data set, identical on every rank."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=test_fraction,
                                          random_state=seed, stratify=d.target)
    as_split = lambda a, b: Split(torch.from_numpy(a), torch.from_numpy(b).long())  # noqa: E731
    return as_split(xtr, ytr), as_split(xte, yte)


def shard(split: Split, rank: int, size: int) -> Split:
    """Rank's equal-sized shard (the remainder is dropped so all ranks step alike)."""
    per = len(split.y) // size
    sel = slice(rank * per, (rank + 1) * per)
    return Split(split.x[sel], split.y[sel])


class DigitsNet(nn.Module):
    """A small CNN: two conv layers and two linear layers (~150k parameters), a mix of
    small tensors (biases, the first conv) and large ones (the first linear layer)."""

    def __init__(self, width: int = 32, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class DigitsMLP(nn.Module):
    """A plain MLP on the flattened 8x8 image: ``widths`` hidden layers with ReLU, then the
    10 classes (the accuracy suite's MLPs, ``examples/train.py --task mlp|mlp_wide|mlp_deep``)."""

    def __init__(self, widths=(256, 256), classes: int = 10):
        super().__init__()
        dims = [64, *widths]
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(dims[-1], classes))

    def forward(self, x):
        return self.net(x.flatten(1))


class DigitsGRU(nn.Module):
    """A GRU reading the image row by row (8 steps of 8 pixels), the last hidden state
    classified: the accuracy suite's recurrent model (``--task gru``)."""

    def __init__(self, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.rnn = nn.GRU(8, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.rnn(x.reshape(x.shape[0], 8, 8))
        return self.head(out[:, -1])


#: the image models of ``examples/train.py``: task -> constructor
DIGITS_MODELS = {
    "digits": DigitsNet,
    "mlp": lambda: DigitsMLP((256, 256)),
    "mlp_wide": lambda: DigitsMLP((1024,)),
    "mlp_deep": lambda: DigitsMLP((128, 128, 128, 128)),
    "gru": DigitsGRU,
}
