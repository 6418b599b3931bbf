"""Tests of typed mini-batches and the relational models: edge types through sampling and packing, RGAT and
R-SAGE, their layer-wise inference.

DGL's blocks and modules (the oracle, ``bench.dgl_models``) are imported inside the tests marked ``dgl``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.batch import MiniBatch, id_dtype
from gnnray.config import DataConfig
from gnnray.data.load import load_graph
from gnnray.models.model import RGAT, RSAGE, build_model, relation_patterns
from gnnray.sampler.sampler import Sampler
from gnnray.train.layerwise import full_block


@pytest.fixture(scope="module")
def hetero():
    return load_graph(DataConfig(dataset="synthetic-hetero", synthetic_nodes=400, synthetic_feat_dim=8))


def test_sampled_edge_types_match_the_graph(hetero):
    sampler = Sampler(hetero, (4, 3))
    seeds = hetero.train_idx[:50]
    packed = sampler.sample(seeds).pack(id_dtype(hetero.num_nodes))
    mb = MiniBatch.unpack(torch.from_numpy(packed))
    src = mb.input_nodes.numpy()
    checked = 0
    for layer in mb.layers:
        indptr, indices, etype = layer.indptr.numpy(), layer.indices.numpy(), layer.etype.numpy()
        assert etype.shape == indices.shape
        dst = src[:layer.num_dst]
        for j, v in enumerate(dst.tolist()):
            seg = slice(hetero.indptr[v], hetero.indptr[v + 1])
            available = set(zip(hetero.indices[seg].tolist(), hetero.etype[seg].tolist()))
            for k in range(indptr[j], indptr[j + 1]):
                assert (int(src[indices[k]]), int(etype[k])) in available
                checked += 1
        src = dst
    assert checked > 100


@pytest.mark.dgl
def test_dgl_blocks_carry_the_edge_types(hetero):
    """DGL blocks of the layers (the test oracle's) carry them as edata in edge id order, the CSC order."""
    from bench.dgl_models import blocks as dgl_blocks

    mb = MiniBatch.unpack(torch.from_numpy(Sampler(hetero, (4, 3)).sample(hetero.train_idx[:50]).pack(np.int64)))
    for layer, block in zip(mb.layers, dgl_blocks(mb.layers)):
        u, v, eid = block.edges(form="all", order="eid")
        assert eid.tolist() == list(range(block.num_edges()))
        assert u.tolist() == layer.indices.tolist()
        assert v.tolist() == np.repeat(np.arange(layer.num_dst), np.diff(layer.indptr.numpy())).tolist()
        assert block.edata["etype"].tolist() == layer.etype.tolist()


def test_untyped_batches_pack_no_types():
    g = tiny_graph()
    mb = Sampler(g, (3, 2)).sample(np.array([1, 5, 7]))
    packed = mb.pack(np.int32)
    header = 5 + 3 * len(mb.layers)
    sizes = 2 * mb.num_seeds + len(mb.input_nodes) + sum(l.num_dst + 1 + len(l.indices) for l in mb.layers)
    assert len(packed) == header + sizes
    out = MiniBatch.unpack(torch.from_numpy(packed))
    assert all(l.etype is None for l in out.layers)


@pytest.mark.dgl
def test_dgl_blocks_of_untyped_batches_have_no_types():
    from bench.dgl_models import blocks as dgl_blocks

    out = MiniBatch.unpack(torch.from_numpy(Sampler(tiny_graph(), (3, 2)).sample(np.array([1, 5, 7])).pack(np.int32)))
    assert all("etype" not in b.edata for b in dgl_blocks(out.layers))


def test_typed_pack_round_trip_and_move(hetero):
    mb = Sampler(hetero, (3, 2)).sample(hetero.train_idx[:20], epoch=3)
    out = MiniBatch.unpack(torch.from_numpy(mb.pack(np.int64))).to("cpu")
    for a, b in zip(mb.layers, out.layers):
        assert a.etype.tolist() == b.etype.tolist() and a.indices.tolist() == b.indices.tolist()
    assert out.epoch == 3


def relation_edges(layer, r: int) -> list:
    """Per relation, its (source, destination) edges of ``layer`` in CSC order: what DGL's ``edge_subgraph``
    of the relation keeps (test_relation_patterns_match_edge_subgraph), computed here without it."""
    dst = np.repeat(np.arange(layer.num_dst), np.diff(layer.indptr.numpy()))
    src, etype = layer.indices.numpy(), layer.etype.numpy()
    return [list(zip(src[etype == j].tolist(), dst[etype == j].tolist())) for j in range(r)]


def pattern_edges(layer, r: int) -> list:
    """Per relation, the (source, destination) edges that :func:`relation_patterns` give it, in their order."""
    n, m = layer.num_src, layer.num_dst
    plain, spread = relation_patterns(layer, r)
    assert plain.num_rows == spread.num_rows == r * m and plain.num_cols == n and spread.num_cols == r * n
    assert torch.equal(spread.indices // r, plain.indices)  # column u * r + relation
    rows = np.repeat(np.arange(r * m), np.diff(plain.indptr.numpy()))
    out = []
    for j in range(r):
        mine = rows // m == j
        assert (spread.indices.numpy()[mine] % r == j).all()
        out.append(list(zip(plain.indices.numpy()[mine].tolist(), (rows[mine] % m).tolist())))
    return out


def test_relation_patterns_hold_each_relations_edges(hetero):
    """Rows r * num_dst + v of the relation pattern hold v's in-edges of relation r, in the layer's order."""
    layer = Sampler(hetero, (5,)).sample(hetero.train_idx[:30]).layers[0]
    got = pattern_edges(layer, hetero.num_relations)
    assert got == relation_edges(layer, hetero.num_relations)
    assert sum(map(len, got)) == layer.indices.shape[0] and sum(1 for e in got if e) > 1


@pytest.mark.dgl
def test_relation_patterns_match_edge_subgraph(hetero):
    """Rows r * num_dst + v of the relation pattern hold v's in-edges of relation r, as DGL's edge_subgraph."""
    from bench.dgl_models import block as dgl_block, relation_blocks

    layer = Sampler(hetero, (5,)).sample(hetero.train_idx[:30]).layers[0]
    r, n, m = hetero.num_relations, layer.num_src, layer.num_dst
    got = pattern_edges(layer, r)
    for j, sub in enumerate(relation_blocks(dgl_block(layer), r)):
        assert sub.num_src_nodes() == n and sub.num_dst_nodes() == m
        assert got[j] == list(zip(*[t.tolist() for t in sub.edges(order="eid")]))  # same edges, same order


def _full_blocks(graph, num_layers: int):
    """Layers over all nodes with all in-edges (every node a destination): a full-graph forward."""
    mb = Sampler(graph, (-1,)).sample(np.arange(graph.num_nodes))
    assert mb.input_nodes[:graph.num_nodes].tolist() == list(range(graph.num_nodes))
    assert len(mb.input_nodes) == graph.num_nodes
    return [mb.layers[0]] * num_layers


@pytest.mark.parametrize("name", ["rgat", "rsage"])
def test_layerwise_inference_equals_full_graph_forward(hetero, name):
    torch.manual_seed(0)
    model = build_model(hetero.feat_dim, hetero.num_classes, 2, 8, 0.5, name=name, heads=2,
                        num_relations=hetero.num_relations)
    model.train()  # move BatchNorm's running statistics away from their initial values
    with torch.no_grad():
        model(_full_blocks(hetero, 2), torch.from_numpy(hetero.feat))
    model.eval()
    with torch.no_grad():
        full = model(_full_blocks(hetero, 2), torch.from_numpy(hetero.feat))
    # Layer by layer over chunks of nodes (full-neighbor blocks), as layer-wise inference does.
    h = torch.from_numpy(hetero.feat)
    bounds = np.linspace(0, hetero.num_nodes, 8).astype(int).tolist()
    with torch.no_grad():
        for i in range(model.num_layers):
            parts = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                layer, src = full_block(hetero, a, b)
                parts.append(model.layer(i, layer, h[torch.from_numpy(src)])[:b - a])
            h = torch.cat(parts)
    torch.testing.assert_close(h, full, rtol=1e-4, atol=1e-4)


def test_relation_types_change_the_output(hetero):
    """Relabelling edges to other relations changes RGAT's output: it does read the types."""
    torch.manual_seed(0)
    model = RGAT(hetero.feat_dim, 4, hetero.num_classes, 1, 0.0, 2, hetero.num_relations).eval()
    layer = _full_blocks(hetero, 1)[0]
    x = torch.from_numpy(hetero.feat)
    with torch.no_grad():
        a = model([layer], x)
        b = model([layer._replace(etype=(layer.etype + 1) % hetero.num_relations)], x)
    assert not torch.allclose(a, b)


def test_relational_models_run_on_untyped_graphs_and_others_on_typed(hetero):
    g = tiny_graph()
    for model in (RSAGE(g.feat_dim, 8, g.num_classes, 2, 0.0, 1), RGAT(g.feat_dim, 4, g.num_classes, 2, 0.0, 2, 1)):
        mb = Sampler(g, (3, 2)).sample(np.array([0, 1, 2]))
        out = model.eval()(mb.layers, torch.from_numpy(g.feat[mb.input_nodes.numpy()]))
        assert out.shape == (3, g.num_classes)
    mb = Sampler(hetero, (3, 2)).sample(hetero.train_idx[:10])
    for name in ("sage", "gat", "gcn"):
        model = build_model(hetero.feat_dim, hetero.num_classes, 2, 8, 0.0, name=name, heads=2)
        out = model(mb.layers, torch.from_numpy(hetero.feat[mb.input_nodes.numpy()]))
        assert out.shape == (10, hetero.num_classes)


def test_checkpoint_rebuilds_the_relations(tmp_path, hetero):
    from gnnray.config import JobConfig, ModelConfig, SamplerConfig
    from gnnray.inference.layerwise_task import load_model
    from gnnray.train import checkpoint

    cfg = JobConfig(model=ModelConfig(name="rsage", hidden=8), sampler=SamplerConfig(fanouts=(3, 2)))
    model = build_model(hetero.feat_dim, hetero.num_classes, 2, 8, 0.0, name="rsage",
                        num_relations=hetero.num_relations)
    optimizer = torch.optim.Adam(model.parameters())
    (tmp_path / "ckpt").mkdir()
    checkpoint.save(str(tmp_path / "ckpt"), model, optimizer, {"epoch": 0, "best_val_acc": 0.0})
    loaded, _ = load_model(str(tmp_path / "ckpt"), cfg, hetero.feat_dim, hetero.num_classes)
    assert int(loaded.num_relations) == hetero.num_relations == len(loaded.convs[0])
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.dgl
def test_rsage_computes_what_summed_sageconvs_compute_with_one_self_projection(hetero):
    """R SAGEConvs summed = one self-projection (their W_self and biases added up) + a W_neigh per relation."""
    from dgl.nn import SAGEConv

    from bench.dgl_models import block as dgl_block, relation_blocks

    torch.manual_seed(0)
    layer = Sampler(hetero, (5,)).sample(hetero.train_idx[:40]).layers[0]
    block = dgl_block(layer)
    r = hetero.num_relations
    for a, b in ((hetero.feat_dim, 3), (4, 6)):  # projects before averaging (narrowing) and after
        convs = [SAGEConv(a, b, "mean") for _ in range(r)]
        h = torch.randn(block.num_src_nodes(), a)
        x_dst = h[:block.num_dst_nodes()]
        summed = sum(c(g, (h, x_dst)) for c, g in zip(convs, relation_blocks(block, r)))
        model = RSAGE(a, 8, b, 1, 0.0, r)
        assert len(model.selfs) == 1 and all(lin.bias is None for lin in model.convs[0])
        with torch.no_grad():
            model.selfs[0].weight.copy_(sum(c.fc_self.weight for c in convs))
            model.selfs[0].bias.copy_(sum(c.fc_self.bias for c in convs))
            for lin, c in zip(model.convs[0], convs):
                lin.weight.copy_(c.fc_neigh.weight)
            torch.testing.assert_close(model.layer(0, layer, h), summed, rtol=1e-5, atol=1e-5)


class FormerSAGEConv(torch.nn.Module):
    """The parameters of DGL's ``SAGEConv(a, b, "mean")`` under its names (test_former_sageconv_is_dgls)."""

    def __init__(self, a: int, b: int):
        super().__init__()
        self.fc_self = torch.nn.Linear(a, b)
        self.fc_neigh = torch.nn.Linear(a, b, bias=False)


@pytest.mark.dgl
def test_former_sageconv_is_dgls():
    from dgl.nn import SAGEConv

    theirs, mine = SAGEConv(5, 3, "mean").state_dict(), FormerSAGEConv(5, 3).state_dict()
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}


def test_a_former_rsage_checkpoint_is_refused_naming_the_cause(tmp_path, hetero):
    from gnnray.config import JobConfig, ModelConfig, SamplerConfig
    from gnnray.errors import GnnrayError
    from gnnray.inference.layerwise_task import load_model
    from gnnray.train import checkpoint

    # The former layout: a SAGEConv per relation and layer, under the same names.
    old = RSAGE(hetero.feat_dim, 8, hetero.num_classes, 2, 0.0, hetero.num_relations)
    old.convs = torch.nn.ModuleList(torch.nn.ModuleList(FormerSAGEConv(a, b) for _ in range(hetero.num_relations))
                                    for a, b in ((hetero.feat_dim, 8), (8, hetero.num_classes)))
    del old.selfs
    with pytest.raises(GnnrayError, match="former layout"):
        RSAGE(hetero.feat_dim, 8, hetero.num_classes, 2, 0.0, hetero.num_relations).load_state_dict(old.state_dict())
    cfg = JobConfig(model=ModelConfig(name="rsage", hidden=8), sampler=SamplerConfig(fanouts=(3, 2)))
    (tmp_path / "ckpt").mkdir()
    checkpoint.save(str(tmp_path / "ckpt"), old, torch.optim.Adam(old.parameters()), {"epoch": 0, "best_val_acc": 0.0})
    with pytest.raises(GnnrayError, match="former layout.*train it again"):
        load_model(str(tmp_path / "ckpt"), cfg, hetero.feat_dim, hetero.num_classes)
