"""The master's etcd client (server/etcd/): only masters import it, never workers or training processes.

etcd's own gRPC API, its messages built in a private descriptor pool (``api.py``), so that no
etcd client another library brings into the same process can clash with it on symbol names.
"""
