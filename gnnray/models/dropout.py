"""Dropout on a CPU worker: the keep mask drawn on all of torch's threads, in one pass.

torch's CPU ``bernoulli_`` draws one number per element on one thread (MKL's
vector draw is gone from current torch): on an arxiv batch a SAGE step's two
dropouts took 197 of its 343 ms on torch 2.13, against 16 of 106 ms on torch
2.2.1. Drawing 16-bit uniforms with ``torch.randint`` and comparing them
still cost a quarter of the step on 2 threads (one thread draws; compare,
cast and scale are three more passes). Here a numba kernel writes the scaled
float mask directly, each range of elements on its own thread (7.8 M elements,
an arxiv batch's first hidden layer: 6 ms on one thread): element ``i``
keeps when 16 bits of ``splitmix64(key + i // 4)`` (the sampler's mixer) reach
``p``, so the mask does not depend on the thread count. The key is one
draw of torch's generator, so ``torch.manual_seed`` still fixes every mask.
The keep probability is ``1 - p`` to within 2**-16; CUDA tensors keep torch's
dropout.

After a ReLU (GraphSAGE's and GCN's hidden layers), :func:`relu_dropout` does both in one pass, with the same
mask: ReLU, the mask and its product were five passes over the layer's output forward and two backward, about a
seventh of an arxiv step on 2 threads. Its backward needs no mask: an element's gradient passes (scaled) exactly
where the output is positive.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import nn

from gnnray.sampler.pick import Threads, mix

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LOW16 = np.uint64(0xFFFF)
_S16, _S32, _S48 = np.uint64(16), np.uint64(32), np.uint64(48)


@numba.njit(nogil=True, cache=True)
def _fill_mask(key, threshold, scale, out, lo, hi):
    """``out[4w + k]`` for words ``w`` in ``[lo, hi)``: ``scale`` where 16-bit draw ``k`` of word ``w`` is at
    least ``threshold``, else 0.

    Without a branch (a kept element is as likely as a dropped one, so a branch would be mispredicted half the
    time: 6x slower): ``u + 2**16 - threshold`` reaches ``2**16`` exactly when ``u >= threshold``, so its bit
    16 is the keep bit.
    """
    c = np.uint64(65536) - threshold
    full = min(hi, out.shape[0] // 4)
    for w in range(lo, full):
        z = mix(key + np.uint64(w) * _GOLDEN)
        j = 4 * w
        out[j] = scale * np.float32(((z & _LOW16) + c) >> _S16)
        out[j + 1] = scale * np.float32((((z >> _S16) & _LOW16) + c) >> _S16)
        out[j + 2] = scale * np.float32((((z >> _S32) & _LOW16) + c) >> _S16)
        out[j + 3] = scale * np.float32(((z >> _S48) + c) >> _S16)
    for w in range(max(lo, full), hi):  # the last, partial word
        z = mix(key + np.uint64(w) * _GOLDEN)
        for k in range(out.shape[0] - 4 * w):
            out[4 * w + k] = scale * np.float32((((z >> np.uint64(16 * k)) & _LOW16) + c) >> _S16)


@numba.njit(nogil=True, cache=True)
def _relu_keep(key, threshold, scale, x, out, lo, hi):
    """``out[i] = relu(x[i]) * mask[i]`` for the elements of words ``[lo, hi)``, ``mask`` as :func:`_fill_mask`
    draws it (the same key gives the same mask). ``v > 0`` rather than ``max``: NaN stays NaN, as torch's ReLU.
    Loops index slices from 0, so that numba knows no index is negative and vectorises them (5x faster); full
    words apart from the last, partial one (one loop with ``min(4, ...)`` inside ran 2.5-4x slower)."""
    c = np.uint64(65536) - threshold
    xs, os_ = x[4 * lo:4 * hi], out[4 * lo:4 * hi]
    for w in range(xs.shape[0] // 4):
        z = mix(key + np.uint64(lo + w) * _GOLDEN)
        for k in range(4):
            v = xs[4 * w + k]
            keep = scale * np.float32((((z >> np.uint64(16 * k)) & _LOW16) + c) >> _S16)
            os_[4 * w + k] = v * keep if not v <= 0 else np.float32(0)
    w = xs.shape[0] // 4  # the last, partial word
    if 4 * w < xs.shape[0]:
        z = mix(key + np.uint64(lo + w) * _GOLDEN)
        for k in range(xs.shape[0] - 4 * w):
            v = xs[4 * w + k]
            keep = scale * np.float32((((z >> np.uint64(16 * k)) & _LOW16) + c) >> _S16)
            os_[4 * w + k] = v * keep if not v <= 0 else np.float32(0)


@numba.njit(nogil=True, cache=True)
def _relu_keep_grad(scale, out, grad, res, lo, hi):
    """The gradient of :func:`_relu_keep` for words ``[lo, hi)``: ``grad * scale`` where ``out`` is positive (a
    kept element of positive input), else 0."""
    o, g, r = out[4 * lo:4 * hi], grad[4 * lo:4 * hi], res[4 * lo:4 * hi]
    for i in range(o.shape[0]):
        r[i] = g[i] * scale if o[i] > 0 else np.float32(0)


_pools: dict[int, Threads] = {}


def _pool() -> Threads:
    threads = torch.get_num_threads()
    return _pools.get(threads) or _pools.setdefault(threads, Threads(threads))


def _key() -> np.uint64:
    """One draw of torch's generator: the mask's key, so that ``torch.manual_seed`` fixes every mask."""
    return np.uint64(int(torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64)) & (2**64 - 1))


def keep_mask(n: int, p: float) -> torch.Tensor:
    """``n`` float32 values, each ``1 / (1 - p)`` with probability ``1 - p`` (to 2**-16) and 0 otherwise."""
    out = torch.empty(n, dtype=torch.float32)
    _pool().run(_fill_mask, (n + 3) // 4, _key(), np.uint64(round(p * 65536)), np.float32(1 / (1 - p)), out.numpy())
    return out


class _ReluDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        ctx.scale = np.float32(1 / (1 - p))
        _pool().run(_relu_keep, (x.numel() + 3) // 4, _key(), np.uint64(round(p * 65536)), ctx.scale,
                    x.detach().view(-1).numpy(), out.view(-1).numpy())
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        grad = grad.contiguous()
        res = torch.empty_like(grad)
        _pool().run(_relu_keep_grad, (out.numel() + 3) // 4, ctx.scale, out.view(-1).numpy(),
                    grad.view(-1).numpy(), res.view(-1).numpy())
        return res, None


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose CPU mask comes from :func:`keep_mask`; a float mask, so backward multiplies by it."""

    def _draws_here(self, x: torch.Tensor) -> bool:
        return (self.training and 0 < self.p < 1 and x.device.type == "cpu" and not self.inplace
                and x.dtype == torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._draws_here(x):
            return super().forward(x)
        return x * keep_mask(x.numel(), self.p).view(x.shape)


def relu_dropout(drop: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``drop(torch.relu(x))``, in one pass where ``drop`` is this module's :class:`Dropout` on a CPU tensor in
    training (the same mask for the same seed)."""
    if not (isinstance(drop, Dropout) and drop._draws_here(x)):
        return drop(torch.relu(x))
    return _ReluDropout.apply(x, drop.p)
