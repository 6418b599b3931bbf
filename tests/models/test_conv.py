"""The torch convolutions (gnnray/models/conv.py) against DGL's modules, the oracle: same weights, same blocks,
same outputs and gradients within 1e-5; and the former DGL-module models' checkpoints load into the new ones.

The comparisons need DGL (marked ``dgl``: DGL's modules and ``bench.dgl_models`` are imported inside them);
the checks of the torch modules alone run everywhere.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from gnnray.batch import Layer
from gnnray.models.conv import Csr, GATConv, GraphConv, SAGEConv, segment_softmax
from gnnray.models.model import build_model

TOL = dict(rtol=1e-5, atol=1e-5)


def random_layer(num_src: int, num_dst: int, fanout: int, dtype=torch.int64, self_loops: bool = False,
                 num_relations: int = 0, seed: int = 0) -> Layer:
    """A CSC block with 0..fanout in-edges per destination (some have none), optionally typed."""
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, fanout + 1, (num_dst,), generator=g)
    if num_dst:
        deg[::3] = 0  # destinations without in-edges
    nbrs = [torch.randint(0, max(num_src, 1), (int(d),), generator=g) for d in deg]
    if self_loops:
        nbrs = [torch.cat([torch.tensor([v]), n]) for v, n in enumerate(nbrs)]
        deg = torch.tensor([len(n) for n in nbrs], dtype=torch.int64)
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(deg, 0)
    indices = torch.cat(nbrs) if nbrs else torch.zeros(0, dtype=torch.int64)
    etype = None
    if num_relations:  # the last relation has no edges
        etype = torch.randint(0, max(num_relations - 1, 1), indices.shape, generator=g).to(dtype)
    return Layer(indptr.to(dtype), indices.to(dtype), num_src, etype)


def run(fn, x: torch.Tensor, params, weight: torch.Tensor = None):
    """Output, input gradient and parameter gradients of ``fn(x)`` under the loss ``sum(out * weight)``."""
    x = x.clone().requires_grad_()
    out = fn(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) if weight is None else weight
    for p in params.values():
        p.grad = None
    (out * weight).sum().backward()
    return out.detach(), x.grad, {k: p.grad.clone() for k, p in params.items()}


def assert_same(ours, theirs):
    out, gx, gp = ours
    ref, rgx, rgp = theirs
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(gx, rgx, **TOL)
    assert gp.keys() == rgp.keys()
    for k in gp:
        torch.testing.assert_close(gp[k], rgp[k], **TOL, msg=lambda m: f"{k}: {m}")


def compare(mine: torch.nn.Module, theirs: torch.nn.Module, layer: Layer, in_feats: int, **dgl_kwargs):
    from bench.dgl_models import block as dgl_block

    mine.load_state_dict(theirs.state_dict())  # DGL's names and shapes: loads as it is
    x = torch.randn(layer.num_src, in_feats, generator=torch.Generator().manual_seed(2))
    block = dgl_block(layer)
    assert_same(run(lambda h: mine(layer, h), x, dict(mine.named_parameters())),
                run(lambda h: theirs(block, h, **dgl_kwargs), x, dict(theirs.named_parameters())))


LAYERS = {
    "int64": dict(num_src=60, num_dst=25, fanout=6),
    "int32": dict(num_src=60, num_dst=25, fanout=6, dtype=torch.int32),
    "self-loops": dict(num_src=40, num_dst=40, fanout=4, self_loops=True),
    "typed": dict(num_src=50, num_dst=20, fanout=5, num_relations=3),
    "no-edges": dict(num_src=30, num_dst=10, fanout=0),
    "no-destinations": dict(num_src=12, num_dst=0, fanout=3),
    "empty": dict(num_src=0, num_dst=0, fanout=3),
}


@pytest.mark.dgl
@pytest.mark.parametrize("case", LAYERS)
@pytest.mark.parametrize("in_feats, out_feats", [(16, 5), (5, 16)])  # both orders of projecting and averaging
def test_sageconv_equals_dgl(case, in_feats, out_feats):
    from dgl.nn import SAGEConv as DGLSAGEConv

    torch.manual_seed(0)
    compare(SAGEConv(in_feats, out_feats), DGLSAGEConv(in_feats, out_feats, "mean"), random_layer(**LAYERS[case]),
            in_feats)


@pytest.mark.dgl
@pytest.mark.parametrize("case", LAYERS)
@pytest.mark.parametrize("norm", ["right", "both"])
@pytest.mark.parametrize("in_feats, out_feats", [(16, 5), (5, 16)])
def test_graphconv_equals_dgl(case, norm, in_feats, out_feats):
    from dgl.nn import GraphConv as DGLGraphConv

    torch.manual_seed(0)
    compare(GraphConv(in_feats, out_feats, norm=norm),
            DGLGraphConv(in_feats, out_feats, norm=norm, allow_zero_in_degree=True), random_layer(**LAYERS[case]),
            in_feats)


@pytest.mark.dgl
@pytest.mark.parametrize("case", LAYERS)
@pytest.mark.parametrize("heads", [1, 3])
def test_gatconv_equals_dgl(case, heads):
    from dgl.nn import GATConv as DGLGATConv

    torch.manual_seed(0)
    layer = random_layer(**LAYERS[case])
    theirs = DGLGATConv(7, 4, heads, allow_zero_in_degree=True)
    torch.nn.init.normal_(theirs.bias)  # DGL starts it at 0: make "bias only" visible
    compare(GATConv(7, 4, heads), theirs, layer, 7)


@pytest.mark.parametrize("case", LAYERS)
@pytest.mark.parametrize("heads", [1, 3])
def test_gatconv_gives_destinations_without_in_edges_the_bias_only(case, heads):
    torch.manual_seed(0)
    layer = random_layer(**LAYERS[case])
    mine = GATConv(7, 4, heads)
    torch.nn.init.normal_(mine.bias)  # it starts at 0, as DGL's: make "bias only" visible
    lonely = (layer.indptr[1:] == layer.indptr[:-1]).nonzero().flatten()
    with torch.no_grad():
        out = mine(layer, torch.randn(layer.num_src, 7))
    assert out.shape == (layer.num_dst, heads, 4)
    torch.testing.assert_close(out[lonely], mine.bias.view(1, heads, 4).expand(len(lonely), -1, -1))
    others = torch.ones(layer.num_dst, dtype=torch.bool)
    others[lonely] = False
    if others.any():  # and the others more than it
        assert not torch.allclose(out[others], mine.bias.view(1, heads, 4).expand(int(others.sum()), -1, -1))


def test_segment_softmax_sums_to_one_per_destination():
    layer = random_layer(40, 15, 6)
    csr = Csr.of(layer)
    a = segment_softmax(csr, torch.randn(csr.nnz, 2) * 30)
    sums = torch.zeros(15, 2).index_add(0, csr.rows(), a)
    has_edges = (csr.degrees() > 0).unsqueeze(1).expand(-1, 2)
    torch.testing.assert_close(sums[has_edges], torch.ones(int(has_edges.sum())))
    assert torch.isfinite(a).all()


MODEL_CASES = [("sage", 0), ("gcn", 0), ("gat", 0), ("rgat", 0), ("rgat", 4)]


def _layers(num_relations: int, dtype=torch.int64) -> list:
    """Two chained layers: 70 sources -> 30 -> 12 seeds."""
    return [random_layer(70, 30, 5, dtype, num_relations=num_relations, seed=3),
            random_layer(30, 12, 4, dtype, num_relations=num_relations, seed=4)]


@pytest.mark.dgl
@pytest.mark.parametrize("name, num_relations", MODEL_CASES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_models_equal_the_former_dgl_models(name, num_relations, dtype):
    """The whole model (activations, heads, skips, BatchNorm in training mode) against the DGL-module model."""
    from bench.dgl_models import DGLModel

    torch.manual_seed(0)
    new = build_model(9, 4, 2, 6, 0.0, name=name, heads=3, num_relations=max(num_relations, 1))
    old = DGLModel(new)
    old.load_state_dict(new.state_dict())
    layers = _layers(num_relations, dtype)
    x = torch.randn(70, 9)
    ours = run(lambda h: new(layers, h), x, dict(new.named_parameters()))
    theirs = run(lambda h: old(layers, h), x, dict(old.named_parameters()))  # RGAT's skips, norms, mlp: shared
    assert_same(ours, theirs)


@pytest.mark.dgl
@pytest.mark.parametrize("name, num_relations", MODEL_CASES)
def test_a_checkpoint_of_the_former_dgl_model_loads_unchanged(tmp_path, name, num_relations):
    """A state dict saved from the DGL-module model (gnnray before issue 26) loads and gives its outputs."""
    from bench.dgl_models import DGLModel

    torch.manual_seed(0)
    shape = build_model(9, 4, 2, 6, 0.5, name=name, heads=3, num_relations=max(num_relations, 1))
    old = DGLModel(shape)
    for p in old.parameters():  # weights that differ from any fresh model's
        torch.nn.init.normal_(p)
    torch.save(old.state_dict(), tmp_path / "old.pt")
    torch.manual_seed(1)
    new = build_model(9, 4, 2, 6, 0.5, name=name, heads=3, num_relations=max(num_relations, 1))
    assert new.load_state_dict(torch.load(tmp_path / "old.pt")) is not None  # strict: every key maps
    layers, x = _layers(num_relations), torch.randn(70, 9)
    with torch.no_grad():
        torch.testing.assert_close(new.eval()(layers, x), old.eval()(layers, x), **TOL)


@pytest.mark.parametrize("name", ["sage", "gcn", "gat", "rgat", "rsage"])
def test_models_take_empty_layers(name):
    """A chunk without destinations (layer-wise inference's empty slice) gives no rows of the right width."""
    model = build_model(9, 4, 1, 6, 0.0, name=name, heads=2).eval()
    empty = Layer(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 0)
    with torch.no_grad():
        assert model([empty], torch.zeros(0, 9)).shape == (0, 4)


NO_DGL_SCRIPT = """
import sys


class Poison:
    \"\"\"First on the import path: any import of dgl (even one caught) is recorded and fails.\"\"\"

    tried = []

    def find_spec(self, name, path=None, target=None):
        if name == "dgl" or name.startswith("dgl."):
            Poison.tried.append(name)
            raise ImportError(f"{name} is poisoned in this test")
        return None


sys.meta_path.insert(0, Poison())
import torch

from gnnray.batch import Layer
import gnnray.models.model as m

for name in m.MODELS:
    model = m.build_model(3, 2, 1, 4, 0.0, name=name, heads=2)
    layer = Layer(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), 2, torch.tensor([0, 0]))  # BatchNorm: 2 rows
    model([layer], torch.randn(2, 3)).sum().backward()
assert not Poison.tried and "dgl" not in sys.modules, f"dgl imported: {Poison.tried}"
print("no dgl")
"""


def test_the_models_import_no_dgl():
    """Every built-in model builds, computes and backpropagates in a process where any DGL import fails (and is
    recorded, should something catch the failure): here beside DGL as well as without it."""
    proc = subprocess.run([sys.executable, "-c", NO_DGL_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["no", "dgl"], proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("p", [0.5, 0.1, 0.9])
def test_cpu_dropout_keeps_one_minus_p_and_scales_as_torchs(p):
    """gnnray's CPU dropout: each element kept with probability 1 - p (binomial bounds at 6 sigma), kept ones
    scaled by 1 / (1 - p), the gradient through the same mask, the mask fixed by torch's seed, identity in eval."""
    from gnnray.models.dropout import Dropout

    drop = Dropout(p).train()
    x = torch.rand(300, 1000) + 1.0  # no zeros: a zero output means dropped
    torch.manual_seed(3)
    y = drop(x.requires_grad_())
    kept = y != 0
    n, k = kept.numel(), int(kept.sum())
    assert abs(k - n * (1 - p)) < 6 * (n * p * (1 - p)) ** 0.5, (k, n)
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / (1 - p))
    torch.manual_seed(3)
    assert torch.equal(drop(x.detach()) != 0, kept)  # the same seed, the same mask
    assert not torch.equal(drop(x.detach()) != 0, kept)  # the generator moved on: another mask
    assert torch.equal(drop.eval()(x.detach()), x.detach())


def test_cpu_dropout_picks_positions_uniformly():
    """Every position is dropped about as often (a column bias would show here), over 200 draws of 16 x 64."""
    from gnnray.models.dropout import Dropout

    torch.manual_seed(0)
    drop, x = Dropout(0.5).train(), torch.ones(16, 64)
    counts = sum((drop(x) == 0).float() for _ in range(200))
    stat = float(((counts - 100) ** 2 / 50).sum())  # chi-square, 1024 cells of Binomial(200, 1/2)
    assert stat < 1024 + 6 * (2 * 1024) ** 0.5, stat


def test_cpu_dropout_mask_is_the_same_on_any_thread_count():
    """Each thread draws its own range of the mask from the element's position: 1 and 2 threads (and an odd
    length, whose last word is cut) give one mask for one seed."""
    from gnnray.models.dropout import keep_mask

    before = torch.get_num_threads()
    masks = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            masks.append(keep_mask(100_003, 0.3))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(masks[0], masks[1])
    values = masks[0].unique().tolist()
    assert len(values) == 2 and values[0] == 0 and values[1] == pytest.approx(1 / 0.7)


def test_layers_project_before_averaging_only_where_it_costs_less(monkeypatch):
    """Sampled blocks have several sources per destination: arxiv's last layer (256 -> 40 over 6,419 sources for
    1,024 destinations) averages first, a full graph's projects first when it narrows; either order gives the
    same outputs and gradients."""
    import gnnray.models.conv as conv

    last = Layer(torch.arange(1025) * 6, torch.zeros(6144, dtype=torch.int64), 6419)
    assert not conv.project_first(Csr.of(last), 6419, 256, 40)
    full = Layer(torch.arange(101) * 6, torch.zeros(600, dtype=torch.int64), 100)
    assert conv.project_first(Csr.of(full), 100, 256, 40) and not conv.project_first(Csr.of(full), 100, 40, 256)
    layer = random_layer(num_src=60, num_dst=25, fanout=6)
    x = torch.randn(60, 16, generator=torch.Generator().manual_seed(2))
    for module in (SAGEConv(16, 5), GraphConv(16, 5)):
        runs = []
        for first in (True, False):
            monkeypatch.setattr(conv, "project_first", lambda *args, first=first: first)
            runs.append(run(lambda h: module(layer, h), x, dict(module.named_parameters())))
        assert_same(*runs)


def test_relu_dropout_is_dropout_after_relu_in_one_pass():
    """``relu_dropout``: the same outputs and gradients as ``Dropout(relu(x))`` for the same seed (the same mask),
    NaN kept and negatives zero as torch's ReLU (a NaN's gradient is 0 here), plain ReLU in evaluation."""
    from gnnray.models.dropout import Dropout, relu_dropout

    drop = Dropout(0.3).train()
    x = torch.randn(301, 70)  # an odd length: the last word of draws is cut
    x[0, :3] = torch.tensor([float("nan"), -0.0, 0.0])
    weight = torch.randn(x.shape)
    torch.manual_seed(4)
    want = run(lambda h: drop(torch.relu(h)), x, {}, weight)
    torch.manual_seed(4)
    got = run(lambda h: relu_dropout(drop, h), x, {}, weight)
    torch.testing.assert_close(got[0], want[0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(got[1][1:], want[1][1:], rtol=0, atol=0)
    torch.testing.assert_close(got[1][0, 1:], want[1][0, 1:], rtol=0, atol=0)
    assert (got[0][x < 0] == 0).all() and 0.6 < float((got[0][x > 0] != 0).float().mean()) < 0.8
    assert torch.equal(relu_dropout(drop.eval(), x[1:]), torch.relu(x[1:]))
