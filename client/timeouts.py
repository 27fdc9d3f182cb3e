"""The client's timeouts and retry intervals, in one place, each with its reason.

Every other budget is a ClientConfig key (``timeout`` for metadata calls; a read's is ``timeout``
plus its length at ``min_throughput``: client/transport/bulkpaths.py ``read_budget``). The
modules that use these import them from here by name (so a test may still set one on its module).
"""

from __future__ import annotations


# -- Forks -------------------------------------------------------------------------------------------
#: At most this long for all hooks' ``before_fork`` together: a fork is never held up for long
#: by a hook that cannot quiesce (it then proceeds; the child drops that state anyway).
BEFORE_FORK_BUDGET = 5.0

# -- The workers' sockets (client/transport/bulkpaths.py) --------------------------------------------
#: Seconds before asking a worker again which paths it offers (its sockets move only when it restarts).
PROBE_RETRY = 60.0
#: A worker answers a cached range in milliseconds; a path that takes this long is dropped for a
#: while (reads go through gRPC), so a wedged socket costs a read at most this much (plus the
#: transfer's own time at min_throughput), never the gRPC deadline.
SOCKET_TIMEOUT = 5.0
#: After a lean path's failure it is tried again after this long, doubling with each failure in
#: a row up to PROBE_RETRY: a busy worker (at its connection limit, a full backlog) or one slow
#: for a moment is not a wedged one, and is back on the lean path within a second.
LEAN_RETRY_FIRST = 0.5
#: Seconds before asking again a worker that was away (refused, socket gone, gRPC unavailable).
AWAY_RETRY = 2.0
#: In a process without gRPC, seconds before a worker's lean path that failed is tried again:
#: it has no other way to that worker (reads go to the ring's next workers meanwhile).
NO_GRPC_RETRY = 0.2
#: Less than this left of a call's budget is not worth another try (a worker, a socket).
MIN_TRY_SECONDS = 0.05
#: A metadata operation every placed worker answered busy (its threads for slow work taken:
#: server/connections.py SLOW_SHARE) is asked again this much later, within its budget.
BUSY_BACKOFF = 0.1

# -- The short-circuit socket (client/transport/shortcircuit.py) -------------------------------------
#: A range a prepare found not cached (yet: the worker may still be writing a cold read's pages)
#: is read the other way (a fill, or gRPC) for this long, with no second message asking again first.
NOT_CACHED_SECONDS = 0.5
#: After a hello that brought no name index (refused, or the worker away), reads ask again no sooner.
HELLO_RETRY = 5.0
#: How long an exiting process waits for the worker to take its last report.
EXIT_REPORT_TIMEOUT = 2.0

# -- Pages read by name (client/transport/namedpages.py) ---------------------------------------------
#: Pages read by name are reported to the worker once this old at the latest (or once MAX_TOUCHED
#: of them wait): the worker's recency and the plan's position stay current.
REPORT_SECONDS = 1.0
#: Objects read past their entries' time go to the worker this soon (it refreshes them, and so
#: finds a change in the store): soon, but not one report per batch.
STALE_REPORT_SECONDS = 0.2

# -- Held page descriptors (client/transport/handles.py) ---------------------------------------------
#: A page handed out for one read only (slot ONCE) is closed by the sweep this long after, if that
#: read never came: its space is back on the worker's disk by then.
ONCE_SECONDS = 5.0

# -- The master's client port (client/transport/masterport.py) ---------------------------------------
#: A main process asks for the view this often: a poll is ~0.1 ms of the master's time, and a
#: new view (a worker joined or left) is taken within this plus the master's own lease timing.
VIEW_POLL_SECONDS = 2.0
#: Connecting to a client port that does not answer (filtered) costs at most this, once per
#: session: then the session follows the view through gRPC.
CONNECT_SECONDS = 2.0

# -- Read plans (client/datasets/plans.py) -----------------------------------------------------------
#: A registered plan expires this long after its last renewal: a job that died stops steering the
#: workers' eviction and prefetch within it.
DEFAULT_LEASE_SECONDS = 30.0
#: A reading job renews its plan (its position, its rate) this often, so the workers' idea of
#: where it is stays within a second; an idle one only every third of the lease.
DEFAULT_RENEW_SECONDS = 1.0
#: One plan request's budget: a plan is advisory, a failed request is counted and sent again.
CALL_TIMEOUT = 30.0
