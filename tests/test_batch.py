"""Tests of gnnray.batch: the packed MiniBatch format, device moves, and its layers as DGL blocks.

The DGL blocks (``bench.dgl_models``, the tests' oracle) are built only in the tests marked ``dgl``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.batch import Layer, MiniBatch, from_arrow, id_dtype, to_arrow
from gnnray.sampler.sampler import Sampler

SEEDS = np.array([1, 5, 7, 30, 12])


@pytest.fixture(scope="module")
def sampler():
    return Sampler(tiny_graph(), (3, 2))


@pytest.fixture
def mb(sampler) -> MiniBatch:
    return sampler.sample(SEEDS, epoch=5)


@pytest.fixture
def dgl_blocks():
    """``bench.dgl_models.blocks``: layers as DGL blocks (imports DGL: for tests marked ``dgl``)."""
    from bench.dgl_models import blocks

    return blocks


def assert_batches_equal(a: MiniBatch, b: MiniBatch) -> None:
    assert a.epoch == b.epoch
    assert len(a.layers) == len(b.layers)
    assert a.labels.dtype == b.to("cpu").labels.dtype == torch.int64  # what the loss needs, once on the device
    for name in ("seeds", "labels", "input_nodes"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    for la, lb in zip(a.layers, b.layers):
        assert la.num_src == lb.num_src
        assert la.num_dst == lb.num_dst
        assert la.indptr.tolist() == lb.indptr.tolist()
        assert la.indices.tolist() == lb.indices.tolist()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_pack_unpack_round_trip(mb, dtype):
    packed = mb.pack(dtype)
    assert packed.dtype == dtype and packed.ndim == 1
    out = MiniBatch.unpack(torch.from_numpy(packed))
    assert_batches_equal(mb, out)
    assert out.seeds.dtype == out.input_nodes.dtype == out.layers[0].indices.dtype == torch.from_numpy(packed).dtype
    assert out.epoch == 5
    assert len(out.layers) == 2
    assert out.num_seeds == len(SEEDS)
    assert out.x is None


def test_id_dtype_is_int32_while_node_ids_fit():
    assert id_dtype(169_343) == np.int32
    assert id_dtype(2**31 - 1) == np.int32
    assert id_dtype(2**31) == np.int64
    assert id_dtype(5 * 10**9) == np.int64


def test_int64_packing_keeps_ids_beyond_int32(mb):
    big = MiniBatch(mb.seeds + 2**33, mb.labels, mb.input_nodes + 2**33, mb.layers, epoch=1)
    out = MiniBatch.unpack(torch.from_numpy(big.pack(id_dtype(2**34))))
    assert out.seeds.tolist() == (mb.seeds + 2**33).tolist()
    assert out.input_nodes.tolist() == (mb.input_nodes + 2**33).tolist()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_arrow_rows_round_trip(sampler, dtype):
    batches = [sampler.sample(np.array(s), epoch=e) for e, s in enumerate([[1, 5], [7], [30, 12, 3], []])]
    table = to_arrow(batches, np.dtype(dtype))
    assert table.num_rows == len(batches)
    rows = list(from_arrow(table))
    assert len(rows) == len(batches)
    for want, packed in zip(batches, rows):
        assert packed.dtype == dtype
        assert np.array_equal(packed, want.pack(dtype))
        assert_batches_equal(want, MiniBatch.unpack(torch.from_numpy(packed.copy())))


def test_arrow_rows_are_views_of_one_buffer(sampler):
    table = to_arrow([sampler.sample(np.array([1, 2])), sampler.sample(np.array([3]))], np.dtype(np.int32))
    values = table.column("packed").chunk(0).values.to_numpy()
    for packed in from_arrow(table):
        assert np.shares_memory(packed, values)


def test_arrow_rows_of_a_sliced_or_chunked_table(sampler):
    import pyarrow as pa

    batches = [sampler.sample(np.array([i, i + 1]), epoch=i) for i in range(5)]
    table = to_arrow(batches, np.dtype(np.int32))
    # Ray Data hands out slices of blocks and concatenations of them.
    for part, want in [(table.slice(2, 2), batches[2:4]), (table.slice(4), batches[4:]),
                       (pa.concat_tables([table.slice(3, 1), table.slice(0, 2)]), [batches[3]] + batches[:2])]:
        got = [MiniBatch.unpack(torch.from_numpy(p.copy())) for p in from_arrow(part)]
        assert [g.epoch for g in got] == [w.epoch for w in want]
        for g, w in zip(got, want):
            assert_batches_equal(w, g)


def test_unpack_returns_views_into_the_packed_buffer(mb):
    packed = torch.from_numpy(mb.pack(np.int32))
    lo = packed.data_ptr()
    hi = lo + packed.numel() * packed.element_size()
    out = MiniBatch.unpack(packed)
    tensors = [out.seeds, out.input_nodes] + [t for l in out.layers for t in (l.indptr, l.indices)]
    for t in tensors:
        assert t.numel() == 0 or lo <= t.data_ptr() < hi
        assert t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    # A write through the buffer shows in the batch: no copy was made.
    packed[-1] += 1000
    assert int(out.layers[-1].indices[-1]) >= 1000


def test_unpack_rejects_wrong_dtype(mb):
    for dtype in (np.int16, np.float32, np.float64):
        with pytest.raises(ValueError, match="int32 or int64"):
            MiniBatch.unpack(torch.from_numpy(mb.pack().astype(dtype)))


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


def test_layers_chain(mb):
    """Each layer's destinations are the next layer's sources; the last layer's are the seeds."""
    for a, b in zip(mb.layers, mb.layers[1:]):
        assert a.num_dst == b.num_src
    assert mb.layers[-1].num_dst == mb.num_seeds
    assert mb.layers[0].num_src == mb.input_nodes.shape[0]
    for layer in mb.layers:
        assert layer.indptr.shape[0] == layer.num_dst + 1 and int(layer.indptr[-1]) == layer.indices.shape[0]


@pytest.mark.dgl
def test_blocks_match_layers(mb, dgl_blocks):
    blocks = dgl_blocks(mb.layers)
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


@pytest.mark.dgl
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layer_index", [0, 1])
def test_block_message_passing_matches_manual(mb, layer_index, dtype, dgl_blocks):
    import dgl.function as fn

    mb = MiniBatch.unpack(torch.from_numpy(mb.pack(dtype)))  # as a train worker gets it
    layer = mb.layers[layer_index]
    block = dgl_blocks(mb.layers)[layer_index]
    assert block.idtype == torch.from_numpy(np.empty(0, dtype)).dtype
    h = torch.randn(layer.num_src, 3)
    block.srcdata["h"] = h
    block.update_all(fn.copy_u("h", "m"), fn.mean("m", "out"))
    got = block.dstdata["out"]
    block.update_all(fn.copy_u("h", "m"), fn.sum("m", "sum"))
    got_sum = block.dstdata["sum"]
    expected = torch.zeros(layer.num_dst, 3)
    expected_sum = torch.zeros(layer.num_dst, 3)
    for j in range(layer.num_dst):
        nbrs = layer.indices[layer.indptr[j]:layer.indptr[j + 1]].long()
        if len(nbrs):
            expected[j] = h[nbrs].mean(0)
            expected_sum[j] = h[nbrs].sum(0)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_sum, expected_sum)


def hand_made_batch() -> MiniBatch:
    """3 sources, 2 destinations: dst0 <- {src1, src2, src2}, dst1 <- {src0}."""
    layer = Layer(torch.tensor([0, 3, 4]), torch.tensor([1, 2, 2, 0]), 3)
    return MiniBatch(torch.tensor([10, 11]), torch.tensor([1, 0]), torch.tensor([10, 11, 12]), [layer], epoch=2)


def test_hand_made_batch_round_trip():
    mb = hand_made_batch()
    out = MiniBatch.unpack(torch.from_numpy(mb.pack()))
    assert_batches_equal(mb, out)
    assert out.layers[0].indptr.tolist() == [0, 3, 4] and out.layers[0].indices.tolist() == [1, 2, 2, 0]


@pytest.mark.dgl
def test_hand_made_batch_message_passing(dgl_blocks):
    import dgl.function as fn

    out = MiniBatch.unpack(torch.from_numpy(hand_made_batch().pack()))
    block = dgl_blocks(out.layers)[0]
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
    assert out.layers[-1].num_dst == 0


@pytest.mark.dgl
def test_empty_seed_batch_gives_blocks_without_destinations(sampler, dgl_blocks):
    out = MiniBatch.unpack(torch.from_numpy(sampler.sample(np.array([], dtype=np.int64), epoch=3).pack()))
    blocks = dgl_blocks(out.layers)
    assert blocks[-1].num_dst_nodes() == 0


def _wide_batch() -> MiniBatch:
    """A batch whose one layer claims 2**31 sampled edges in its offsets: cheap, no edge is allocated."""
    ids = torch.tensor([0], dtype=torch.int64)
    layer = Layer(torch.tensor([0, 2**31], dtype=torch.int64), torch.empty(0, dtype=torch.int64), 1)
    return MiniBatch(ids, ids, ids, [layer])


def test_pack_refuses_offsets_beyond_int32_instead_of_wrapping():
    from gnnray.errors import ConfigError

    with pytest.raises(ConfigError, match="2,147,483,648 sampled edges.*int32.*--batch-size or --fanouts"):
        _wide_batch().pack(np.int32)
    with pytest.raises(ConfigError, match="int32"):
        to_arrow([_wide_batch()], np.dtype(np.int32))
    assert MiniBatch.unpack(torch.from_numpy(_wide_batch().pack(np.int64))).layers[0].indptr.tolist() == [0, 2**31]


def test_sampler_refuses_a_layer_of_2_31_edges_before_narrowing(monkeypatch):
    from gnnray.errors import ConfigError
    from gnnray.sampler import pick

    from dataclasses import replace

    graph = tiny_graph()
    graph = replace(graph, indices=graph.indices.astype(np.int32))  # as compact_csc stores graphs below 2**31

    def huge(indptr, indices, nodes, fanouts, etype, key, threads):  # the counts of a layer of 2**31 picks
        offsets = np.zeros(nodes.shape[0] + 1, np.int64)
        offsets[-1] = 2**31
        return offsets, np.empty(0, indices.dtype), None

    monkeypatch.setattr(pick, "sample_layer", huge)
    with pytest.raises(ConfigError, match="2,147,483,648 sampled edges"):
        Sampler(graph, (3, 2)).sample(SEEDS)
