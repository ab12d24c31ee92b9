#!/usr/bin/python3
"""`pct` of the simulated Proxmox node: Proxmox's CLI surface over real LXC containers.

Installed as ``<node state>/bin/pct`` (sim/node.py copies this file there); it finds its
node through ``../node.json``. Standard library only, self-contained: it runs on the node,
outside any venv. Each behaviour reproduced here, and the pve-container / pve-guest-common
source it follows, is listed in docs/sim.md. In short:

- errors are printed to stderr and exit 255, as ``die`` under PVE::CLIHandler does
  (``exit(-1)``); task commands (start, stop, snapshot, rollback, delsnapshot) exit 255 on
  failure like ``$upid_exit``;
- ``exec`` defaults to ``--keep-env 1`` (the caller's environment leaks in, as on real
  Proxmox before PVE 9, except PATH, which pct's CLI handler resets to
  /sbin:/bin:/usr/sbin:/usr/bin) and replaces itself with ``lxc-attach`` via execvp;
- snapshots need snapshot-capable storage: the btrfs storage has them, the ``dir`` storage
  refuses with "snapshot feature is not available".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE = Path(__file__).resolve().parent.parent
NODE = json.loads((STATE / "node.json").read_text()) if (STATE / "node.json").exists() else None

# The Proxmox VE releases the sim can be (`ctl sim up --pve VERSION`), each with the
# pve-manager and pve-container versions it shipped (pve-container's debian/changelog dates
# against the release dates) and a kernel of that release. pveversion's build hash is a
# placeholder, not pve-manager's real commit. What differs on the CLI surface we touch, by
# pve-container version (docs/sim.md cites each commit):
#   >= 5.0.9  `exec --keep-env` (default 1) and clean_environment()   069553d, 83f594f
#   >= 5.0.10 `stop --overrule-shutdown`                               d5fab92
# Before 5.0.9 pct exec ran `lxc-attach -n <id> -- <argv>` with no environment flag, so
# LXC's own default applies: keep the caller's environment (lxc tools/lxc_attach.c).
PVE_RELEASES = {
    "7.4": {"manager": "7.4-3", "container": "4.4-3", "kernel": "5.15.102-1-pve"},
    "8.1": {"manager": "8.1.3", "container": "5.0.8", "kernel": "6.5.11-4-pve"},
    "8.2": {"manager": "8.2.2", "container": "5.0.10", "kernel": "6.8.4-2-pve"},
    "9.1": {"manager": "9.1.1", "container": "6.0.18", "kernel": "6.17.2-1-pve"},
}
DEFAULT_PVE = "9.1"


def pve_release() -> dict:
    return PVE_RELEASES[(NODE or {}).get("pve") or DEFAULT_PVE]


def container_version() -> tuple[int, ...]:
    """pve-container's version as numbers: "4.4-3" → (4, 4, 3), "5.0.10" → (5, 0, 10)."""
    return tuple(int(x) for x in re.split(r"[.-]", pve_release()["container"]))


def has_keep_env() -> bool:
    return container_version() >= (5, 0, 9)

BOOLEANS = {"1": True, "0": False, "yes": True, "no": False, "true": True, "false": False,
            "on": True, "off": False}
# pve-configid, the format of pve-lxc-snapshot-name (pve-common JSONSchema.pm).
CONFIGID = re.compile(r"^[a-z][a-z0-9_-]+$", re.IGNORECASE)


class PctError(Exception):
    """Printed as-is to stderr; pct exits 255 (Perl's exit(-1))."""


class UsageError(PctError):
    pass


# --- Proxmox-style container config (/etc/pve/nodes/<node>/lxc/<vmid>.conf) -------------
def conf_path(vmid: int) -> Path:
    return Path(NODE["pve_lxc"]) / f"{vmid}.conf"


def _section() -> dict:
    return {"keys": {}, "lxc": [], "description": ""}


def parse_conf(text: str) -> dict:
    """{"keys", "lxc" (raw lxc.* lines in order), "description", "snapshots": {name: section}}"""
    conf = _section()
    conf["snapshots"] = {}
    cur = conf
    for line in text.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\[([^\]]+)\]\s*$", line)
        if m:
            cur = conf["snapshots"].setdefault(m.group(1), _section())
            continue
        if line.startswith("#"):
            cur["description"] += line[1:] + "\n"
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key.startswith("lxc."):
            cur["lxc"].append((key, value))
        else:
            cur["keys"][key] = value
    return conf


def _render_section(sec: dict) -> str:
    out = "".join(f"#{line}\n" for line in sec["description"].splitlines())
    out += "".join(f"{k}: {sec['keys'][k]}\n" for k in sorted(sec["keys"]))
    out += "".join(f"{k}: {v}\n" for k, v in sec["lxc"])
    return out


def render_conf(conf: dict) -> str:
    # Same order as PVE::LXC::Config::write_pct_config: main section, then snapshots by name.
    out = _render_section(conf)
    for name in sorted(conf["snapshots"]):
        out += f"\n[{name}]\n" + _render_section(conf["snapshots"][name])
    return out


def load_config(vmid: int) -> dict:
    path = conf_path(vmid)
    if not path.exists():
        # PVE::AbstractConfig::load_config; the path is relative to /etc/pve.
        raise PctError(f"Configuration file 'nodes/{NODE['name']}/lxc/{vmid}.conf' does not exist")
    return parse_conf(path.read_text())


def write_config(vmid: int, conf: dict) -> None:
    path = conf_path(vmid)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        fh.write(render_conf(conf))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def all_vmids() -> list[int]:
    d = Path(NODE["pve_lxc"])
    return sorted(int(p.stem) for p in d.glob("*.conf") if p.stem.isdigit())


# --- storage -----------------------------------------------------------------------------
def rootfs_volume(conf: dict) -> tuple[str, str]:
    """(storage id, volume name) of the rootfs, e.g. ("local-btrfs", "200/subvol-200-disk-0")."""
    volid = conf["keys"]["rootfs"].split(",", 1)[0]
    storage, _, volname = volid.partition(":")
    return storage, volname


def rootfs_dir(conf: dict) -> Path:
    storage, volname = rootfs_volume(conf)
    return Path(NODE["storages"][storage]["path"]) / "images" / volname


def snapshot_dir(conf: dict, snapname: str) -> Path:
    live = rootfs_dir(conf)
    return live.with_name(f"{live.name}@{snapname}")


def has_snapshot_feature(conf: dict) -> bool:
    storage, _ = rootfs_volume(conf)
    return NODE["storages"][storage]["type"] in ("btrfs", "zfspool", "lvmthin", "rbd")


# --- LXC ---------------------------------------------------------------------------------
def lxc(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([argv[0], "-P", NODE["lxcpath"], *argv[1:]], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise PctError(f"{argv[0]} failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc


def lxc_state(vmid: int) -> str:
    return lxc("lxc-info", "-n", str(vmid), "-s", "-H", check=False).stdout.decode().strip() or "STOPPED"


def check_running(vmid: int) -> bool:
    return lxc_state(vmid) in ("RUNNING", "FROZEN")


def lxc_pid(vmid: int) -> int | None:
    out = lxc("lxc-info", "-n", str(vmid), "-p", "-H", check=False).stdout.decode().strip()
    return int(out) if out.isdigit() else None


def vm_start(vmid: int) -> None:
    log = Path(NODE["log"]) / f"lxc-{vmid}.log"
    proc = subprocess.run(["lxc-start", "-P", NODE["lxcpath"], "-n", str(vmid), "-o", str(log), "-l", "ERROR"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise PctError(f"startup for container '{vmid}' failed")
    lxc("lxc-wait", "-n", str(vmid), "-s", "RUNNING", "-t", "10", check=False)


def vm_stop_kill(vmid: int) -> None:
    """PVE::LXC::vm_stop($vmid, 1): lxc-stop --kill. lxc-stop -k can return before the
    container is STOPPED, so wait for it (docs/research/sim-node.md)."""
    if lxc_state(vmid) == "FROZEN":
        lxc("lxc-unfreeze", "-n", str(vmid), check=False)
    lxc("lxc-stop", "-n", str(vmid), "--kill", check=False)
    lxc("lxc-wait", "-n", str(vmid), "-s", "STOPPED", "-t", "10", check=False)
    deadline = time.monotonic() + 10
    while check_running(vmid):
        if time.monotonic() > deadline:
            raise PctError(f"unable to stop container {vmid}")
        time.sleep(0.1)


def btrfs(*argv: str) -> None:
    proc = subprocess.run(["btrfs", "-q", *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise PctError(f"btrfs {argv[0]} {argv[1]} failed: {proc.stderr.decode(errors='replace').strip()}")


# --- commands ------------------------------------------------------------------------------
def cmd_list(args: dict) -> None:
    rows = []
    for vmid in all_vmids():
        conf = load_config(vmid)
        status = "running" if check_running(vmid) else "stopped"
        rows.append((vmid, status, conf["keys"].get("lock", ""), conf["keys"].get("hostname", f"CT{vmid}")))
    if not rows:
        return
    fmt = "%-10s %-10s %-12s %-20s"
    print(fmt % ("VMID", "Status", "Lock", "Name"))
    for row in rows:
        print(fmt % row)


def cmd_status(args: dict) -> None:
    vmid = args["vmid"]
    conf = load_config(vmid)
    running = check_running(vmid)
    if not args.get("verbose"):
        print(f"status: {'running' if running else 'stopped'}")
        return
    stat = {"vmid": vmid, "status": "running" if running else "stopped", "type": "lxc",
            "name": conf["keys"].get("hostname", f"CT{vmid}"), "cpus": conf["keys"].get("cores", 1),
            "maxmem": int(conf["keys"].get("memory", 512)) * 1024 * 1024,
            "maxswap": int(conf["keys"].get("swap", 512)) * 1024 * 1024, "uptime": 0}
    pid = lxc_pid(vmid) if running else None
    if pid:
        stat["pid"] = pid
        try:
            ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
            boot = float(Path("/proc/uptime").read_text().split()[0])
            stat["uptime"] = int(boot - ticks / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            pass
    for key in sorted(stat):
        print(f"{key}: {stat[key]}")


def cmd_start(args: dict) -> None:
    vmid = args["vmid"]
    load_config(vmid)
    if check_running(vmid):
        raise PctError(f"CT {vmid} already running")  # API2/LXC/Status.pm vm_start
    vm_start(vmid)


def cmd_stop(args: dict) -> None:
    vmid = args["vmid"]
    load_config(vmid)
    if not check_running(vmid):
        raise PctError(f"CT {vmid} not running")  # API2/LXC/Status.pm vm_stop
    vm_stop_kill(vmid)


def cmd_exec(args: dict) -> None:
    vmid = args["vmid"]
    load_config(vmid)  # test if container exists on this node
    if not check_running(vmid):
        raise PctError(f"container '{vmid}' not running!")
    if not args["extra-args"]:
        raise PctError("missing command")
    argv = ["lxc-attach", "-P", NODE["lxcpath"], "-n", str(vmid)]
    if has_keep_env():
        # clean_environment(): the only host variables pct drops.
        for var in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
            os.environ.pop(var, None)
        argv.append("--keep-env" if args.get("keep-env", True) else "--clear-env")
    argv += ["--", *args["extra-args"]]
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def cmd_snapshot(args: dict) -> None:
    vmid, snapname = args["vmid"], args["snapname"]
    if snapname in ("current", "vzdump"):
        raise PctError(f"unable to use snapshot name '{snapname}' (reserved name)")
    conf = load_config(vmid)
    # AbstractConfig::__snapshot_prepare
    if conf["keys"].get("lock"):
        raise PctError(f"CT is locked ({conf['keys']['lock']})")
    if snapname in conf["snapshots"]:
        raise PctError(f"snapshot name '{snapname}' already used")
    if not has_snapshot_feature(conf):
        raise PctError("snapshot feature is not available")
    running = check_running(vmid)
    # A running CT is frozen for the volume snapshot (__snapshot_check_freeze_needed).
    if running:
        lxc("lxc-freeze", "-n", str(vmid))
    try:
        btrfs("subvolume", "snapshot", "-r", str(rootfs_dir(conf)), str(snapshot_dir(conf, snapname)))
    finally:
        if running:
            lxc("lxc-unfreeze", "-n", str(vmid), check=False)
    snap = {"keys": dict(conf["keys"]), "lxc": list(conf["lxc"]), "description": ""}
    snap["keys"].pop("lock", None)
    snap["keys"]["snaptime"] = str(int(time.time()))
    if args.get("description"):
        snap["description"] = args["description"] + "\n"
    conf["snapshots"][snapname] = snap
    conf["keys"]["parent"] = snapname
    write_config(vmid, conf)


def cmd_listsnapshot(args: dict) -> None:
    """PVE::GuestHelpers::print_snapshot_tree over the Snapshot API's list (plus 'current')."""
    vmid = args["vmid"]
    conf = load_config(vmid)
    items = {}
    for name, sec in conf["snapshots"].items():
        items[name] = {"snaptime": int(sec["keys"].get("snaptime", 0)), "parent": sec["keys"].get("parent"),
                       "description": sec["description"].strip()}
    items["current"] = {"snaptime": None, "parent": conf["keys"].get("parent"), "description": "You are here!"}
    children: dict[str, list[str]] = {}
    roots = []
    for name, item in items.items():
        parent = item["parent"]
        if parent and parent in items:
            children.setdefault(parent, []).append(name)
        else:
            roots.append(name)

    def order(name: str):  # by snaptime, 'current' (no snaptime) last
        t = items[name]["snaptime"]
        return (1, 0) if t is None else (0, t)

    def show(prefix: str, name: str) -> None:
        item = items[name]
        description = (item["description"] or "no-description").splitlines()[0]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item["snaptime"])) \
            if item["snaptime"] is not None else ""
        width = max(30 - len(prefix), 0)
        print(f"{prefix} {name:<{width}} {when:<23} {description}")
        for child in sorted(children.get(name, []), key=order):
            show(" " + prefix, child)

    for root in sorted(roots, key=order):
        show("`->", root)


def cmd_rollback(args: dict) -> None:
    vmid, snapname = args["vmid"], args["snapname"]
    conf = load_config(vmid)
    snap = conf["snapshots"].get(snapname)
    if snap is None:
        raise PctError(f"snapshot '{snapname}' does not exist")
    if not has_snapshot_feature(conf):
        raise PctError("snapshot feature is not available")
    # __snapshot_rollback_vm_stop: a running CT is hard-stopped, no graceful timeout.
    if check_running(vmid):
        vm_stop_kill(vmid)
    live = rootfs_dir(conf)
    btrfs("subvolume", "delete", str(live))
    btrfs("subvolume", "snapshot", str(snapshot_dir(conf, snapname)), str(live))
    restored = {k: v for k, v in snap["keys"].items() if k not in ("snaptime", "parent")}
    conf["keys"] = dict(restored, parent=snapname)
    conf["lxc"] = list(snap["lxc"])
    write_config(vmid, conf)
    if args.get("start"):
        vm_start(vmid)


def cmd_delsnapshot(args: dict) -> None:
    vmid, snapname = args["vmid"], args["snapname"]
    conf = load_config(vmid)
    snap = conf["snapshots"].get(snapname)
    if snap is None:
        raise PctError(f"snapshot '{snapname}' does not exist")
    path = snapshot_dir(conf, snapname)
    if path.exists():
        btrfs("subvolume", "delete", str(path))
    parent = snap["keys"].get("parent")
    # AbstractConfig::snapshot_delete: children (and the current state) inherit the parent.
    for sec in [conf, *conf["snapshots"].values()]:
        if sec["keys"].get("parent") == snapname:
            if parent:
                sec["keys"]["parent"] = parent
            else:
                sec["keys"].pop("parent", None)
    del conf["snapshots"][snapname]
    write_config(vmid, conf)


def cmd_config(args: dict) -> None:
    conf = load_config(args["vmid"])
    keys = dict(conf["keys"])
    if conf["description"]:
        keys["description"] = conf["description"].rstrip("\n")
    for key in sorted(keys):
        value = keys[key]
        if key == "description":  # PVE::Tools::encode_text
            value = value.replace("%", "%25").replace("\n", "%0A")
        print(f"{key}: {value}")
    for key, value in conf["lxc"]:
        print(f"{key}: {value}")


def _attach_shell(vmid: int, script: str, *params: str, stdin=None, stdout=None) -> subprocess.CompletedProcess:
    # Files are opened inside the container's namespaces (as pct does with setns), so a
    # symlink in the container cannot point outside it.
    return subprocess.run(["lxc-attach", "-P", NODE["lxcpath"], "-n", str(vmid), "--clear-env", "--",
                           "/bin/sh", "-c", script, "sh", *params],
                          stdin=stdin if stdin is not None else subprocess.DEVNULL,
                          stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.PIPE)


def _perms(args: dict) -> str | None:
    perms = args.get("perms")
    if perms is None:
        return None
    try:
        return "%o" % int(perms, 16 if perms.lower().startswith("0x") else 8)
    except ValueError:
        raise PctError(f"invalid mode: '{perms}'") from None


def cmd_push(args: dict) -> None:
    vmid = args["vmid"]
    if not check_running(vmid):
        load_config(vmid)
        raise PctError("can only push files to a running CT")
    load_config(vmid)
    perms = _perms(args)
    try:
        src = open(args["file"], "rb")
    except OSError:
        raise PctError(f"failed to open {args['file']} for reading") from None
    with src:
        proc = _attach_shell(vmid, 'cat > "$1" || exit 1; [ -z "$2" ] || chmod "$2" "$1"',
                             args["destination"], perms or "", stdin=src)
    if proc.returncode != 0:
        raise PctError(f"failed to create file: {args['destination']}: "
                       f"{proc.stderr.decode(errors='replace').strip()}")


def cmd_pull(args: dict) -> None:
    vmid = args["vmid"]
    if not check_running(vmid):
        load_config(vmid)
        raise PctError("can only pull files from a running VM")
    perms = _perms(args)
    dest = Path(args["destination"])
    try:
        out = open(dest, "wb")
    except OSError as exc:
        raise PctError(f"failed to create file: {dest}: {exc.strerror}") from None
    with out:
        proc = _attach_shell(vmid, 'exec cat -- "$1"', args["path"], stdout=out)
    if proc.returncode != 0:
        raise PctError(f"failed to open {args['path']}: No such file or directory")
    if perms:
        os.chmod(dest, int(perms, 8))


# name: (positional parameter names, {option: type}, handler). Types: bool, str. The options
# a release lacks are removed by commands() below.
ALL_COMMANDS = {
    "list": ([], {}, cmd_list),
    "status": (["vmid"], {"verbose": bool}, cmd_status),
    "start": (["vmid"], {"skiplock": bool, "debug": bool}, cmd_start),
    "stop": (["vmid"], {"skiplock": bool, "overrule-shutdown": bool}, cmd_stop),
    "exec": (["vmid", "extra-args"], {"keep-env": bool}, cmd_exec),
    "snapshot": (["vmid", "snapname"], {"description": str}, cmd_snapshot),
    "listsnapshot": (["vmid"], {}, cmd_listsnapshot),
    "rollback": (["vmid", "snapname"], {"start": bool}, cmd_rollback),
    "delsnapshot": (["vmid", "snapname"], {"force": bool}, cmd_delsnapshot),
    "config": (["vmid"], {"current": bool, "snapshot": str}, cmd_config),
    "push": (["vmid", "file", "destination"], {"perms": str, "user": str, "group": str}, cmd_push),
    "pull": (["vmid", "path", "destination"], {"perms": str, "user": str, "group": str}, cmd_pull),
}


COMMANDS = ALL_COMMANDS  # main() narrows it to the node's release


def commands() -> dict:
    """The command table of this node's pve-container version."""
    table = {name: (pos, dict(opts), fn) for name, (pos, opts, fn) in ALL_COMMANDS.items()}
    if not has_keep_env():
        del table["exec"][1]["keep-env"]
    if container_version() < (5, 0, 10):
        del table["stop"][1]["overrule-shutdown"]
    return table


# Option descriptions for `pct help <command>` (pct.pm's parameter descriptions).
OPTION_HELP = {
    ("exec", "keep-env"): ("<boolean>   (default = 1)", "Keep the current environment. This option will disabled by "
                           "default with PVE 9. If you rely on a preserved environment, please use this option to "
                           "be future-proof."),
    ("stop", "overrule-shutdown"): ("<boolean>   (default = 0)", "Try to abort active 'vzshutdown' tasks before "
                                    "stopping."),
}
DESCRIPTIONS = {"exec": "Launch a command inside the specified container.",
                "stop": "Stop the container. This will abruptly stop all processes running in the container.",
                "status": "Get virtual machine status.", "start": "Start the container."}


def verbose_usage(name: str) -> str:
    """`pct help <command>`: PVE::RESTHandler's verbose usage, in its layout."""
    positional, options, _ = COMMANDS[name]
    lines = [f"USAGE: {usage(name)}", ""]
    if name in DESCRIPTIONS:
        lines += [f"  {DESCRIPTIONS[name]}", ""]
    for pname in positional:
        kind = "<array>" if pname == "extra-args" else ("<integer> (100 - 999999999)" if pname == "vmid" else "<string>")
        lines += [f"  <{pname}>: {kind}", ""]
    for opt in sorted(options):
        kind, text = OPTION_HELP.get((name, opt), ("<boolean>" if options[opt] is bool else "<string>", ""))
        lines += [f"  --{opt} {kind}", ""] + ([f"             {text}", ""] if text else [])
    return "\n".join(lines)


def pveversion_main(argv: list[str]) -> int:
    """`pveversion`: ``pve-manager/<version>/<build> (running kernel: <kernel>)``; -v lists the
    packages, pve-container among them."""
    rel = pve_release()
    print(f"pve-manager/{rel['manager']}/0123456789abcdef (running kernel: {rel['kernel']})")
    if argv[:1] in (["-v"], ["--verbose"]):
        print(f"proxmox-ve: {rel['manager'].split('-')[0].rsplit('.', 1)[0]}.0 (running kernel: {rel['kernel']})")
        print(f"pve-container: {rel['container']}")
    return 0


def parse(name: str, argv: list[str]) -> dict:
    """Getopt::Long as PVE::CLIHandler uses it: options anywhere before ``--``, ``--opt v``,
    ``--opt=v`` or ``-opt v``; a boolean may stand alone; everything after ``--`` is extra-args."""
    positional_names, options, _ = COMMANDS[name]
    args: dict = {}
    positional: list[str] = []
    extra: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            extra = argv[i + 1:]
            break
        if arg.startswith("-") and len(arg) > 1 and not arg.lstrip("-").isdigit():
            key, eq, value = arg.lstrip("-").partition("=")
            if key not in options:
                raise UsageError(f"Unknown option: {key}\n400 unable to parse option")
            if options[key] is bool:
                if not eq:
                    nxt = argv[i + 1] if i + 1 < len(argv) else None
                    if nxt is not None and nxt.lower() in BOOLEANS:
                        value, i = nxt, i + 1
                    else:
                        value = "1"
                if value.lower() not in BOOLEANS:
                    raise UsageError(f"400 Parameter verification failed.\n{key}: type check ('boolean') "
                                     f"failed - got '{value}'")
                args[key] = BOOLEANS[value.lower()]
            else:
                if not eq:
                    if i + 1 >= len(argv):
                        raise UsageError(f"Option {key} requires an argument\n400 unable to parse option")
                    value, i = argv[i + 1], i + 1
                args[key] = value
        else:
            positional.append(arg)
        i += 1
    wants_extra = "extra-args" in positional_names
    fixed = [p for p in positional_names if p != "extra-args"]
    if len(positional) < len(fixed):
        raise UsageError("400 not enough arguments")
    if len(positional) > len(fixed):
        if not wants_extra:
            raise UsageError("400 too many arguments")
        extra = positional[len(fixed):] + extra
    for pname, value in zip(fixed, positional):
        args[pname] = value
    if wants_extra:
        args["extra-args"] = extra
    if "vmid" in args:
        raw = args["vmid"]
        # pve-common PVE/JSONSchema.pm: check_type's is_integer, then the pve-vmid format
        # (^[1-9][0-9]{2,8}$) before any minimum/maximum, so 5, -5, 0100 and 10 digits all fail there
        if not re.fullmatch(r"[+-]?\d+", raw):
            raise UsageError(f"400 Parameter verification failed.\nvmid: type check ('integer') failed - got '{raw}'")
        if not re.fullmatch(r"[1-9][0-9]{2,8}", raw):
            raise UsageError("400 Parameter verification failed.\nvmid: invalid format - value does not look like a "
                             "valid VM ID")
        args["vmid"] = int(raw)
    if "snapname" in args and (not CONFIGID.match(args["snapname"]) or len(args["snapname"]) > 40):
        raise UsageError(f"400 Parameter verification failed.\nsnapname: invalid format - "
                         f"invalid configuration ID '{args['snapname']}'")
    return args


def usage(name: str) -> str:
    positional, options, _ = COMMANDS[name]
    pos = " ".join(f"<{p}>" for p in positional if p != "extra-args")
    if "extra-args" in positional:
        pos += " [<extra-args>]"
    opts = " [OPTIONS]" if options else ""
    return f"pct {name} {pos}{opts}".replace("  ", " ")


# PVE::CLIHandler::run_cli_handler (and older src/pct) set this before anything runs: pct
# is a taint-mode Perl script. So a `pct exec --keep-env 1` child sees this PATH, not the
# caller's, while every other variable of the caller (SSH_*, PERL5LIB, ...) leaks through.
CLI_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"


def _log_call(argv: list[str]) -> None:
    """One line per call in <state>/log/pct-calls.log, so tests can count what the controller
    asked of the node (e.g. that it probes `pct help exec` once per connection)."""
    try:
        with open(Path(NODE["log"]) / "pct-calls.log", "a") as fh:
            fh.write(json.dumps({"ts": time.time(), "prog": Path(sys.argv[0]).name, "argv": argv[:3]}) + "\n")
    except (OSError, KeyError):
        pass


def main(argv: list[str]) -> int:
    global COMMANDS
    os.environ["PATH"] = CLI_PATH
    if NODE is None:
        print(f"pct: {STATE / 'node.json'} is missing; run `ctl sim up`", file=sys.stderr)
        return 255
    COMMANDS = commands()
    _log_call(argv)
    if Path(sys.argv[0]).name == "pveversion":
        return pveversion_main(argv)
    if len(argv) == 2 and argv[0] == "help" and argv[1] in COMMANDS:
        print(verbose_usage(argv[1]))
        return 0
    if not argv or argv[0] in ("help", "-h", "--help"):
        print("USAGE: pct <COMMAND> [ARGS] [OPTIONS]")
        for name in sorted(COMMANDS):
            print(f"       {usage(name)}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"ERROR: unknown command 'pct {name}'", file=sys.stderr)
        print("USAGE: pct <COMMAND> [ARGS] [OPTIONS]", file=sys.stderr)
        return 255
    try:
        args = parse(name, argv[1:])
        COMMANDS[name][2](args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        print(f"USAGE: {usage(name)}", file=sys.stderr)
        return 255
    except PctError as exc:
        print(exc, file=sys.stderr)
        return 255
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
