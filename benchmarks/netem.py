"""Moved into the package as ``cachefs/netem.py`` (``cachefs demo`` uses its delay proxy); the
benchmarks still ``from netem import ...`` (benchmarks/ is on their sys.path), so this name stays."""

from cachefs.netem import *  # noqa: F401,F403
from cachefs.netem import Endpoint, NetemUnavailable, measure_rtt, moto_endpoint, remove_stale  # noqa: F401
