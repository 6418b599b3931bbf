"""``--dataset synthetic``: a learnable graph generated in memory, the same for the same seed."""

from __future__ import annotations

import numpy as np

from gnnray.data.feature_source import SyntheticRows
from gnnray.data.graph import Graph, GraphParts


def make_synthetic(num_nodes: int, num_classes: int, feat_dim: int, avg_degree: int, seed: int) -> Graph:
    """Build a learnable undirected graph, the same for the same arguments.

    Features are a class centroid plus noise, so features alone classify
    poorly; about 80% of a node's neighbors share its class, so averaging over
    neighbors helps a lot. Degrees are skewed: one end of every edge is drawn
    with Zipf-like popularity. The split is a random 60/20/20 train/valid/test.
    """
    return synthetic_parts(num_nodes, num_classes, feat_dim, avg_degree, seed).build()


def synthetic_parts(n: int, c: int, d: int, avg_degree: int, seed: int,
                     homophily: float = 0.8, zipf: float = 0.8) -> GraphParts:
    rng = np.random.default_rng(seed)
    label = rng.integers(0, c, size=n, dtype=np.int64)
    # Centroids of norm 1.5 in unit noise: roughly half the nodes are classified
    # right from their own features, most from the mean over their neighbors.
    centroids = rng.standard_normal((c, d), dtype=np.float32) * np.float32(1.5 / np.sqrt(d))
    # Generated where they are needed, the same rows for any range (one table or --feature-shards).
    feat = SyntheticRows(seed, centroids, n)

    # Each undirected edge joins a node (in turn) to a popular one, drawn from the
    # first node's class with probability `homophily`: inverse-CDF sampling
    # over the nodes sorted by class, popularity as cumulative weight.
    m = n * avg_degree // 2
    a = np.arange(m) % n  # every node gets its share of edges: none is isolated
    weight = (rng.permutation(n) + 1.0) ** -zipf
    order = np.argsort(label, kind="stable")
    cum = np.cumsum(weight[order])
    start = np.searchsorted(label[order], np.arange(c + 1))
    cum_before = np.concatenate([[0.0], cum])[start]
    cls = np.where(rng.random(m) < homophily, label[a], rng.integers(0, c, size=m))
    u = cum_before[cls] + rng.random(m) * (cum_before[cls + 1] - cum_before[cls])
    b = order[np.minimum(np.searchsorted(cum, u, side="right"), start[cls + 1] - 1)]
    keep = a != b  # one direction of each edge; the reverse is added by default (reverse_default)

    perm = rng.permutation(n)
    n_train, n_valid = int(0.6 * n), int(0.2 * n)
    splits = {"train": np.sort(perm[:n_train]), "valid": np.sort(perm[n_train:n_train + n_valid]),
              "test": np.sort(perm[n_train + n_valid:])}
    return GraphParts(f"synthetic-{n}", n, c, a[keep], b[keep], feat, label, splits, reverse_default=True)



# The relations of synthetic-hetero, in code order.
HETERO_RELATIONS = (("paper", "cites", "paper"), ("author", "writes", "paper"), ("paper", "distracts", "paper"))


def synthetic_hetero_parts(n: int, c: int, d: int, avg_degree: int, seed: int) -> GraphParts:
    """``--dataset synthetic-hetero``: papers and authors, where the relation of an edge matters.

    ``n`` papers (the labelled target type, features as in
    :func:`synthetic_parts`) and ``n // 2`` authors without features (filled
    at load with the mean of their papers). Each paper is cited by about a
    quarter of ``avg_degree`` papers of its class, written by two authors
    mostly of its class, and ``distracts`` the rest: papers of one decoy
    class drawn per paper. A type-blind mean mixes in more decoy neighbors
    than neighbors of the paper's class, and which decoy class varies per
    paper, so ignoring types misleads; a relational model can weigh
    ``cites`` and ``writes`` and discount ``distracts``.
    """
    rng = np.random.default_rng(seed)
    num_authors = max(1, n // 2)
    label = rng.integers(0, c, size=n, dtype=np.int64)
    centroids = rng.standard_normal((c, d), dtype=np.float32) * np.float32(1.5 / np.sqrt(d))
    feat = np.zeros((n + num_authors, d), dtype=np.float32)
    feat[:n] = centroids[label] + rng.standard_normal((n, d), dtype=np.float32)
    topic = rng.integers(0, c, size=num_authors, dtype=np.int64)

    def member(of: np.ndarray, cls: np.ndarray) -> np.ndarray:
        """A uniformly drawn node whose class (``of``) is ``cls``, for each entry (a class may not be empty)."""
        order = np.argsort(of, kind="stable")
        start = np.searchsorted(of[order], np.arange(c + 1))
        size = start[cls + 1] - start[cls]
        cls = np.where(size > 0, cls, of[order[0]])  # a class without members: fall back to one that has some
        size = start[cls + 1] - start[cls]
        return order[start[cls] + (rng.random(cls.size) * size).astype(np.int64)]

    k_cites = max(1, avg_degree // 4)
    k_decoy = max(1, avg_degree - k_cites)
    cited = np.repeat(np.arange(n), k_cites)
    citing = member(label, np.where(rng.random(cited.size) < 0.9, label[cited], rng.integers(0, c, cited.size)))
    written = np.repeat(np.arange(n), 2)
    author = member(topic, np.where(rng.random(written.size) < 0.8, label[written],
                                    rng.integers(0, c, written.size))) + n
    decoy = (label + rng.integers(1, c, size=n)) % c
    distracted = np.repeat(np.arange(n), k_decoy)
    distracting = member(label, decoy[distracted])
    keep_c, keep_d = citing != cited, distracting != distracted
    src = np.concatenate([citing[keep_c], author, distracting[keep_d]])
    dst = np.concatenate([cited[keep_c], written, distracted[keep_d]])
    etype = np.repeat(np.arange(3, dtype=np.int8), [keep_c.sum(), author.size, keep_d.sum()])

    perm = rng.permutation(n)
    n_train, n_valid = int(0.6 * n), int(0.2 * n)
    splits = {"train": np.sort(perm[:n_train]), "valid": np.sort(perm[n_train:n_train + n_valid]),
              "test": np.sort(perm[n_train + n_valid:])}
    has_feat = np.r_[np.ones(n, dtype=bool), np.zeros(num_authors, dtype=bool)]
    return GraphParts(f"synthetic-hetero-{n}", n + num_authors, c, src, dst, feat,
                      np.r_[label, np.full(num_authors, -1, dtype=np.int64)], splits, reverse_default=True,
                      etype=etype, ntype=np.r_[np.zeros(n, np.int8), np.ones(num_authors, np.int8)],
                      node_types=("paper", "author"), edge_types=HETERO_RELATIONS, target_type="paper",
                      has_feat=has_feat)
