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


_pools: dict[int, Threads] = {}


def keep_mask(n: int, p: float) -> torch.Tensor:
    """``n`` float32 values, each ``1 / (1 - p)`` with probability ``1 - p`` (to 2**-16) and 0 otherwise."""
    threads = torch.get_num_threads()
    pool = _pools.get(threads) or _pools.setdefault(threads, Threads(threads))
    key = int(torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64)) & (2**64 - 1)
    out = torch.empty(n, dtype=torch.float32)
    pool.run(_fill_mask, (n + 3) // 4, np.uint64(key), np.uint64(round(p * 65536)), np.float32(1 / (1 - p)),
             out.numpy())
    return out


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose CPU mask comes from :func:`keep_mask`; a float mask, so backward multiplies by it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not self.training or self.p == 0 or self.p == 1 or x.device.type != "cpu" or self.inplace
                or x.dtype != torch.float32):
            return super().forward(x)
        return x * keep_mask(x.numel(), self.p).view(x.shape)
