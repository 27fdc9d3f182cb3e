"""The cachefs client: fsspec filesystem, PyTorch datasets, and what they share.

Importing it turns on grpcio's fork support for this process, when grpc is not imported yet and
the environment does not say otherwise: DataLoader workers are forked from a process that has
been talking gRPC, and with fork support off (grpcio's default) no gRPC handler resets its
state in the child. On is not enough on its own (a forked child's first channel still hung in
about 1 of 10 starts, holding the GIL), so DataLoader workers keep gRPC off their data path
(session.SessionBootstrap); fork support is on for what still uses gRPC there. gRPC reads the
switch once, from the environment, when it is first imported: hence this is done here, before
any client module imports grpc, and not in a function a user would have to call first. ``GRPC_ENABLE_FORK_SUPPORT=0`` in the
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
