"""Every test process sees 8 simulated CPU devices; meshes of 1, 2 or 8 use the first ones."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
