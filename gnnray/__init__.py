"""gnnray: GNN training on Ray, the graph held once per node.

A folder is one process (``tests/test_layout.py`` holds it: only the training processes' folders import
torch at module level). One mini-batch's path from seed ids to loss, with the file of each stage, is told once,
in README.md#what-runs-where; the folders:

- Shared contracts, at the top: ``batch.py`` (the one batch type and its wire format) and ``seeds.py`` (the seed
  plan, the stream's rows and whether a run streams).
- ``data/``: the graph type (``graph.py``), its readers (``synthetic.py``,
  ``ogb.py``, ``mag.py``, ``graph_dir.py``; ``typed.py`` fills typed graphs'
  missing features; ``feature_source.py``: where feature rows come from, on any
  node), the one CSC builder (``csc.py``) and its checks (``validate.py``).
- ``store/``: the graph's place in Ray's object store and what serves it there: ``handle.py`` (the graph
  once per node, zero-copy, read-only), ``shards.py`` (the shard servers of ``--feature-shards``, actors on
  other nodes) and ``hidden_server.py`` (the shard servers' hold of layer-wise inference's hidden tables).
- ``sampler/``: what sampler actors run: ``sampler.py`` (the actor, the ``Sampler`` and the evaluation
  sampler), ``pick.py`` (its kernels, numba), ``graphbolt.py`` (DGL's sampler behind ``--sampler graphbolt``,
  the ``dgl`` extra; the one module outside the training processes that imports torch).
- ``models/``: the models (``model.py``: sage, gat, gcn, rgat, rsage), their layers (``conv.py``) and the
  CPU dropout mask (``dropout.py``); torch only, reused by ``train/``, ``inference/`` and the benchmarks.
- ``train/``: what a Ray Train worker runs (``setup.py``: what the driver hands it): its prefetch thread
  (``prefetch.py``, ``feature_reader.py``), ``placement.py`` (``--feature-placement``), ``device_sampler.py``
  (``--sample-on device``: on a GPU in torch, on a CPU worker the native sampler at idle priority; a fixed run
  then needs no stream), ``gpu_budget.py`` (its GPU as one budget; torch-free, so the driver plans by the same
  rule), ``embedding.py`` (``--embedding-dim``) and ``checkpoint.py`` (written by rank 0 and, for embedding
  rows, by their owners; chosen by the driver). ``layerwise.py``: exact layer-wise inference after the last
  epoch (``layerwise_hidden.py``: its hidden tables on the shard servers with ``--feature-shards``).
- ``inference/``: ``layerwise_task.py`` runs the same layer-wise code in one Ray task for ``jobs/predict.py``.
- ``controller/``: what Ray Train's controller side runs on the run's behalf: ``split.py``, the stream's split
  (Ray Train's dataset-manager actor calls it; an elastic group's stream is made there).
- ``driver/``: ``cli.py`` (exit codes) -> ``fit.py`` (resume, restarts, final
  evaluation) -> ``attempt.py`` (one Ray Train attempt: trainer, backend, split, where the stream starts);
  ``connect.py`` (start or join Ray), ``launch.py`` (load,
  publish; both shared with ``predict_job.py``, ``jobs/predict.py``'s driver), ``plans.py`` (the decisions
  before training), ``preflight.py`` (storage and cluster checks), ``stream.py`` (the Ray Data stream, in one
  place; ``read_ahead.py``: ``--max-ahead``'s bound), ``pace.py`` (a CPU node's cores as one budget, and beside
  GPU workers where sampling runs and the actors that keep pace), ``console.py``
  (what a run prints), ``failures.py`` (one-line failure text).
- Shared by all: ``config.py`` (``fanouts.py``: ``--fanouts``' value type), ``errors.py`` (user-facing exceptions),
  ``stack.py`` (the versions every node must share with the driver; ``ray_internals.py``: every use of Ray's
  private modules, read from the Ray that ``stack.py`` pins),
  ``metrics.py`` (Prometheus metrics of workers and sampler actors), ``run_storage.py`` (the files a run keeps, in
  a directory or an object store, through ``pyarrow.fs``; not ``store/``, the object store's graph).
"""
