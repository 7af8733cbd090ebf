"""Measuring a ZeRO step: what it holds and sends, beside what the formulas predict.

:mod:`~jaxzero.accounting.estimate` (the formulas; ``jaxzero estimate``),
:mod:`~jaxzero.accounting.hlo` (collectives in compiled HLO text),
:mod:`~jaxzero.accounting.measure` (a compiled step's memory and collectives beside
the formulas; ``Engine.report``) and :mod:`~jaxzero.accounting.report`
(``jaxzero report``). Nothing is re-exported here: import the module you need.
"""
