"""One process of a 2-process job that trains until it is stopped (test_multiprocess.py)."""

import itertools

import jaxzero.distributed

job = jaxzero.distributed.initialize()

import jax  # noqa: E402
import optax  # noqa: E402
from _models import mlp_batches, mlp_loss, mlp_params  # noqa: E402

import jaxzero  # noqa: E402

engine = jaxzero.Engine(mlp_loss, optax.adamw(1e-3), mesh=jaxzero.make_mesh(4), stage=3)
state = engine.init(mlp_params())
batch = mlp_batches(1)[0]
rows = len(batch["x"]) // jax.process_count()
local = {k: v[job.rank * rows : (job.rank + 1) * rows] for k, v in batch.items()}
for step in itertools.count(1):
    state, metrics = engine.step(state, engine.shard_batch(local))
    print(f"step {step} loss {float(metrics['loss']):.4f}", flush=True)
