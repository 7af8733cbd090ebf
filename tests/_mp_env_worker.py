"""One process of a 2-process job set up from torchrun's variables alone (test_multiprocess.py).

Trains the odd MLP at stage 3 on 4 devices, then with hybrid sharding (2 groups of 2),
and reports the losses and where each group's devices live (rank 0).
"""

import sys

import jaxzero.distributed

job = jaxzero.distributed.initialize()  # no arguments: MASTER_ADDR, RANK, ... only

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _models import mlp_batches, mlp_loss, mlp_params  # noqa: E402
from _procs import write_report  # noqa: E402

import jaxzero  # noqa: E402

out = {"rank": job.rank, "world_size": job.world_size, "local_rank": job.local_rank}
for name, mesh in [("stage3", jaxzero.make_mesh(4)), ("hybrid", jaxzero.make_mesh(4, replicas=2))]:
    engine = jaxzero.Engine(mlp_loss, optax.adamw(1e-3), mesh=mesh, stage=3)
    state = engine.init(mlp_params())
    mine = engine.process_rows(16)
    losses = []
    for batch in mlp_batches(5):
        local = {k: v[mine] for k, v in batch.items()}
        state, metrics = engine.step(state, engine.shard_batch(local))
        losses.append(float(metrics["loss"]))
    out[name] = losses
    out[name + "_params"] = {k: v.tolist() for k, v in engine.gather_params(state).items()}
    out[name + "_groups"] = [[d.process_index for d in row] for row in np.atleast_2d(mesh.devices)]
if job.rank == 0:
    write_report(out)
jaxzero.distributed.shutdown()
sys.exit(0)
