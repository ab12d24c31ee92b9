"""Provision the tiny target and data in a container, the way a real node already holds its
model and data: ``python -m trainer tiny --out /workspace/tiny`` run *in the container* from
this version's bundle, through the product's own exec path (SSH → pct exec → scrubbed env).

Idempotent: a container that already has both ``target/config.json`` and ``data/meta.json``
is left alone (one round trip). ``ctl sim up`` calls this for each container so that
``ctl launch --container 200 --config examples/tiny.toml --from-scratch`` works right after.
"""

from __future__ import annotations

import posixpath
from typing import Callable

from controller.agentcall import AgentCaller
from controller.container import Container, ContainerError

TINY_DIR = "tiny"  # under the container's workspace: /workspace/tiny/{target,data}


def tiny_paths(ct: Container) -> tuple[str, str, str]:
    base = posixpath.join(ct.config.workspace, TINY_DIR)
    return base, posixpath.join(base, "target"), posixpath.join(base, "data")


def provision_tiny(ct: Container, say: Callable[[str], None] = lambda line: None, seed: int = 0,
                   samples: int = 320) -> dict:
    """Make sure ``<workspace>/tiny/{target,data}`` exist in ``ct``; returns what was done."""
    base, target, data = tiny_paths(ct)
    have = ct.exec(["test", "-f", posixpath.join(target, "config.json"), "-a", "-f",
                    posixpath.join(data, "meta.json")])
    if have.ok:
        return {"container": ct.ctid, "dir": base, "created": False}
    # A half-written earlier attempt would make `trainer tiny` refuse ("already exists"):
    # it writes into a temp dir and renames, so only complete dirs can be there — but a
    # dataset without a target (or the reverse) is removed and written again, together.
    ct.exec(["rm", "-rf", "--", target, data], check=True)
    say(f"provisioning {base} in {ct} (tiny Qwen3 target + data, `python -m trainer tiny`)")
    caller = AgentCaller(ct, say)
    result = caller.run("trainer", ["tiny", "--out", base, "--seed", str(seed), "--samples", str(samples)],
                        timeout=900)
    if result.failed:
        raise ContainerError(f"`python -m trainer tiny --out {base}` failed in {ct} (exit code "
                             f"{result.returncode}): {result.tail('stderr', 6) or result.tail('stdout', 6)}")
    return {"container": ct.ctid, "dir": base, "created": True, "output": result.stdout.strip()}


def provision_node(node_name: str, config_file: str | None = None,
                   say: Callable[[str], None] = lambda line: None) -> list[dict]:
    """``provision_tiny`` in every container the controller config lists for ``node_name``,
    over one SSH connection. ``ctl sim up`` calls this after writing the node's entry."""
    from controller import config as cfg
    from controller.session import open_runner

    conf = cfg.load(config_file)
    name, node = conf.node(node_name)
    done = []
    with open_runner(name, node) as runner:
        for ctid in sorted(node.containers, key=int):
            done.append(provision_tiny(Container(runner, name, node, ctid), say))
    return done
