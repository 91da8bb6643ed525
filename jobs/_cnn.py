"""A small Conv-BN-ReLU network for the 8x8 digits images (PyTorch, CPU).

``jobs._data.load_digits`` gives flat (n, 64) rows; the model takes them as they come
(or already as (n, 1, 8, 8)) and reshapes them itself.
"""

from __future__ import annotations

IMAGE = 8  # the digits images are 8x8, one channel
CHANNELS = (16, 32)  # conv widths: small enough for several CPU ranks on a few cores
N_CLASSES = 10


def as_images(x):
    """Return a torch tensor or NumPy array of flat 64-pixel rows as (n, 1, 8, 8) images."""
    return x.reshape(-1, 1, IMAGE, IMAGE)


def make_cnn(seed: int):
    """Return the CNN: 2 x [Conv2d 3x3 (padding 1) - BatchNorm2d - ReLU], one MaxPool2d, Linear.

    Input (n, 1, 8, 8) or flat (n, 64) float32; output (n, 10) logits. Shapes:
    (1, 8, 8) -> conv1 (16, 8, 8) -> pool (16, 4, 4) -> conv2 (32, 4, 4) -> fc 512 -> 10.
    The weights come from ``seed`` alone (torch's default init under
    ``torch.manual_seed(seed)``), so every rank and every codec starts from the same
    point; the draws run inside ``torch.random.fork_rng()`` so the caller's RNG state is
    left as it was.

    Raises:
        ImportError: PyTorch is not installed.
    """
    import torch
    from torch import nn

    class _Images(nn.Module):
        # Flat digit rows become images here, so callers can pass load_digits' arrays.
        def forward(self, x):
            return as_images(x)

    c1, c2 = CHANNELS
    # fork_rng restores the global CPU RNG on exit; devices=[] keeps CUDA out of it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(
            _Images(),
            nn.Conv2d(1, c1, 3, padding=1, bias=False),  # BN's bias makes a conv bias redundant
            nn.BatchNorm2d(c1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(c1, c2, 3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(c2 * (IMAGE // 2) ** 2, N_CLASSES),
        )
    return model
