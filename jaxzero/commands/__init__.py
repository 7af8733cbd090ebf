"""Commands that stand above the training app: ``jaxzero estimate`` and ``jaxzero report``.

Each reads a run's config or builds a model, so it sits above :mod:`jaxzero.train` and
:mod:`jaxzero.models`, while what it computes stays below: the formulas in
:mod:`jaxzero.accounting.estimate`, the measurements in :mod:`jaxzero.accounting.measure`.
The training app's own commands (``train``, ``plot``, ``export``, ``sample``) live in
:mod:`jaxzero.train`; ``launch`` in :mod:`jaxzero.launch`. Nothing is re-exported here.
"""
