"""controller/interrupts.py: before hold() a SIGINT raises (the command undoes and says
nothing was started); after it the SIGINT is recorded until the command has reported; the
old handler comes back afterwards. Real signals to a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import os, signal
from controller import interrupts
out = []
with interrupts.guarded():
    try:
        os.kill(os.getpid(), signal.SIGINT)
        out.append("not raised")
    except KeyboardInterrupt:
        out.append("raised before hold")
with interrupts.guarded():
    interrupts.hold()
    os.kill(os.getpid(), signal.SIGINT)
    out.append("held" if interrupts.interrupted() else "lost")
    out.append("reported")
out.append("pending after" if interrupts.interrupted() else "forgotten")
try:
    os.kill(os.getpid(), signal.SIGINT)
    out.append("old handler gone")
except KeyboardInterrupt:
    out.append("old handler back")
print(",".join(out))
'''


def test_a_sigint_raises_before_hold_and_waits_after_it():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "raised before hold,held,reported,pending after,old handler back"
