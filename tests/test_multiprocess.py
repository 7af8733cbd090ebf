"""Two processes x two CPU devices (jax.distributed over gloo) train like one device."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
from _models import mlp_batches, mlp_loss, mlp_params, rel_diff, train_reference

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_two_processes_match_one_device(stage, tmp_path):
    port, out = _free_port(), tmp_path / "final.npz"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, str(HERE / "_mp_worker.py"), str(i), str(port),
                               str(stage), str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    losses = json.loads(results[0][0].strip().splitlines()[-1])["losses"]
    ref_losses, ref_params = train_reference(mlp_loss, mlp_params(), mlp_batches(5),
                                             optax.adamw(1e-3))
    final = dict(np.load(out))
    assert rel_diff(np.array(losses), ref_losses) <= 1e-5
    assert rel_diff(final, ref_params) <= 1e-5
