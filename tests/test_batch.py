"""Tests of gnnray.batch: the packed MiniBatch format, device moves and DGL blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.batch import Layer, MiniBatch
from gnnray.sampling import Sampler

SEEDS = np.array([1, 5, 7, 30, 12])


@pytest.fixture(scope="module")
def sampler():
    return Sampler(tiny_graph(), (3, 2))


@pytest.fixture
def mb(sampler) -> MiniBatch:
    return sampler.sample(SEEDS, epoch=5)


def assert_batches_equal(a: MiniBatch, b: MiniBatch) -> None:
    assert a.epoch == b.epoch
    assert len(a.layers) == len(b.layers)
    for name in ("seeds", "labels", "input_nodes"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert ta.dtype == tb.dtype == torch.int64, name
        assert torch.equal(ta, tb), name
    for la, lb in zip(a.layers, b.layers):
        assert la.num_src == lb.num_src
        assert la.num_dst == lb.num_dst
        assert torch.equal(la.indptr, lb.indptr)
        assert torch.equal(la.indices, lb.indices)


def test_pack_unpack_round_trip(mb):
    packed = mb.pack()
    assert packed.dtype == np.int64 and packed.ndim == 1
    out = MiniBatch.unpack(torch.from_numpy(packed))
    assert_batches_equal(mb, out)
    assert out.epoch == 5
    assert len(out.layers) == 2
    assert out.num_seeds == len(SEEDS)
    assert out.x is None


def test_unpack_returns_views_into_the_packed_buffer(mb):
    packed = torch.from_numpy(mb.pack())
    lo = packed.data_ptr()
    hi = lo + packed.numel() * packed.element_size()
    out = MiniBatch.unpack(packed)
    tensors = [out.seeds, out.labels, out.input_nodes] + [t for l in out.layers for t in (l.indptr, l.indices)]
    for t in tensors:
        assert t.numel() == 0 or lo <= t.data_ptr() < hi
        assert t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    # A write through the buffer shows in the batch: no copy was made.
    packed[-1] += 1000
    assert int(out.layers[-1].indices[-1]) >= 1000


def test_unpack_rejects_wrong_dtype(mb):
    with pytest.raises(ValueError):
        MiniBatch.unpack(torch.from_numpy(mb.pack().astype(np.int32)))
    with pytest.raises(ValueError):
        MiniBatch.unpack(torch.from_numpy(mb.pack().astype(np.float64)))


def test_unpack_rejects_wrong_shape(mb):
    with pytest.raises(ValueError):
        MiniBatch.unpack(torch.from_numpy(mb.pack()[None]))
    with pytest.raises(ValueError):
        MiniBatch.unpack(torch.zeros(3, dtype=torch.int64))


def test_unpack_rejects_wrong_magic(mb):
    packed = mb.pack()
    packed[0] += 1
    with pytest.raises(ValueError, match="magic"):
        MiniBatch.unpack(torch.from_numpy(packed))


def test_unpack_rejects_truncated_body(mb):
    packed = mb.pack()
    body_start = 5 + 3 * len(mb.layers)
    for n in range(body_start, len(packed)):
        with pytest.raises(ValueError):
            MiniBatch.unpack(torch.from_numpy(packed[:n].copy()))


def test_unpack_rejects_truncated_header(mb):
    packed = mb.pack()
    body_start = 5 + 3 * len(mb.layers)
    for n in range(0, body_start):
        with pytest.raises(ValueError):
            MiniBatch.unpack(torch.from_numpy(packed[:n].copy()))


def test_unpack_rejects_trailing_values(mb):
    packed = np.concatenate([mb.pack(), np.array([0, 0], dtype=np.int64)])
    with pytest.raises(ValueError, match="trailing"):
        MiniBatch.unpack(torch.from_numpy(packed))


def test_to_cpu_returns_equal_tensors(mb):
    mb.x = torch.randn(mb.input_nodes.shape[0], 4)
    out = mb.to("cpu")
    assert_batches_equal(mb, out)
    assert torch.equal(out.x, mb.x)
    assert out.seeds.device.type == "cpu"
    assert all(l.indptr.device.type == "cpu" for l in out.layers)


def test_to_keeps_none_features(mb):
    assert mb.to("cpu").x is None


def test_blocks_match_layers(mb):
    blocks = mb.blocks()
    assert len(blocks) == len(mb.layers)
    for block, layer in zip(blocks, mb.layers):
        assert block.is_block
        assert block.num_src_nodes() == layer.num_src
        assert block.num_dst_nodes() == layer.num_dst
        assert block.num_edges() == layer.indices.shape[0]
    # Chained: each block's destinations are the next block's sources.
    for a, b in zip(blocks, blocks[1:]):
        assert a.num_dst_nodes() == b.num_src_nodes()
    assert blocks[-1].num_dst_nodes() == mb.num_seeds


@pytest.mark.parametrize("layer_index", [0, 1])
def test_block_message_passing_matches_manual(mb, layer_index):
    import dgl.function as fn

    layer = mb.layers[layer_index]
    block = mb.blocks()[layer_index]
    h = torch.randn(layer.num_src, 3)
    block.srcdata["h"] = h
    block.update_all(fn.copy_u("h", "m"), fn.mean("m", "out"))
    got = block.dstdata["out"]
    block.update_all(fn.copy_u("h", "m"), fn.sum("m", "sum"))
    got_sum = block.dstdata["sum"]
    expected = torch.zeros(layer.num_dst, 3)
    expected_sum = torch.zeros(layer.num_dst, 3)
    for j in range(layer.num_dst):
        nbrs = layer.indices[layer.indptr[j]:layer.indptr[j + 1]]
        if len(nbrs):
            expected[j] = h[nbrs].mean(0)
            expected_sum[j] = h[nbrs].sum(0)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_sum, expected_sum)


def test_hand_made_batch_round_trip_and_message_passing():
    import dgl.function as fn

    # 3 sources, 2 destinations: dst0 <- {src1, src2, src2}, dst1 <- {src0}
    layer = Layer(torch.tensor([0, 3, 4]), torch.tensor([1, 2, 2, 0]), 3)
    mb = MiniBatch(torch.tensor([10, 11]), torch.tensor([1, 0]), torch.tensor([10, 11, 12]), [layer], epoch=2)
    out = MiniBatch.unpack(torch.from_numpy(mb.pack()))
    assert_batches_equal(mb, out)
    block = out.blocks()[0]
    block.srcdata["h"] = torch.tensor([[1.0], [2.0], [4.0]])
    block.update_all(fn.copy_u("h", "m"), fn.sum("m", "s"))
    assert block.dstdata["s"].flatten().tolist() == [10.0, 1.0]


def test_empty_seed_batch_round_trip(sampler):
    mb = sampler.sample(np.array([], dtype=np.int64), epoch=3)
    assert mb.num_seeds == 0
    out = MiniBatch.unpack(torch.from_numpy(mb.pack()))
    assert_batches_equal(mb, out)
    assert out.num_seeds == 0
    assert out.epoch == 3
    assert len(out.layers) == 2
    blocks = out.blocks()
    assert blocks[-1].num_dst_nodes() == 0
