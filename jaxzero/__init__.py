"""jaxzero: data parallelism and ZeRO stages 1–3 for JAX, with explicit collectives.

import jaxzero, optax
mesh = jaxzero.make_mesh(8)
engine = jaxzero.Engine(loss_fn, optax.adamw(1e-3), mesh=mesh, stage=3)
state = engine.init(params)
state, metrics = engine.step(state, batch)
"""

from jaxzero import hf, nnx
from jaxzero.checkpoint import CheckpointError, CheckpointManager, CheckpointWriteError
from jaxzero.engine import Engine
from jaxzero.errors import Error
from jaxzero.hooks import remat_layer, use_params
from jaxzero.loss import Weighted, WithState
from jaxzero.mesh import batch_axes, make_mesh, simulate_devices
from jaxzero.model_state import split_variables
from jaxzero.nnx import NNXEngine
from jaxzero.partition import LeafLayout, layouts_for
from jaxzero.state import TrainState
from jaxzero.version import __version__ as __version__  # from the package metadata

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWriteError",
    "Engine",
    "Error",
    "LeafLayout",
    "NNXEngine",
    "TrainState",
    "Weighted",
    "WithState",
    "batch_axes",
    "hf",
    "layouts_for",
    "make_mesh",
    "nnx",
    "remat_layer",
    "report",
    "simulate_devices",
    "split_variables",
    "use_params",
]


def __getattr__(name: str) -> object:
    """``jaxzero.report(engine, state, batch)``: :func:`jaxzero.accounting.measure.report`,
    imported on first use, so ``import jaxzero`` skips the accounting (0.1 s)."""
    if name == "report":
        from jaxzero.accounting.measure import report

        return report
    raise AttributeError(f"module 'jaxzero' has no attribute {name!r}")
