"""The models and data of ``jobs.peers``: layer shapes as real networks have them.

- ``mlp``: the digits MLP of the full comparison (64-2048-2048-2048-10 at full size) on the digits
  data of the training jobs (``jobs._data.load_digits``: scikit-learn's copy, nothing
  downloaded).
- ``resnet``: a small ResNet (a stem convolution, three stages of one basic block each,
  widths w, 2w, 4w, strides 1, 2, 2, global average pooling, a linear head) from
  ``torch.nn`` modules, on synthetic images: ten smooth class templates plus noise.
- ``transformer``: token embeddings, learned positions, one
  ``torch.nn.TransformerEncoderLayer`` (attention and a 4x feed-forward), mean pooling
  and a linear head, on synthetic sequences: random tokens among which a few of each
  class's own signal tokens are planted.

The synthetic sets come from a fixed seed, so every rank, configuration and re-run sees
the same samples; they are learnable but not at once (noise decides how fast).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jobs._data import load_digits

MODELS = ("mlp", "resnet", "transformer")
N_CLASSES = 10
DATA_SEED = 1234  # the synthetic sets are fixed: every run is scored on the same test set


@dataclass(frozen=True)
class Sizes:
    """The widths of the three models (``--preset`` gives them, flags override)."""

    mlp_hidden: tuple[int, ...] = (256, 256)
    resnet_width: int = 8
    resnet_image: int = 16
    transformer_width: int = 64
    transformer_seq: int = 16
    transformer_vocab: int = 256


SMALL = Sizes()
FULL = Sizes(
    mlp_hidden=(2048, 2048, 2048),
    resnet_width=64,
    resnet_image=32,
    transformer_width=256,
    transformer_seq=64,
    transformer_vocab=2048,
)


@dataclass(frozen=True)
class Data:
    """Inputs and labels, train and test (float32 images/rows or int64 token ids)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load(name: str, sizes: Sizes) -> Data:
    """Return the data set of model ``name``."""
    if name == "mlp":
        d = load_digits()
        return Data(d.x_train, d.y_train, d.x_test, d.y_test)
    if name == "resnet":
        return _images(sizes.resnet_image)
    if name == "transformer":
        return _sequences(sizes.transformer_seq, sizes.transformer_vocab)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _split(x: np.ndarray, y: np.ndarray, n_test: int) -> Data:
    return Data(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def _images(size: int, n: int = 3072, n_test: int = 512) -> Data:
    """Ten classes of 3 x size x size images: a smooth random template each (bilinear
    upsampling of a 4x4 grid), scaled by a random contrast, plus pixel noise."""
    rng = np.random.default_rng(DATA_SEED)
    coarse = rng.standard_normal((N_CLASSES, 3, 4, 4))
    idx = np.linspace(0, 3, size)
    lo = np.floor(idx).astype(int).clip(0, 2)
    t = idx - lo
    rows = coarse[:, :, lo, :] * (1 - t)[:, None] + coarse[:, :, lo + 1, :] * t[:, None]
    templates = rows[..., lo] * (1 - t) + rows[..., lo + 1] * t
    y = rng.integers(0, N_CLASSES, n)
    contrast = rng.uniform(0.3, 1.0, (n, 1, 1, 1))
    x = templates[y] * contrast + 1.2 * rng.standard_normal((n, 3, size, size))
    return _split(x.astype(np.float32), y.astype(np.int64), n_test)


def _sequences(seq: int, vocab: int, n: int = 4096, n_test: int = 512) -> Data:
    """Sequences of ``seq`` uniform random tokens; each class owns 8 signal tokens, and
    ``seq // 8`` (at least 2) positions of a sample hold signal tokens of its class."""
    rng = np.random.default_rng(DATA_SEED)
    signal = rng.permutation(vocab)[: 4 * N_CLASSES].reshape(N_CLASSES, 4)
    y = rng.integers(0, N_CLASSES, n)
    x = rng.integers(0, vocab, (n, seq))
    planted = max(2, seq // 4)
    for i in range(n):
        pos = rng.choice(seq, planted, replace=False)
        x[i, pos] = rng.choice(signal[y[i]], planted)
    return _split(x.astype(np.int64), y.astype(np.int64), n_test)


def build(name: str, sizes: Sizes, seed: int):
    """Return model ``name`` with weights from ``seed`` alone (the same on every rank).

    The draws run inside ``torch.random.fork_rng`` so the caller's RNG is left as it was.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            return _mlp(sizes.mlp_hidden)
        if name == "resnet":
            return _resnet(sizes.resnet_width)
        if name == "transformer":
            return _transformer(
                sizes.transformer_width, sizes.transformer_seq, sizes.transformer_vocab
            )
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _mlp(hidden: tuple[int, ...]):
    from torch import nn

    widths = (64, *hidden)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], N_CLASSES))


def _resnet(width: int):
    from torch import nn

    class Block(nn.Module):
        """torchvision's BasicBlock: two 3x3 convolutions, a projected shortcut when the
        shape changes."""

        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.shortcut = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))

    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        Block(w, w, 1),
        Block(w, 2 * w, 2),
        Block(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, N_CLASSES),
    )


def _transformer(width: int, seq: int, vocab: int):
    import torch
    from torch import nn

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.position = nn.Parameter(0.02 * torch.randn(seq, width))
            # dropout 0: every configuration sees the same computation; heads of 32
            self.block = nn.TransformerEncoderLayer(
                width, max(1, width // 32), 4 * width, dropout=0.0, batch_first=True
            )
            self.head = nn.Linear(width, N_CLASSES)

        def forward(self, x):
            return self.head(self.block(self.embed(x) + self.position).mean(dim=1))

    return Classifier()


def n_params(model) -> int:
    """Return the number of trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
