import sys

import _procs
import jax
import pytest

import jaxzero
from jaxzero.mesh import backend_started, batch_axes, num_shards


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


def test_backend_started_reads_a_private_jax_name_that_still_exists():
    """JAX has no public "is the backend started?"; if it renames its private one, this
    fails here first (the False case: simulate_devices below works in a fresh process)."""
    jax.devices()
    assert backend_started() is True


@pytest.mark.every_lane
@pytest.mark.system
def test_simulate_devices_fails_loudly_after_backend_start():
    code = "import jax, jaxzero; jax.devices(); jaxzero.simulate_devices(3)"
    out = _procs.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
        timeout=120,
    )
    assert out.returncode != 0 and "already initialised" in out.stderr
    code = "import jaxzero, jax; jaxzero.simulate_devices(3); print(jax.device_count())"
    out = _procs.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
        timeout=120,
    )
    assert out.stdout.strip() == "3", out.stderr
