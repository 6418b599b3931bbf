"""gnnray: GNN training on Ray, the graph held once per node.

One mini-batch meets the stages in this order (one module each):

==================  =====================  ===================================================
module              runs on                output
==================  =====================  ===================================================
``config``          driver                 frozen ``JobConfig`` from the command line
``datasets``        driver                 validated numpy ``Graph`` (in-edge CSC, features)
``graph_store``     driver                 ``GraphHandle``: the graph once in the object store
``seeds``           driver                 ``SeedPlan`` + dataset of row numbers, all epochs
``sampling``        sampler actors         Arrow rows of packed ``MiniBatch`` (``batch``)
``prefetch``        train worker thread    ``MiniBatch`` with features, on the device
``model``           train worker           logits
``train_loop``      train worker           loss, metrics and checkpoints via ``ray.train``
==================  =====================  ===================================================

``job`` is the driver that wires them; ``cluster`` checks on the driver that
the cluster can ever run the job; ``checkpoint`` reads and writes
checkpoints; ``metrics`` exports Prometheus metrics from workers and sampler
actors; ``errors`` holds the user-facing exceptions. ``embedding`` is the
learnable node input of ``--embedding-dim`` (train worker); ``inference`` is
layer-wise full-neighbor prediction after training and in ``jobs/predict.py``
(driver, Ray Data actors).
"""
