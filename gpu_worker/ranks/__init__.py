"""The rank processes of a worker group: one per device, spawned and owned by `gpu_worker.group`.

Every rank joins the group, loads every pipeline and warms it up (`start`), then serves batches.
Rank 0 (the leader, `leader`) is the only rank that talks to the coordinator: it takes commands,
relays each batch to the other ranks (the followers, `follower`), decides after every step which
requests stop, and reports results. The relay is a broadcast over a gloo CPU group whose timeout
is effectively infinite, so an idle follower sleeps inside it (gloo waits on a condition
variable, measured at ~0 % CPU). Per-step decisions and outcomes travel over a second gloo group
with a finite timeout: a rank left alone in a collective fails instead of hanging for ever.

Modules: `args` (what a rank is started with: the node builds it, torch-free), `entry` (the
spawn target: start, ready handshake, role, exit), `process` (the OS side: parent-death
detection, title, threads), `start`, `forward` (one forward on any rank), `relay` (the small
collectives between ranks), `leader`, `follower`.
"""
