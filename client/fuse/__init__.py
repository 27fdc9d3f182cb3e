"""``cachefs fuse``: a POSIX mount over the session (libfuse 3).
"""

__all__ = [
    "fusefs",
    "fusemount",
    "fusewrite",
]
