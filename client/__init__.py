"""The cachefs client: fsspec filesystem, PyTorch datasets, and what they share.

Importing it changes no gRPC setting. DataLoader workers are forked from a training process
that has talked gRPC; grpcio's fork support (``GRPC_ENABLE_FORK_SUPPORT=1``) would run at-fork
handlers in every such child, and those hung the children of a busy parent at every epoch start
(docs/architecture.md, "Fork safety"). Instead a forked child never touches the gRPC state it
inherited: it reads, lists and follows the cluster view over the worker's own sockets
(client/forksafe.py ``forbid_grpc``, client/transport/bulkpaths.py).
"""
