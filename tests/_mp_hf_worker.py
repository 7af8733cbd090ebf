"""One process of 2 x 2 CPU devices loading, fine-tuning and saving a Hugging Face
checkpoint (spawned by test_hf.py): each process reads only its devices' slices."""

import sys

import jax

proc, port, src, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=proc
)

import math  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _procs import write_report  # noqa: E402

import jaxzero  # noqa: E402
from jaxzero import hf  # noqa: E402

model = hf.model(src, seq_len=12)
engine = model.engine(optax.adamw(1e-2), mesh=jaxzero.make_mesh(4), stage=3)
shapes, read = hf._reader(hf.Path(src), model)
elements = {}


def logged(lay, index):
    """Counts what this process reads of each param."""
    elements[lay.path] = elements.get(lay.path, 0) + math.prod(s.stop - s.start for s in index)
    return read(lay, index)


state = engine._init_from_slices(shapes, logged)
rng = np.random.default_rng(3)
losses = []
for _ in range(3):
    t = rng.integers(0, model.config.vocab_size, (8, 13)).astype(np.int32)
    local = {"inputs": t[4 * proc : 4 * proc + 4, :-1], "targets": t[4 * proc : 4 * proc + 4, 1:]}
    state, metrics = engine.step(state, engine.shard_batch(local))
    losses.append(float(metrics["loss"]))
hf.save(out, model, engine, state, dtype="float32")
sharded = {
    lay.path: lay.size
    for lay in jax.tree.leaves(engine.layouts, is_leaf=jaxzero.partition.is_layout)
    if lay.sharded
}
write_report({"losses": losses, "read": elements, "sharded": sharded})
jax.distributed.shutdown()
