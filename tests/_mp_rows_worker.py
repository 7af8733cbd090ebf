"""One process of a 2-process job feeding its own rows (test_multiprocess.py).

Each process asks the engine which rows of the global batch it feeds
(``engine.process_rows``), passes only those to ``shard_batch`` and ``step``, and rank 0
reports both processes' rows, the assembled global batch and the losses.
"""

import sys

import jaxzero.distributed

job = jaxzero.distributed.initialize()  # torchrun's variables

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _models import mlp_batches, mlp_loss, mlp_params  # noqa: E402
from _procs import write_report  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import jaxzero  # noqa: E402

engine = jaxzero.Engine(
    mlp_loss, optax.adamw(1e-3), mesh=jaxzero.make_mesh(4), stage=3, micro_batches=2
)
state = engine.init(mlp_params())
rows = engine.process_rows(16)
everyone = multihost_utils.process_allgather(np.array([rows.start, rows.stop]))
try:
    engine.process_rows(12)  # 4 devices x 2 micro-batches = 8 does not divide 12
    refused = ""
except ValueError as e:
    refused = str(e)
batches = mlp_batches(5)
mine = {k: v[rows] for k, v in batches[0].items()}
whole = multihost_utils.process_allgather(engine.shard_batch(mine)["x"], tiled=True)
losses = []
for batch in batches:
    state, metrics = engine.step(state, {k: v[rows] for k, v in batch.items()})
    losses.append(float(metrics["loss"]))
if job.rank == 0:
    write_report(
        {
            "rows": np.asarray(everyone).tolist(),
            "refused": refused,
            "assembled": bool(np.array_equal(np.asarray(whole), batches[0]["x"])),
            "losses": losses,
        }
    )
jaxzero.distributed.shutdown()
sys.exit(0)
