"""``--dataset synthetic``: a learnable graph generated in memory, the same for the same seed."""

from __future__ import annotations

import numpy as np

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
    feat = centroids[label] + rng.standard_normal((n, d), dtype=np.float32)

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

