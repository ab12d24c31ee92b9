"""controller/configcache.py: the controller config parsed once per content. A later command
reads the parse back without importing tomllib; a changed file — even one of the same size
and mtime — is parsed again; what JSON cannot hold, or a file that does not parse, is never
kept, and its message is the same every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller import config as cfg
from controller import configcache

REPO = Path(__file__).resolve().parent.parent
NODE = '[nodes.x]\nhost = "10.0.0.{n}"\nport = 22\n'


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "dflash-ctl" / "config"


def load_in_a_process(path: Path, cache_home: Path) -> tuple[str, set[str]]:
    code = ("import json, sys\nfrom controller import config as cfg\n"
            f"c = cfg.load({str(path)!r})\n"
            "print(json.dumps([c.node()[1].host, sorted(sys.modules)]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cache_home)})
    host, modules = json.loads(proc.stdout)
    return host, set(modules)


def test_a_second_load_reads_the_parse_back_without_tomllib(tmp_path, cache):
    path = tmp_path / "c.toml"
    path.write_text(NODE.format(n=1))
    first = load_in_a_process(path, tmp_path / "cache")
    second = load_in_a_process(path, tmp_path / "cache")
    assert first[0] == second[0] == "10.0.0.1"
    assert "tomllib" in first[1] and "tomllib" not in second[1]
    assert [p.stat().st_mode & 0o777 for p in cache.iterdir()] == [0o600]
    assert cache.stat().st_mode & 0o777 == 0o700


def test_a_changed_file_of_the_same_size_and_mtime_is_parsed_again(tmp_path, cache):
    path = tmp_path / "c.toml"
    path.write_text(NODE.format(n=1))
    assert cfg.load(path).node()[1].host == "10.0.0.1"
    st = path.stat()
    path.write_text(NODE.format(n=2))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert cfg.load(path).node()[1].host == "10.0.0.2"


def test_what_json_cannot_hold_is_never_kept_and_says_the_same_each_time(tmp_path, cache):
    path = tmp_path / "c.toml"
    path.write_text('[nodes.x]\nhost = "h"\nport = 1979-05-27\n')
    messages = []
    for _ in range(2):
        with pytest.raises(cfg.ConfigError) as err:
            cfg.load(path)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "nodes.x.port" in messages[0]
    assert not cache.exists() or not list(cache.iterdir())


def test_a_file_that_does_not_parse_is_never_kept(tmp_path, cache):
    path = tmp_path / "c.toml"
    path.write_text("[nodes.x\n")
    for _ in range(2):
        with pytest.raises(cfg.ConfigError, match="not valid TOML"):
            cfg.load(path)
    assert not cache.exists() or not list(cache.iterdir())


def test_a_damaged_entry_is_parsed_again_and_an_unwritable_cache_costs_nothing_but_time(tmp_path, cache,
                                                                                        monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text(NODE.format(n=3))
    cfg.load(path)
    (entry,) = cache.iterdir()
    entry.write_text("{not json")
    assert cfg.load(path).node()[1].host == "10.0.0.3"
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # its "dflash-ctl" cannot be made
    assert cfg.load(path).node()[1].host == "10.0.0.3"


def test_newlines_are_read_as_text_mode_read_them(tmp_path, cache):
    """A multi-line string in a CRLF file: the value Path.read_text gave before."""
    path = tmp_path / "c.toml"
    path.write_bytes(b'[nodes.x]\r\nhost = """\r\nh"""\r\n')
    import tomllib

    expected = tomllib.loads(path.read_text(encoding="utf-8"))
    for _ in range(2):
        assert configcache.parsed(path.read_bytes(), lambda: cfg._parse_toml(path, path.read_bytes())) == expected
