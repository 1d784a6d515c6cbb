"""The port of a spawned group's store: held from the pick until the group ends, where nothing
else takes it (a full suite once lost a group to EADDRINUSE: ``free_port`` had bound port 0,
closed it, and another process took that ephemeral port before the store bound it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from lightning_mhc.testing import launch
from lightning_mhc.testing.launch import free_port, release_port, spawn_ranks


def _rank_port(rank, world_size):
    return int(os.environ["MASTER_PORT"])


def test_a_group_port_is_held_outside_the_ephemeral_range_until_the_group_ends():
    low, _ = launch._ephemeral_range()
    port = free_port()
    try:
        # no bind(0) and no outgoing connection draws it, and no other process of ours picks it
        assert port < low, (port, low)
        # (its lock cannot be taken there, so a draw that lands on it moves on)
        other = (f"import fcntl, json, os; from lightning_mhc.testing.launch import PORT_LOCKS, free_port\n"
                 f"fd = os.open(os.path.join(PORT_LOCKS, '{port}.lock'), os.O_RDWR)\n"
                 f"try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); taken = True\n"
                 f"except OSError:\n    taken = False\n"
                 f"print(json.dumps([taken, [free_port() for _ in range(300)]]))")
        drawn = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=120, check=True)
        taken, ports = json.loads(drawn.stdout.splitlines()[-1])
        assert not taken and port not in ports
    finally:
        release_port(port)
    assert port not in launch._held_ports
    # a group's ranks get the port its parent held, released when the group ends
    ports = spawn_ranks(_rank_port, 2, timeout_s=60)
    assert ports[0] == ports[1] < low and ports[0] not in launch._held_ports
