"""Benchmarks and measurements, and their results (``experiments/results/``); not installed.

Run each from the repository root as a module, ``python -m experiments.bench_step ...``,
so that the scripts import each other (``from experiments import zoo``) and the
``jaxzero`` beside them without touching ``sys.path``.
"""
