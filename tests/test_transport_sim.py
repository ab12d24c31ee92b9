"""The controller's path into a container, end to end on the simulated node: real sshd with a
polluted root login, the pct emulation, real LXC containers (fixtures in tests/conftest.py).

Each test names the behaviour it protects; the `ctl` CLI is run as a real subprocess where the
operator's view matters (exit codes, one-line errors)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from controller import config as cfg
from controller.agentcall import AgentCaller
from controller.bundle import build as build_bundle, remote_path, upload_argv
from controller.container import AgentError, Container, ContainerError
from controller.pct import container_env, raw_exec_argv
from controller.ssh import SSHRunner

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]
CT = 200
# Prints each argument as the hex of its bytes: byte-exact, whatever the terminal or locale.
ECHO_ARGV = ["python3", "-c", "import json,os,sys; print(json.dumps([os.fsencode(a).hex() for a in sys.argv[1:]]))"]
# Every process a test starts in a container carries this, so leftovers can be found.
TAG = f"ctl-transport-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def node(sim_node, ctl_config):
    name, node_conf = cfg.load(ctl_config).node("sim")
    return name, node_conf


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch, ctl_config):
    # Every test (and every `ctl` subprocess) uses the sim's config and no ~/.ssh/config.
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", "none")


@pytest.fixture(scope="module")
def runner(node):
    with SSHRunner.for_node(*node) as r:
        yield r


@pytest.fixture(scope="module")
def ct(runner, node):
    return Container(runner, node[0], node[1], CT)


def ctl(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, DFLASH_CTL_SSH_CONFIG="none", **(env or {}))
    return subprocess.run([*CTL, *args], capture_output=True, env=full_env, cwd=str(REPO), **kw)


# --- the environment ---------------------------------------------------------------------

def test_ctl_env_shows_exactly_the_product_variables_while_raw_pct_exec_is_polluted(runner, node, ct):
    proc = ctl("env", "--container", str(CT))
    assert proc.returncode == 0, proc.stderr
    got = dict(line.split("=", 1) for line in proc.stdout.decode().splitlines())
    assert got == container_env(ct.config)
    assert not any(k.startswith("SSH_") for k in got)
    assert "homebrew" not in got["PATH"] and "perl5" not in got["PATH"]

    # The same node, the same container, plain `pct exec` (keep-env defaults to 1): the login's
    # exports and the SSH session leak in. (pct resets PATH itself, like PVE's CLI handler;
    # the login PATH with Homebrew and perl5 is what the node's shell has.)
    raw = dict(line.split("=", 1) for line in
               runner.run(raw_exec_argv(node[1], CT, ["env"]), check=True).stdout.splitlines() if "=" in line)
    assert raw["PERL5LIB"].startswith("/root/perl5") and raw["JAVA_HOME"].startswith("/opt/homebrew")
    assert "SSH_CONNECTION" in raw and "SSH_CLIENT" in raw
    login_path = runner.run(["sh", "-c", 'echo "$PATH"'], check=True).stdout
    assert login_path.startswith("/opt/homebrew/opt/openjdk/bin:/root/perl5/bin")


def test_login_noise_never_reaches_ctl_exec_output():
    proc = ctl("exec", "--container", str(CT), "--", "echo", "only this")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"only this\n", b"")


# --- arguments -------------------------------------------------------------------------------

HOSTILE = ["'", '"', "`", "$", "$(", ")", "${HOME}", "$(id)", "`id`", "*", "?", "[a]", "{a,b}", "~", "~root",
           "\\", ";", "&", "&&", "|", "<", ">", "!", "#", " ", "\t", "\n", "\r", "\r\n", "é", "日本語", "🚀",
           "\u200b", "\x01", "\x1b[31m", "-n", "--", "-e", "=", "a=b", "%s", "%n", "\\n", "'\"'\"'"]


def random_argv(rng: random.Random) -> list[str]:
    args = []
    for _ in range(rng.randint(0, 8)):
        kind = rng.random()
        if kind < 0.1:
            args.append("")
        elif kind < 0.7:
            args.append("".join(rng.choice(HOSTILE) for _ in range(rng.randint(1, 6))))
        else:
            args.append("".join(chr(rng.choice([rng.randint(1, 0x7F), rng.randint(0xA0, 0xD7FF),
                                                 rng.randint(0xE000, 0x10FFFF)]))
                                for _ in range(rng.randint(1, 12))))
    return args


def test_200_random_argv_lists_reach_the_container_byte_for_byte(ct):
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(20261129)
    cases = [random_argv(rng) for _ in range(200)]

    def echo(argv):
        result = ct.exec([*ECHO_ARGV, *argv], check=True)
        return [bytes.fromhex(h) for h in json.loads(result.stdout)]

    # Four channels at a time over the one connection: the runner is shared between threads.
    ct.runner.connect()
    opened = ct.runner.connections
    with ThreadPoolExecutor(4) as pool:
        for i, (argv, got) in enumerate(zip(cases, pool.map(echo, cases))):
            assert got == [a.encode() for a in argv], f"case {i}: {argv!r}"
    assert ct.runner.connections == opened


def test_hostile_argv_through_the_ctl_cli_byte_for_byte():
    rng = random.Random(7)
    for _ in range(5):
        argv = random_argv(rng) + ["$(touch /tmp/PWNED-ctl)", "*", "a\nb"]
        proc = ctl("exec", "--container", str(CT), "--", *ECHO_ARGV, *argv)
        assert proc.returncode == 0, proc.stderr
        assert [bytes.fromhex(h) for h in json.loads(proc.stdout)] == [a.encode() for a in argv]


# --- streams, exit codes, signals -------------------------------------------------------------

BIG = ("import sys\nblock = b'z' * 65535 + b'\\n'\n"
       "for i in range(800):\n    sys.stdout.buffer.write(block)\n    sys.stderr.buffer.write(block)\n")


def test_50mb_on_stdout_and_stderr_at_once_streams_through_pct_exec(ct):
    counts = {"out": 0, "err": 0}
    result = ct.exec(["python3", "-c", BIG, TAG], capture=False,
                     on_stdout=lambda _l: counts.__setitem__("out", counts["out"] + 1),
                     on_stderr=lambda _l: counts.__setitem__("err", counts["err"] + 1))
    assert result.ok and counts == {"out": 800, "err": 800}


def test_50mb_on_both_streams_through_the_ctl_cli():
    proc = ctl("exec", "--container", str(CT), "--", "python3", "-c", BIG, TAG)
    assert proc.returncode == 0
    assert len(proc.stdout) == len(proc.stderr) == 800 * 65536
    assert proc.stdout == proc.stderr == (b"z" * 65535 + b"\n") * 800


@pytest.mark.parametrize("script, code", [("exit 0", 0), ("exit 42", 42), ("kill -TERM $$", 143),
                                          ("kill -KILL $$", 137), ("kill -INT $$", 130)])
def test_exit_codes_and_signals_propagate_through_ctl_exec(script, code):
    proc = ctl("exec", "--container", str(CT), "--", "sh", "-c", script, TAG)
    assert proc.returncode == code, proc.stderr


def test_ctl_exec_into_a_pipe_that_closes_early_is_quiet():
    import shlex

    ctl_argv = [*CTL, "exec", "--container", str(CT), "--", "python3", "-c", "print('y' * 20_000_000)"]
    proc = subprocess.run(["bash", "-c", shlex.join(ctl_argv) + " | head -c 5"], capture_output=True,
                          cwd=str(REPO), env=dict(os.environ, DFLASH_CTL_SSH_CONFIG="none"))
    assert proc.stdout == b"yyyyy"
    assert b"Traceback" not in proc.stderr and b"Exception" not in proc.stderr, proc.stderr


def test_missing_program_in_the_container_exits_127():
    proc = ctl("exec", "--container", str(CT), "--", "no-such-program-xyz")
    assert proc.returncode == 127 and b"no-such-program-xyz" in proc.stderr


def test_options_after_the_command_go_to_the_command():
    proc = ctl("exec", "--container", str(CT), "ls", "-d", "/")
    assert (proc.returncode, proc.stdout) == (0, b"/\n")


# --- containers that are not there --------------------------------------------------------------

def one_line_error(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.decode()
    assert "Traceback" not in err
    lines = [l for l in err.splitlines() if l.startswith("ctl: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_unknown_container_is_named_clearly():
    # exit 2, bad input (controller/exitcodes.py): 1 would read as "the run failed"
    for args in (("exec", "--container", "999", "--", "true"), ("env", "--container", "999"),
                 ("status", "--container", "999")):
        proc = ctl(*args)
        assert proc.returncode == 2, (args, proc.returncode)
        assert "container 999 does not exist on node sim" in one_line_error(proc)


def test_stopped_container_is_named_with_how_to_start_it(stopped_ctid):
    proc = ctl("exec", "--container", str(stopped_ctid), "--", "true")
    assert proc.returncode == 1
    line = one_line_error(proc)
    assert f"container {stopped_ctid} on node sim is stopped: start it with `" in line
    assert f" start {stopped_ctid}`" in line


@pytest.fixture
def stopped_ctid(runner, node):
    """A stopped container: 201 when the sim left it stopped, else a config-only container
    (a Proxmox .conf with no running LXC behind it), removed afterwards."""
    if Container(runner, node[0], node[1], 201).status() == "stopped":
        yield 201
        return
    from sim.layout import NodePaths

    ctid = 299
    conf = NodePaths.for_node("sim").pve_conf(ctid)
    assert not conf.exists()
    conf.write_text("arch: amd64\nhostname: ct299\nostype: debian\nrootfs: local:299/subvol-299-disk-0,size=1G\n")
    try:
        yield ctid
    finally:
        conf.unlink()


def test_bad_config_is_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[nodes.x]\nhost = 'h'\nport = 'not a port'\n")
    proc = ctl("exec", "--config", str(bad), "--container", "200", "--", "true")
    assert proc.returncode == 2
    assert "nodes.x.port" in one_line_error(proc)


# --- host keys, through the CLI --------------------------------------------------------------

def config_with_known_hosts(tmp_path: Path, node, known: Path) -> Path:
    conf = cfg.Config(nodes={"sim": dataclasses.replace(node[1], known_hosts=str(known))})
    return cfg.save(conf, tmp_path / "config.toml")


def test_unknown_host_key_is_refused_until_trusted_explicitly(tmp_path, node):
    known = tmp_path / "known_hosts"
    path = config_with_known_hosts(tmp_path, node, known)
    proc = ctl("exec", "--config", str(path), "--container", str(CT), "--", "true")
    assert proc.returncode == 255
    assert "--trust-new-host-key" in one_line_error(proc) and not known.exists()
    proc = ctl("exec", "--config", str(path), "--container", str(CT), "--trust-new-host-key", "--", "true")
    assert proc.returncode == 0 and b"recorded the host key" in proc.stderr
    proc = ctl("exec", "--config", str(path), "--container", str(CT), "--", "true")
    assert (proc.returncode, proc.stderr) == (0, b"")


def test_changed_host_key_is_refused_even_with_the_trust_flag(tmp_path, node):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, blob = (tmp_path / "other.pub").read_text().split()[:2]
    real = Path(node[1].known_hosts).read_text().split()[0]
    known = tmp_path / "known_hosts"
    known.write_text(f"{real} {kind} {blob}\n")
    path = config_with_known_hosts(tmp_path, node, known)
    proc = ctl("exec", "--config", str(path), "--container", str(CT), "--trust-new-host-key", "--", "true")
    assert proc.returncode == 255
    assert "CHANGED" in one_line_error(proc)
    assert known.read_text() == f"{real} {kind} {blob}\n"


# --- files and the bundle ------------------------------------------------------------------------

class BreaksAfter:
    """stdin that delivers ``n`` bytes and then fails, like an operator's Ctrl-C mid-upload."""

    def __init__(self, data: bytes, n: int):
        self.data, self.n, self.pos = data, n, 0

    def read(self, size: int) -> bytes:
        if self.pos >= self.n:
            raise KeyboardInterrupt
        chunk = self.data[self.pos:min(self.pos + size, self.n)]
        self.pos += len(chunk)
        return chunk


def wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def listing(ct: Container, directory: str) -> list[str]:
    """Entries of ``directory`` in the container ([] when it does not exist)."""
    return ct.exec(["find", directory, "-mindepth", "1", "-maxdepth", "1", "-printf", "%f\\n"]).stdout.splitlines()


@pytest.fixture
def scratch(ct):
    directory = f"/tmp/{TAG}-{uuid.uuid4().hex[:6]}"
    ct.exec(["mkdir", "-p", directory], check=True)
    yield directory
    ct.exec(["rm", "-rf", directory], check=True)


def test_write_file_is_atomic_and_keeps_content_and_mode(ct, scratch):
    path = f"{scratch}/it's a \"file\" $(x)"
    data = os.urandom(3 << 20)
    ct.write_file(path, data, mode=0o640)
    assert ct.read_file(path) == data
    assert ct.exec(["stat", "-c", "%a", path], check=True).stdout.strip() == "640"
    ct.write_file(path, b"second", mode=0o600)
    assert ct.read_file(path) == b"second"
    assert listing(ct, scratch) == [path.rsplit("/", 1)[1]]  # one file, no temp left


def test_killed_upload_leaves_the_old_file_and_no_temp_file(ct, scratch):
    path = f"{scratch}/config.json"
    ct.write_file(path, b"old content")
    data = os.urandom(4 << 20)
    with pytest.raises(KeyboardInterrupt):
        ct.exec(ct.write_argv(path, data), stdin=BreaksAfter(data, 1 << 20))
    assert wait_until(lambda: listing(ct, scratch) == ["config.json"]), listing(ct, scratch)
    assert ct.read_file(path) == b"old content"


def test_killed_upload_of_a_new_file_leaves_nothing(ct, scratch):
    path = f"{scratch}/new.bin"
    data = os.urandom(4 << 20)
    with pytest.raises(KeyboardInterrupt):
        ct.exec(ct.write_argv(path, data), stdin=BreaksAfter(data, 2 << 20))
    assert wait_until(lambda: listing(ct, scratch) == [])


def test_truncated_upload_is_detected_and_not_renamed_into_place(ct, scratch):
    # A dropped connection gives the receiving cat an early EOF, not an error: the size and
    # hash check is what keeps the half file from being renamed into place.
    path = f"{scratch}/weights.bin"
    data = os.urandom(1 << 20)
    result = ct.exec(ct.write_argv(path, data), stdin=data[: len(data) // 2])
    assert result.failed and "incomplete" in result.stderr
    assert listing(ct, scratch) == []


def test_write_to_a_missing_directory_names_the_file_and_container(ct):
    with pytest.raises(ContainerError, match=r"cannot write /no/such/dir/f in container 200 on node sim"):
        ct.write_file("/no/such/dir/f", b"x")


def test_bundle_is_uploaded_once_and_importable(ct, runner, scratch, tmp_path):
    tmp_root = tmp_path / "bundle-src"
    for pkg in ("agent", "trainer"):
        (tmp_root / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_root / pkg / "__init__.py").write_text(f"MARK = {TAG!r}\n")
    bundle = build_bundle(root=tmp_root)
    fresh = Container(runner, ct.node_name, ct.node, ct.ctid)
    fresh.config = dataclasses.replace(ct.config, workspace=scratch)
    path = AgentCaller(fresh, bundle=bundle).ensure_bundle()
    assert path == remote_path(scratch, bundle.version) == f"{scratch}/.dflash-ctl/bundles/{bundle.version}"
    assert fresh.read_file(f"{path}/VERSION") == bundle.version.encode() + b"\n"
    out = fresh.exec(["python3", "-c", "import agent, trainer; print(agent.MARK, trainer.MARK)"],
                     env={"PYTHONPATH": path}, check=True).stdout
    assert out == f"{TAG} {TAG}\n"
    stamp = fresh.exec(["stat", "-c", "%Y.%i", path], check=True).stdout
    assert AgentCaller(fresh, bundle=bundle).ensure_bundle() == path
    assert fresh.exec(["stat", "-c", "%Y.%i", path], check=True).stdout == stamp
    assert listing(fresh, f"{scratch}/.dflash-ctl/bundles") == [bundle.version]


FAKE_AGENT = """
import sys
from agent.protocol import wrap_payload
print("noise a login file or library printed first")
print("more noise", file=sys.stderr)
verb, args = sys.argv[1], sys.argv[2:]
if verb == "fail":
    sys.stdout.write(wrap_payload({"error": "run r1 does not exist"}))
    sys.exit(3)
if verb == "crash":
    raise SystemExit("agent exploded before replying")
sys.stdout.write(wrap_payload({"verb": verb, "args": args}))
print("trailing noise")
"""


def test_agent_call_parses_the_sentinel_payload_through_noise(ct, runner, scratch, tmp_path):
    root = tmp_path / "agent-src"
    (root / "agent").mkdir(parents=True, exist_ok=True)
    (root / "trainer").mkdir(parents=True, exist_ok=True)
    (root / "agent" / "__init__.py").write_text("")
    (root / "agent" / "__main__.py").write_text(FAKE_AGENT)
    for name in ("protocol.py", "records.py"):  # the protocol and what it imports
        (root / "agent" / name).write_bytes((REPO / "agent" / name).read_bytes())
    (root / "trainer" / "__init__.py").write_text("")
    fresh = Container(runner, ct.node_name, ct.node, ct.ctid)
    fresh.config = dataclasses.replace(ct.config, workspace=scratch)
    caller = AgentCaller(fresh, bundle=build_bundle(root=root))
    weird = ["it's", "$(id)", "a\nb", ""]
    reply = caller.call("agent", ["status", *weird], check=True)
    assert reply["verb"] == "status" and reply["args"] == weird
    with pytest.raises(AgentError, match="agent fail in container 200 on node sim failed .*run r1 does not exist"):
        caller.call("agent", ["fail"], check=True)
    with pytest.raises(AgentError, match="(?s)gave no readable reply.*agent exploded"):
        caller.call("agent", ["crash"], check=True)


def test_killed_bundle_upload_never_looks_complete(ct, scratch):
    bundle = build_bundle()
    data = bundle.tar()
    dest = f"{scratch}/.dflash-ctl/bundles/{bundle.version}"
    with pytest.raises(KeyboardInterrupt):
        ct.exec(upload_argv(dest, data), stdin=BreaksAfter(data, len(data) // 2))
    assert wait_until(lambda: listing(ct, f"{scratch}/.dflash-ctl/bundles") == [])


def test_this_checkouts_bundle_runs_the_agent_package(ct):
    caller = AgentCaller(ct)
    caller.ensure_bundle()
    out = ct.exec([ct.config.python, "-c", "import agent.protocol as p; print(p.PROTOCOL_VERSION)"],
                  env=caller.env(), check=True).stdout
    from agent.protocol import PROTOCOL_VERSION

    assert out.strip() == str(PROTOCOL_VERSION)


def test_hostile_start_script_uploaded_and_run_in_the_container_interprets_nothing(ct, scratch):
    from controller.render import render_start_script, start_env
    from trainer import flags as F

    pwned = f"{scratch}/PWNED"
    fake_python = ("#!/usr/bin/python3\nimport json, os, sys\n"
                   "open(os.path.join(os.getcwd(), 'dump.json'), 'w').write("
                   "json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    container = dataclasses.replace(ct.config, venv=f"{scratch}/venv")
    ct.exec(["mkdir", "-p", f"{scratch}/venv/bin"], check=True)
    ct.write_file(f"{scratch}/venv/bin/python3", fake_python, mode=0o755)
    run_dir = f"{scratch}/run 'x' $(touch {pwned})"
    ct.exec(["mkdir", "-p", run_dir], check=True)
    values = F.defaults()
    values.update(target_model=f"/m/$(touch {pwned})", data_dir=f"`touch {pwned}`", output_dir="/o/*",
                  target_gpus=(0,), drafter_gpus=(0,), from_scratch=True,
                  wandb_run_name=f"run\nname; touch {pwned} 'q' \"d\" $HOME")
    run_id = f"r1 $(touch {pwned})"
    script = render_start_script(values, container=container, bundle=f"{scratch}/bundle", run_id=run_id,
                                 run_dir=run_dir, secrets_file=f"{scratch}/no-secrets")
    ct.write_file(f"{run_dir}/start.sh", script, mode=0o755)
    assert ct.exec(["bash", "-n", f"{run_dir}/start.sh"]).ok
    ct.exec(["bash", f"{run_dir}/start.sh"], check=True)
    dump = json.loads(ct.read_file(f"{run_dir}/dump.json"))
    assert dump["argv"] == ["-m", "trainer", *F.to_argv(values)]
    assert dump["env"] == start_env(container, bundle=f"{scratch}/bundle", run_id=run_id, run_dir=run_dir)
    assert not ct.exec(["test", "-e", pwned]).ok


def test_a_local_transport_node_takes_the_same_path(sim_node, tmp_path, ct):
    # ctl running on the node itself (transport = "local"): no SSH, same pct exec + env -i.
    local = cfg.NodeConfig(host="localhost", transport="local", pct=str(sim_node.paths.pct),
                           containers={str(CT): ct.config})
    path = cfg.save(cfg.Config(nodes={"here": local}), tmp_path / "local.toml")
    proc = ctl("env", "--config", str(path), "--container", str(CT),
               env={"PERL5LIB": "/leak", "SSH_CONNECTION": "leak"})
    assert proc.returncode == 0, proc.stderr
    assert dict(l.split("=", 1) for l in proc.stdout.decode().splitlines()) == container_env(ct.config)
    proc = ctl("exec", "--config", str(path), "--container", str(CT), "--", "sh", "-c", "exit 5")
    assert proc.returncode == 5


# --- nothing left behind ----------------------------------------------------------------------

def test_zz_nothing_left_behind_in_the_container(ct):
    """Runs last in this module: no process of these tests and no temp file remains."""
    def leftovers() -> list[str]:
        ps = ct.exec(["ps", "-eo", "pid,args"], check=True).stdout.splitlines()
        return [line for line in ps if TAG in line and "ps -eo" not in line]

    assert wait_until(lambda: leftovers() == []), leftovers()

    def node_leftovers() -> list[str]:  # pct / lxc-attach / sh on the node itself
        ps = ct.runner.run(["ps", "-eo", "pid,args"], check=True).stdout.splitlines()
        return [line for line in ps if TAG in line and "ps -eo" not in line]

    assert wait_until(lambda: node_leftovers() == []), node_leftovers()
    found = ct.exec(["sh", "-c", 'ls -d /tmp/"$1"* 2>/dev/null; find / -xdev -name ".*.ctl-*.tmp" 2>/dev/null',
                     "sh", TAG], check=False).stdout
    assert found.strip() == ""
