"""The worker daemon: gRPC service -> page reader -> page store / object store."""

from cachefs.server.worker.daemon import GRPC_OPTIONS, Worker, serve

__all__ = ["GRPC_OPTIONS", "Worker", "serve"]
