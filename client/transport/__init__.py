"""How a process reaches the cluster: the session (session.py) over the workers and their placement
(workers.py), the master's client port (masterport.py), the workers' sockets (bulkpaths.py:
short-circuit and data port), pages held or opened by name, and gRPC where no socket serves
(grpcchannels.py, view.py: loaded only there). Importing it loads no gRPC.
"""

__all__ = [
    "bulkpaths",
    "dataport",
    "grpcchannels",
    "handles",
    "masterport",
    "namedpages",
    "session",
    "shortcircuit",
    "socketpool",
    "view",
    "viewfetch",
    "workers",
]
