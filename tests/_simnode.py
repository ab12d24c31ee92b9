"""How the test suite brings a simulated node up and leaves it (the ``sim``, ``sim2`` and
``rb`` session fixtures): skipped without root or LXC; a failed bring-up is one clear test
failure, not a traceback in every test; taken down at the end only when
``DFLASH_SIM_TEARDOWN=1`` (CI), otherwise left up so the next session starts in seconds."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import pytest

TEARDOWN_ENV = "DFLASH_SIM_TEARDOWN"


@contextmanager
def session_node(name: str, ctids: tuple[int, ...] | None = None, prepare=None):
    """Yield ``SimNode(name[, ctids])`` up, after ``prepare(node)`` if given."""
    from sim.node import SimNode
    from sim.proc import SimError

    if os.geteuid() != 0:
        pytest.skip("the simulated node needs root (LXC, loop mounts, sshd)")
    if not shutil.which("lxc-start"):
        pytest.skip("LXC is not installed: apt-get install -y --no-install-recommends lxc debootstrap btrfs-progs")
    node = SimNode(name) if ctids is None else SimNode(name, ctids=ctids)
    try:
        # Always: up() is idempotent (well under a second when the node is up) and also
        # refreshes bin/pct from the working tree.
        node.up()
        if prepare is not None:
            prepare(node)
    except SimError as exc:
        pytest.fail(f"could not bring the simulated node {name} up: {exc}", pytrace=False)
    yield node
    if os.environ.get(TEARDOWN_ENV) == "1":
        node.down()
