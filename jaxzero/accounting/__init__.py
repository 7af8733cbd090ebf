"""Measuring a ZeRO step: what it holds and sends, beside what the formulas predict.

:mod:`~jaxzero.accounting.estimate` (the formulas, with
:mod:`~jaxzero.accounting.activations` for activation memory),
:mod:`~jaxzero.accounting.hlo` (compiled HLO text parsed, with loop trip counts),
:mod:`~jaxzero.accounting.comm` (its collectives and bytes on the wire, with
:mod:`~jaxzero.accounting.groups` for their device groups and
:mod:`~jaxzero.accounting.widening` for element types the backend widened),
:mod:`~jaxzero.accounting.expected` (the formulas at one engine's figures),
:mod:`~jaxzero.accounting.measure` (a compiled step's memory and collectives beside
them, in a :mod:`~jaxzero.accounting.table` ``Report``; :func:`jaxzero.report` is its
``report``). The ``jaxzero estimate`` and ``jaxzero report`` commands that print them are
in :mod:`jaxzero.commands`. Nothing is re-exported here: import the module you need.
"""
