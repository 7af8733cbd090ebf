"""One process of a 2-process, 4-device training run (spawned by test_multiprocess.py)."""

import sys
import threading

import jax

proc, port, stage, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
# "3-offload": stage 3 with the optimizer state in each process's pinned host memory
offload = "optimizer" if stage.endswith("-offload") else None
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=proc
)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _models import mlp_batches, mlp_loss, mlp_params  # noqa: E402
from _procs import write_report  # noqa: E402

import jaxzero  # noqa: E402
from jaxzero import distributed  # noqa: E402

engine = jaxzero.Engine(
    mlp_loss, optax.adamw(1e-3), mesh=jaxzero.make_mesh(4), stage=int(stage[0]), offload=offload
)
state = engine.init(mlp_params())
losses = []
for batch in mlp_batches(5):
    rows = len(batch["x"]) // 2  # this process's devices hold its half of the global batch
    local = {k: v[proc * rows : (proc + 1) * rows] for k, v in batch.items()}
    state, metrics = engine.step(state, engine.shard_batch(local))
    losses.append(float(metrics["loss"]))
final = engine.gather_params(state)
threads = threading.active_count()
lost = distributed.lost_ranks(60)  # both ask: the coordination service sees both alive
# lost_ranks' thread has left JAX's runtime: one still in it at exit aborts the process
left = threading.active_count() - threads
if proc == 0:
    np.savez(out, **final)
    write_report({"losses": losses, "lost": lost, "threads_left": left})
jax.distributed.shutdown()
