"""The container's kill-and-rollback claim (agent/recovery.py): of N takers at once exactly
one gets it, the others are told who holds it; only its own token releases it; a claim
whose ctl died (past its expiry) is taken over. Real processes on a real file system."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agent import recovery
from agent.protocol import extract_payload

REPO = Path(__file__).resolve().parent.parent


def _claimers(ws: Path, n: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-m", "agent.recovery", "--workspace", str(ws), "claim",
                               "--holder", f"ctl {i}", "--ttl", "600"], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    return [extract_payload(p.communicate(timeout=60)[0]) for p in procs]


def test_of_eight_at_once_exactly_one_claims(tmp_path):
    for trial in range(5):
        ws = tmp_path / f"ws{trial}"
        replies = _claimers(ws, 8)
        winners = [r for r in replies if r["claimed"]]
        assert len(winners) == 1, replies
        holder = json.loads((ws / recovery.CLAIM).read_text())["holder"]
        assert all(r["holder"]["holder"] == holder for r in replies if not r["claimed"])


def test_only_its_token_releases_it_and_a_dead_claim_is_taken_over(tmp_path):
    got = recovery.claim(str(tmp_path), "first", 600)
    assert got["claimed"]
    assert not recovery.release(str(tmp_path), "not-the-token")
    assert not recovery.claim(str(tmp_path), "second", 600)["claimed"]
    assert recovery.release(str(tmp_path), got["token"])
    again = recovery.claim(str(tmp_path), "third", 0)  # expires at once: its ctl "died"
    assert again["claimed"]
    assert recovery.claim(str(tmp_path), "fourth", 600)["claimed"]
