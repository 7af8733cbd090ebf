"""The training app behind ``jaxzero train``: everything around the engine that a run needs.

:mod:`~jaxzero.train.config` (the run's typed config), :mod:`~jaxzero.train.data`
(corpora and the resumable loader), :mod:`~jaxzero.train.loop` (``jaxzero train``
itself, with :mod:`~jaxzero.train.args` for its command line and
:mod:`~jaxzero.train.optimizer` for its AdamW), :mod:`~jaxzero.train.metrics`,
:mod:`~jaxzero.train.events` and :mod:`~jaxzero.train.plot` (where the numbers go),
:mod:`~jaxzero.train.rundir` (the run's directory), :mod:`~jaxzero.train.resume`
(checkpoints, signals), :mod:`~jaxzero.train.export` and :mod:`~jaxzero.train.sample`
(weights out, text out). ``python -m jaxzero.train`` runs ``jaxzero train``. ``jaxzero launch``
(the processes of one node) is :mod:`jaxzero.launch`, beside the job's rules.
"""
