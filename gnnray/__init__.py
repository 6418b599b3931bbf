"""gnnray: GNN training on Ray, the graph held once per node.

A folder says where its code runs; one mini-batch meets these files in order:

====  ==========================  ======================  =============================================
step  file                        runs on                 output
====  ==========================  ======================  =============================================
0     ``config.py``               driver                  frozen ``JobConfig`` from the command line
1     ``data/load.py``            driver                  validated numpy ``Graph`` (in-edge CSC, features)
2     ``store/handle.py``         driver, read by all     ``GraphHandle``: the graph once per node, zero-copy
      ``store/shards.py``         driver; shard nodes     ``--feature-shards K``: features split over K nodes
3     ``pipeline/seeds.py``       driver, sampler actors  ``SeedPlan`` + dataset of row numbers, all epochs
4     ``pipeline/sampler.py``     sampler actors          packed ``MiniBatch`` rows (``pipeline/batch.py``)
5     ``pipeline/prefetch.py``    train worker thread     ``MiniBatch`` with features, on the device
      ``pipeline/feature_reader.py``                      its rows: local, cached or fetched from shards,
      ``pipeline/placement.py``   train worker            or gathered on the device (``--feature-placement``)
6     ``train/model.py``          train worker            logits (``train/conv.py``: message passing in torch)
7     ``train/step.py``           train worker            loss, optimizer step; ``train/loop.py`` runs it, then
                                                          ``train/evaluate.py`` and ``train/layerwise.py``,
                                                          then ``train/report.py``: metrics, checkpoint
====  ==========================  ======================  =============================================

- ``data/``: the graph type (``graph.py``), its readers (``synthetic.py``,
  ``ogb.py``, ``mag.py``, ``graph_dir.py``; ``typed.py`` fills typed graphs'
  missing features; ``feature_source.py``: where feature rows come from, on any
  node), the one CSC builder (``csc.py``) and its checks (``validate.py``).
- ``store/``: the graph's place in Ray's object store and what serves it there: ``handle.py`` (the graph
  once per node, zero-copy, read-only), ``shards.py`` (the shard servers of ``--feature-shards``, actors on
  other nodes) and ``hidden_rows.py`` (the shard servers' hold of layer-wise inference's hidden tables).
- ``pipeline/``: the batch's path; ``batch.py`` is the one batch type and its
  wire format, ``stream.py`` builds the Ray Data stream in one place;
  ``pick.py`` holds the sampler's kernels (numba), ``graphbolt.py`` DGL's
  sampler behind ``--sampler graphbolt`` (the ``dgl`` extra);
  ``device_sampler.py`` samples in torch on the train worker's device
  (``--sample-on device``: on a GPU in torch, on a CPU worker with the native
  sampler between steps; a fixed run then needs no stream), and ``pace.py``
  plans a CPU node's cores as one budget (workers, threads, where sampling runs)
  and, beside GPU workers, where sampling runs and the actors that keep pace.
- ``train/``: what a Ray Train worker runs (``setup.py``: what the driver hands it), plus ``embedding.py`` (``--embedding-dim``)
  and ``checkpoint.py`` (written by rank 0 and, for embedding rows, by their owners; chosen by the driver).
- ``driver/``: ``cli.py`` (exit codes) -> ``fit.py`` (resume, restarts, final
  evaluation); ``connect.py`` (start or join Ray), ``launch.py`` (load,
  publish; both shared with ``predict.py``), ``plans.py`` (the decisions
  before training), ``preflight.py`` (storage and cluster checks),
  ``split.py`` (the stream's split, ended actors first), ``console.py``
  (what a run prints), ``failures.py`` (one-line failure text).
- ``train/layerwise.py``: exact layer-wise inference on the train workers after
  the last epoch (``train/hidden.py``: its hidden tables on the shard servers
  with ``--feature-shards``); ``inference/predict_task.py`` runs the same code in
  one Ray task for ``jobs/predict.py``.
- Shared by all: ``config.py`` (``fanouts.py``: ``--fanouts``' value type), ``errors.py`` (user-facing exceptions),
  ``stack.py`` (the versions every node must share with the driver; ``ray_internals.py``: every use of Ray's
  private modules, read from the Ray that ``stack.py`` pins),
  ``metrics.py`` (Prometheus metrics of workers and sampler actors), ``storage.py`` (the files a run keeps, in a
  directory or an object store, through ``pyarrow.fs``).
"""
