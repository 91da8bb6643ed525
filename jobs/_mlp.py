"""A ReLU MLP with softmax cross-entropy in NumPy, with hand-written backprop."""

from __future__ import annotations

import numpy as np


def init_mlp(sizes: list[int], seed: int) -> dict[str, np.ndarray]:
    """Return float32 parameters ``fc{i}.weight`` (in, out) and ``fc{i}.bias`` (out,).

    Weights are He-normal (std sqrt(2 / fan_in)), biases zero; the same seed gives
    the same parameters on every rank and for every codec.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True), start=1):
        w = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
        params[f"fc{i}.weight"] = w.astype(np.float32)
        params[f"fc{i}.bias"] = np.zeros(fan_out, dtype=np.float32)
    return params


def _layers(params: dict[str, np.ndarray]) -> int:
    return len(params) // 2


def logits(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Return the (n, classes) logits of inputs ``x`` (n, features)."""
    h = x
    n = _layers(params)
    for i in range(1, n + 1):
        h = h @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"]
        if i < n:
            h = np.maximum(h, 0.0)
    return h


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def loss(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Return the mean cross-entropy of ``params`` on (x, y), in float64."""
    if len(y) == 0:
        return 0.0
    logp = _log_softmax(logits(params, x).astype(np.float64))
    return float(-logp[np.arange(len(y)), y].mean())


def accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Return the fraction of samples whose largest logit is the label."""
    return float((logits(params, x).argmax(axis=1) == y).mean())


def loss_and_grads(
    params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, scale: float = 1.0
) -> tuple[float, dict[str, np.ndarray]]:
    """Return the mean cross-entropy on (x, y) and ``scale`` times its gradients.

    Args:
        params: as from ``init_mlp``.
        x: float32 inputs (n, features), n >= 1.
        y: int labels (n,).
        scale: multiplies the gradients (a rank's weight in the global batch).

    Returns:
        (loss, grads): grads has the keys and shapes of ``params``, float32.
    """
    n_layers = _layers(params)
    acts = [x]
    h = x
    for i in range(1, n_layers + 1):
        h = h @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"]
        if i < n_layers:
            h = np.maximum(h, 0.0)
        acts.append(h)
    z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=1, keepdims=True)
    n = len(y)
    rows = np.arange(n)
    value = float(-np.log(np.maximum(p[rows, y], 1e-30)).mean()) + 0.0  # never -0.0
    # d(mean CE)/d(logits) = (softmax - onehot) / n
    delta = p
    delta[rows, y] -= 1.0
    delta *= np.float32(scale / n)
    grads = {}
    for i in range(n_layers, 0, -1):
        grads[f"fc{i}.weight"] = acts[i - 1].T @ delta
        grads[f"fc{i}.bias"] = delta.sum(axis=0)
        if i > 1:
            delta = (delta @ params[f"fc{i}.weight"].T) * (acts[i - 1] > 0)
    return value, {k: grads[k].astype(np.float32, copy=False) for k in params}
