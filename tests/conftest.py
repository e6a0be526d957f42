"""Test-session set-up: 8 simulated CPU devices, so that sharding tests run on any machine.

This must happen before JAX initialises its backend, hence here and at import time. Computations
that are not sharded still run on one device.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
