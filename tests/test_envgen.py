"""agent/envgen.py on plain local venvs: adopt, install into a new generation, switch,
refusals, and interruption at every named point (the venv is never broken; a rerun
completes the operation). Runs with the system python3, as in a container."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.genstore import FAULT_POINTS
from agent.pkgdiff import diff_packages, version_key
from agent.protocol import extract_payload
from wheel_factory import probe_wheelhouse

REPO = Path(__file__).resolve().parent.parent
SYS_PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def envgen(venv: Path, *args: str, fault: str | None = None, extra_env: dict | None = None):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(venv.parent)}
    if fault:
        env["DFLASH_ENVGEN_FAULT"] = fault
    env.update(extra_env or {})
    proc = subprocess.run([SYS_PY, "-m", "agent.envgen", "--venv", str(venv), *args],
                          capture_output=True, text=True, env=env)
    body = extract_payload(proc.stdout) if "PAYLOAD" in proc.stdout else None
    return proc.returncode, body, proc.stderr


def probe_version(venv: Path) -> str:
    """What the venv path gives a new process: the probe's version, or 'broken' when the
    package imports with an error (the deliberately broken 2.0). Fails if python is gone."""
    proc = subprocess.run([str(venv / "bin" / "python3"), "-c",
                           "import importlib.metadata as m; print(m.version('dflashprobe'))\n"
                           "import dflashprobe"], capture_output=True, text=True)
    assert proc.stdout.strip(), f"venv {venv} is broken: {proc.stderr}"
    return proc.stdout.strip() if proc.returncode == 0 else "broken:" + proc.stdout.strip()


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("envgen-base")
    wh = probe_wheelhouse(root / "wheelhouse")
    venv = root / "venv"
    subprocess.run([SYS_PY, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/python3"), "-m", "pip", "install", "-q", "--no-index",
                    "--find-links", str(wh), "dflashprobe==1.0"], check=True)
    return venv, wh


@pytest.fixture
def venv(base_venv, tmp_path) -> Path:
    src, _ = base_venv
    dst = tmp_path / "root" / "venv"
    dst.parent.mkdir()
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


@pytest.fixture
def wheelhouse(base_venv) -> Path:
    return base_venv[1]


def test_adopt_turns_the_venv_into_a_generation_link_without_changing_it(venv):
    before = probe_version(venv)
    rc, body, err = envgen(venv, "adopt")
    assert rc == 0, err
    assert venv.is_symlink()
    assert body["adopted"] and body["current"]
    assert probe_version(venv) == before == "1.0"
    # Scripts written when the venv was a real directory still run through the link.
    assert subprocess.run([str(venv / "bin" / "pip"), "--version"], capture_output=True).returncode == 0
    rc, again, _ = envgen(venv, "adopt")
    assert rc == 0 and not again["adopted"] and again["current"] == body["current"]


def test_install_builds_a_new_generation_and_switch_goes_back(venv, wheelhouse):
    rc, body, err = envgen(venv, "install", "dflashprobe==2.0", "--wheelhouse", str(wheelhouse))
    assert rc == 0, err
    old, new = body["from"], body["to"]
    assert old != new and body["current"] == new
    assert body["diff"]["up"] == [{"name": "dflashprobe", "from": "1.0", "to": "2.0"}]
    assert probe_version(venv).startswith("broken:2.0")
    # The console script pip wrote into the new generation names the venv path, not the
    # build directory it was installed in.
    pip_script = (venv / "bin" / "dflashprobe-ok").read_text().splitlines()[0]
    assert pip_script.startswith(f"#!{venv}/bin/python"), pip_script
    listing = envgen(venv, "list")[1]
    assert [g["id"] for g in listing["generations"]] == [old, new]

    rc, sw, err = envgen(venv, "switch", old)
    assert rc == 0, err
    assert sw["verified"] and sw["fingerprint_after"]["id"] == old
    assert sw["diff"]["down"] == [{"name": "dflashprobe", "from": "2.0", "to": "1.0"}]
    assert probe_version(venv) == "1.0"
    rc, d, _ = envgen(venv, "diff", old, new)
    assert d["up"][0]["name"] == "dflashprobe" and d["changed"]


def test_install_of_the_same_set_reuses_the_generation(venv, wheelhouse):
    first = envgen(venv, "install", "dflashprobe==2.0", "--wheelhouse", str(wheelhouse))[1]
    envgen(venv, "switch", first["from"])
    again = envgen(venv, "install", "dflashprobe==2.0", "--wheelhouse", str(wheelhouse))[1]
    assert again["to"] == first["to"]
    assert len(envgen(venv, "list")[1]["generations"]) == 2


@pytest.mark.parametrize("args, words", [
    (("switch", "feedbeef0000"), "does not exist"),
    (("install", "dflashprobe==9.9", "--wheelhouse", "WH"), "nothing changed"),
    (("install", "dflashprobe==2.0", "--wheelhouse", "/nonexistent/wh"), "wheelhouse /nonexistent/wh does not exist"),
    # pip would read these as its own options (an editable path, another index); after "--"
    # argparse hands them over as requirements and the refusal names them
    (("install", "--wheelhouse", "WH", "--", "-e", "/tmp"), "'-e' is a pip option, not a requirement"),
    (("install", "--wheelhouse", "WH", "--", "--index-url=http://127.0.0.1:1/simple", "dflashprobe==2.0"),
     "is a pip option, not a requirement"),
    (("install", "--wheelhouse", "WH", "--", " "), "a requirement cannot be empty"),
])
def test_refusals_change_nothing(venv, wheelhouse, args, words):
    envgen(venv, "adopt")
    before = envgen(venv, "list")[1]
    args = tuple(str(wheelhouse) if a == "WH" else a for a in args)
    rc, body, _ = envgen(venv, *args)
    assert rc == 2 and not body["ok"] and body["kind"] == "refused"
    assert words in body["error"]
    after = envgen(venv, "list")[1]
    assert after["generations"] == before["generations"] and after["current"] == before["current"]
    assert after["pending"] is None
    assert not [n for n in os.listdir(venv.parent / ".venv-generations") if n.startswith(".build-")]
    assert probe_version(venv) == "1.0"


def test_a_generation_in_use_or_referenced_is_never_removed(venv, wheelhouse):
    body = envgen(venv, "install", "dflashprobe==2.0", "--wheelhouse", str(wheelhouse))[1]
    old, new = body["from"], body["to"]
    rc, r, _ = envgen(venv, "remove", new)
    assert rc == 2 and "current" in r["error"]
    envgen(venv, "pin", "--ref", "run-good", "--gen", old)
    rc, r, _ = envgen(venv, "remove", old)
    assert rc == 2 and "run-good" in r["error"]
    assert [g["refs"] for g in envgen(venv, "list")[1]["generations"]] == [["run-good"], []]
    envgen(venv, "unpin", "--ref", "run-good")
    rc, r, _ = envgen(venv, "remove", old)
    assert rc == 0 and r["removed"] == old
    assert [g["id"] for g in envgen(venv, "list")[1]["generations"]] == [new]


INSTALL_POINTS = [p for p in FAULT_POINTS if p.startswith(("install:", "switch:"))]


@pytest.mark.parametrize("point", INSTALL_POINTS)
def test_install_killed_at_any_point_leaves_a_working_venv_and_resume_completes(venv, wheelhouse, point):
    envgen(venv, "adopt")
    rc, _, err = envgen(venv, "install", "dflashprobe==2.0", "--wheelhouse", str(wheelhouse),
                        fault=f"{point}=die")
    assert rc == -9, err
    # Killed mid-operation: the venv path gives either the old or the new generation, whole.
    assert probe_version(venv) in ("1.0", "broken:2.0")
    assert envgen(venv, "status")[1]["pending"]["op"] == "install"
    rc, body, err = envgen(venv, "resume")
    assert rc == 0, err
    assert body["resumed"]["resumed"] == "install"
    assert probe_version(venv) == "broken:2.0"
    st = envgen(venv, "status")[1]
    assert st["pending"] is None and len(st["generations"]) == 2
    assert not [n for n in os.listdir(venv.parent / ".venv-generations") if n.startswith(".build-")]
    assert not [n for n in os.listdir(venv.parent) if ".link-" in n]


def test_switch_killed_after_link_then_any_verb_completes_it(venv, wheelhouse):
    body = envgen(venv, "install", "dflashprobe==2.0", "--wheelhouse", str(wheelhouse))[1]
    rc, _, _ = envgen(venv, "switch", body["from"], fault="switch:after-link=die")
    assert rc == -9
    assert probe_version(venv) == "broken:2.0"  # the rename had not happened: still the new one
    rc, lst, _ = envgen(venv, "adopt")  # any mutating verb finishes the journal first
    assert rc == 0 and lst["resumed"]["resumed"] == "switch"
    assert probe_version(venv) == "1.0"


@pytest.mark.parametrize("point, no_exchange", [("adopt:before-exchange", False),
                                                ("adopt:before-exchange", True),
                                                ("adopt:after-move", True)])
def test_adopt_killed_midway_is_completed_by_a_rerun(venv, point, no_exchange):
    extra = {"DFLASH_ENVGEN_NO_EXCHANGE": "1"} if no_exchange else {}
    rc, _, err = envgen(venv, "adopt", fault=f"{point}=die", extra_env=extra)
    assert rc == -9, err
    if point == "adopt:before-exchange":
        assert probe_version(venv) == "1.0"  # still the real directory
    rc, body, err = envgen(venv, "adopt", extra_env=extra)
    assert rc == 0, err
    assert venv.is_symlink() and probe_version(venv) == "1.0"
    assert envgen(venv, "status")[1]["pending"] is None


def test_remove_killed_after_trash_is_finished_by_resume(venv, wheelhouse):
    body = envgen(venv, "install", "dflashprobe==2.0", "--wheelhouse", str(wheelhouse))[1]
    rc, _, _ = envgen(venv, "remove", body["from"], fault="remove:after-trash=die")
    assert rc == -9
    assert [g["id"] for g in envgen(venv, "list")[1]["generations"]] == [body["to"]]
    assert envgen(venv, "resume")[0] == 0
    assert not [n for n in os.listdir(venv.parent / ".venv-generations") if n.startswith(".trash-")]


def test_a_mounted_or_missing_venv_is_refused(tmp_path):
    rc, body, _ = envgen(tmp_path / "nope", "adopt")
    assert rc == 2 and "does not exist" in body["error"]


def test_version_order_and_package_diff():
    assert version_key("2.13.0+cpu") > version_key("2.9.1+cu130")
    assert version_key("1.0") == version_key("1.0.0")
    assert version_key("1.0rc1") < version_key("1.0") < version_key("1.0.post1")
    assert version_key("1.0.dev1") < version_key("1.0a1")
    d = diff_packages({"torch": "2.9.1+cu128", "a": "1", "gone": "3"},
                      {"torch": "2.9.1+cu130", "a": "0.9", "new": "1"})
    assert d["up"] == [{"name": "torch", "from": "2.9.1+cu128", "to": "2.9.1+cu130"}]
    assert d["down"] == [{"name": "a", "from": "1", "to": "0.9"}]
    assert d["added"] == [{"name": "new", "to": "1"}] and d["removed"] == [{"name": "gone", "from": "3"}]
