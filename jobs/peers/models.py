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
- ``lm``: a causal transformer language model (GPT's layout, small): token embeddings
  tied with the output projection, learned positions, ``lm_layers`` pre-LayerNorm
  ``torch.nn.TransformerEncoderLayer`` blocks under a causal mask, a final LayerNorm;
  trained on next-token prediction (logits ``[batch, seq, vocab]`` against targets
  ``[batch, seq]``) and scored by held-out loss (``METRICS``) over a synthetic language:
  sequences of a random order-1 Markov chain over ``lm_vocab`` tokens whose every token
  has a few likely successors (each row of the transition matrix a Dirichlet draw of
  total concentration ``LM_CONCENTRATION``), started from its stationary distribution.
  Its entropy floor (``Data.floor``: the expected per-token cross-entropy of the true
  chain, the least any model's held-out loss can be in expectation) is exact, ~1.25
  nats at 64 tokens, against the unigram entropy (``Data.unigram``) of ~3.8.

The synthetic sets come from a fixed seed, so every rank, configuration and re-run sees
the same samples; they are learnable but not at once (noise decides how fast).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jobs._data import load_digits

MODELS = ("mlp", "resnet", "transformer", "lm")
N_CLASSES = 10
DATA_SEED = 1234  # the synthetic sets are fixed: every run is scored on the same test set
#: The lm's chain: each row of its transition matrix is Dirichlet(LM_CONCENTRATION / vocab)
#: over the vocabulary: a few likely successors per token (~5 above 1 % at 64 tokens).
LM_CONCENTRATION = 1.5


@dataclass(frozen=True)
class Metric:
    """How a model's test split scores it: ``name`` (the tables' and plots' words),
    ``short`` (column heads), ``higher`` (whether higher is better) and ``tolerance``
    (in its units: a reference has plateaued when its last half's best evaluation beats
    its first half's by at most this, and a run that reached the target and then ended
    worse than it by more than this "fell")."""

    name: str
    short: str
    higher: bool
    tolerance: float

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` is at least as good as ``target``."""
        return value >= target if self.higher else value <= target

    def best(self, values) -> float:
        return max(values) if self.higher else min(values)

    def gain(self, before: float, after: float) -> float:
        """How much better ``after`` is than ``before`` (negative: worse)."""
        return after - before if self.higher else before - after

    def target(self, value: float) -> str:
        """A target value as a column head names it: an accuracy bare, as the tables
        always showed it, another metric by its name."""
        return f"{value:.3f}" if self == ACCURACY else f"{self.name} {value:.3f}"

    @property
    def moving(self) -> str:
        """What a run still improving does."""
        return "rising" if self.higher else "falling"

    @property
    def worse(self) -> str:
        """What a run getting worse does."""
        return "fell" if self.higher else "rose"


ACCURACY = Metric("test accuracy", "acc", True, 0.01)  # ~4 of the digits' 360 test samples
#: the lm's: mean next-token cross-entropy on the test split, in nats. Its tolerance is
#: wider than accuracy's: the cosine's decay alone takes 0.02-0.03 nats off the float32
#: run's loss in its last half, however many steps (0.05 nats: under 2 % of the way from
#: the untrained log(64) = 4.16 to the floor).
LOSS = Metric("held-out loss", "loss", False, 0.05)
METRICS = {"mlp": ACCURACY, "resnet": ACCURACY, "transformer": ACCURACY, "lm": LOSS}
#: each model's optimizer unless --optimizer says otherwise
OPTIMIZERS = {"mlp": "sgd", "resnet": "sgd", "transformer": "sgd", "lm": "adamw"}


@dataclass(frozen=True)
class Sizes:
    """The widths of the models (``--preset`` gives them, flags override)."""

    mlp_hidden: tuple[int, ...] = (256, 256)
    resnet_width: int = 8
    resnet_image: int = 16
    transformer_width: int = 64
    transformer_seq: int = 16
    transformer_vocab: int = 256
    lm_width: int = 64
    lm_layers: int = 2
    lm_seq: int = 48
    lm_vocab: int = 64


SMALL = Sizes()
FULL = Sizes(
    mlp_hidden=(2048, 2048, 2048),
    resnet_width=64,
    resnet_image=32,
    transformer_width=256,
    transformer_seq=64,
    transformer_vocab=2048,
    lm_width=256,
    lm_layers=4,
    lm_seq=64,
    lm_vocab=256,
)


@dataclass(frozen=True)
class Data:
    """Inputs and labels, train and test (float32 images/rows or int64 token ids; the lm's
    labels are the next tokens, one per input token). The lm's language also gives
    ``floor``, its entropy per token in nats (the true chain's expected next-token
    cross-entropy: no model's held-out loss is below it in expectation), and
    ``unigram``, the entropy of its token frequencies (a model that ignores the
    context's best); None for the other models."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    floor: float | None = None
    unigram: float | None = None


def load(name: str, sizes: Sizes) -> Data:
    """Return the data set of model ``name``."""
    if name == "mlp":
        d = load_digits()
        return Data(d.x_train, d.y_train, d.x_test, d.y_test)
    if name == "resnet":
        return _images(sizes.resnet_image)
    if name == "transformer":
        return _sequences(sizes.transformer_seq, sizes.transformer_vocab)
    if name == "lm":
        return _language(sizes.lm_seq, sizes.lm_vocab)
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


def _entropy(p: np.ndarray) -> np.ndarray:
    """Entropy in nats along the last axis (0 log 0 = 0)."""
    logs = np.log(np.where(p > 0, p, 1.0))
    return -(p * logs).sum(axis=-1)


def chain(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The lm's language: (its transition matrix, ``[vocab, vocab]``, row ``a`` the
    distribution of the token after ``a``; its stationary distribution)."""
    rng = np.random.default_rng(DATA_SEED)
    p = rng.dirichlet(np.full(vocab, LM_CONCENTRATION / vocab), size=vocab)
    values, vectors = np.linalg.eig(p.T)
    pi = np.abs(np.real(vectors[:, np.argmin(np.abs(values - 1))]))
    return p, pi / pi.sum()


def _language(seq: int, vocab: int, n: int = 8192, n_test: int = 512) -> Data:
    """``n`` sequences of ``seq + 1`` tokens of ``chain(vocab)``, each started from the
    stationary distribution (so every position's token is distributed as it, and the
    floor is exact at every position); inputs the first ``seq``, labels the last."""
    p, pi = chain(vocab)
    rng = np.random.default_rng(DATA_SEED + 1)
    cum = np.cumsum(p, axis=1)
    tokens = np.empty((n, seq + 1), dtype=np.int64)
    tokens[:, 0] = np.minimum(np.searchsorted(np.cumsum(pi), rng.random(n)), vocab - 1)
    for t in range(seq):
        u = rng.random((n, 1))
        tokens[:, t + 1] = np.minimum((cum[tokens[:, t]] < u).sum(axis=1), vocab - 1)
    floor, unigram = float(pi @ _entropy(p)), float(_entropy(pi))
    x, y = tokens[:, :-1], tokens[:, 1:]
    return Data(x[n_test:], y[n_test:], x[:n_test], y[:n_test], floor=floor, unigram=unigram)


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
        if name == "lm":
            return _lm(sizes.lm_width, sizes.lm_layers, sizes.lm_seq, sizes.lm_vocab)
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


def _lm(width: int, layers: int, seq: int, vocab: int):
    import torch
    from torch import nn

    class LM(nn.Module):
        """Logits ``[batch, seq, vocab]`` of the next token at every position, each from
        the tokens up to it. The blocks are top-level children (``block0``, ...), so that
        FSDP gives each its own unit; the tied embedding and head share one parameter,
        which FSDP leaves to the root's unit."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's: tied logits start small
            self.position = nn.Parameter(0.02 * torch.randn(seq, width))
            self.layers = layers
            for i in range(layers):  # dropout 0 as the transformer's; heads of 32
                block = nn.TransformerEncoderLayer(
                    width,
                    max(1, width // 32),
                    4 * width,
                    dropout=0.0,
                    batch_first=True,
                    norm_first=True,
                )
                self.add_module(f"block{i}", block)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            n = x.shape[1]
            mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
            h = self.embed(x) + self.position[:n]
            for i in range(self.layers):
                h = getattr(self, f"block{i}")(h, src_mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return LM()


def n_params(model) -> int:
    """Return the number of trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
