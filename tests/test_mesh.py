import subprocess
import sys

import pytest

import jaxzero
from jaxzero.mesh import batch_axes, num_shards


def test_mesh_over_first_devices():
    mesh = jaxzero.make_mesh(2)
    assert mesh.axis_names == ("data",) and num_shards(mesh) == 2
    assert len(jaxzero.make_mesh().devices.flat) == 8


def test_hybrid_mesh_shards_within_replicates_across():
    mesh = jaxzero.make_mesh(8, replicas=2)
    assert batch_axes(mesh) == ("replica", "data") and num_shards(mesh) == 4


@pytest.mark.parametrize("n, match", [(9, "only 8"), (0, "positive"), (-1, "positive")])
def test_bad_device_counts(n, match):
    with pytest.raises(ValueError, match=match):
        jaxzero.make_mesh(n)


@pytest.mark.system
def test_simulate_devices_fails_loudly_after_backend_start():
    code = "import jax, jaxzero; jax.devices(); jaxzero.simulate_devices(3)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert out.returncode != 0 and "already initialised" in out.stderr
    code = "import jaxzero, jax; jaxzero.simulate_devices(3); print(jax.device_count())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert out.stdout.strip() == "3", out.stderr
