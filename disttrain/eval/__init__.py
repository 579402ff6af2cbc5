"""Scores of lm-evaluation-harness tasks on the run's model: during training (``eval.tasks``, a callback that scores
at validations), at its end, and from the command line on a checkpoint (``python -m disttrain.eval RUN``).

``lm`` is the harness's model interface over the sharded model (requests split over the data-parallel ranks),
``scoring`` one evaluation through the harness's own ``evaluate``, ``callback`` the scores inside a run. The ``eval``
node and its checks before ranks start live with the other schemas (``disttrain.config.evaluation``).
"""
