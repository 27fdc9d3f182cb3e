"""The cachefs client: fsspec filesystem, PyTorch datasets, and what they share.

Importing it turns on grpcio's fork support for this process, when grpc is not imported yet and
the environment does not say otherwise: DataLoader workers are forked from a process that has
been talking gRPC, and with fork support off (grpcio's default) a forked child inherits whatever
gRPC's own threads held at the fork; its first channel was seen to hang (2 of 15 runs of a
two-rank DataLoader test, none of 16 with fork support on). gRPC reads the switch once, from the
environment, when it is first imported: hence this is done here, before any client module imports
grpc, and not in a function a user would have to call first. ``GRPC_ENABLE_FORK_SUPPORT=0`` in the
environment keeps it off. A process that also hosts a gRPC *server* and forks should keep it off
(gRPC's child handler then waits for the server's threads): import grpc, or a server module,
before the client there.
"""

from __future__ import annotations

import os
import sys

FORK_SUPPORT_VARIABLE = "GRPC_ENABLE_FORK_SUPPORT"


def _enable_grpc_fork_support() -> None:
    if "grpc" in sys.modules or FORK_SUPPORT_VARIABLE in os.environ:
        return
    os.environ[FORK_SUPPORT_VARIABLE] = "1"


_enable_grpc_fork_support()
