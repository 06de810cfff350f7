"""The rank server's start (gpu_worker/rank_server.py): imported once, in the server, at its start.

Nothing else imports this module: importing it is what makes a process the rank server. It
leaves the node's process group, imports what every rank would import first, so forked ranks
find it done, and lets go of the node's stdout and stderr. The code that loads the node's
pipelines (diffusers, for a node that serves it) is preloaded after it (`rank_launch`).
Importing these initialises neither CUDA nor torch's thread pools.
"""

from __future__ import annotations

import contextlib
import os

from kiln.gpu_worker.quiet import quiet_known_warnings

# A SIGTERM sent to the node's process group is for the node, which then stops its ranks in
# order; it must not kill the server, whose death would take the ranks down (their PDEATHSIG).
with contextlib.suppress(OSError):
    os.setpgid(0, 0)
quiet_known_warnings()  # the imports below print what each rank would otherwise

import torch  # noqa: E402  (the cost this server is for: seconds of a fresh interpreter)

import kiln.gpu_worker.rank_server  # noqa: E402  (the served ranks' entry)
import kiln.gpu_worker.ranks.entry  # noqa: E402, F401  (rank_main and all it imports)

# The server must not hold the node's stdout and stderr: a node that captures them (JSON logs)
# waits at exit for their end of file, which a server still holding them would delay. Each rank
# writes to the node's own streams (rank_server.NodeSide); the server has nothing to say.
_devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(_devnull, 1)
os.dup2(_devnull, 2)
os.close(_devnull)

__all__ = ["torch"]
