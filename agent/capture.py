"""Read a growing file by byte offset, one complete line at a time.

The job writes its stdout/stderr straight into files (not a pipe the agent owns), so the
output outlives the agent; the agent tails them from offsets recorded in the stream.
"""

from __future__ import annotations

import os

MAX_LINE = 64 * 1024  # a "line" longer than this (progress bars without \n) is cut here


class LineTail:
    def __init__(self, path: str, offset: int = 0):
        self.path = path
        self.offset = offset  # end of the last line handed out
        self._fh = None

    def _open(self):
        if self._fh is None:
            try:
                self._fh = open(self.path, "rb")
            except FileNotFoundError:
                return None
        return self._fh

    def read(self, max_bytes: int = 1 << 20, final: bool = False) -> list[tuple[str, int]]:
        """(line without newline, end offset) for each complete line past the offset.

        ``final``: the writer is gone, so a last line without newline is complete too.
        """
        fh = self._open()
        if fh is None:
            return []
        fh.seek(self.offset)
        data = fh.read(max_bytes)
        if not data:
            return []
        out = []
        pos = 0
        base = self.offset
        final = final and len(data) < max_bytes  # only at the real end of the file
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                rest = len(data) - pos
                if rest and (final or rest >= MAX_LINE):
                    out.append((data[pos:].decode("utf-8", "replace"), base + len(data)))
                    pos = len(data)
                break
            if nl - pos > MAX_LINE:
                nl = pos + MAX_LINE - 1
                out.append((data[pos:nl + 1].decode("utf-8", "replace"), base + nl + 1))
            else:
                out.append((data[pos:nl].decode("utf-8", "replace"), base + nl + 1))
            pos = nl + 1
        self.offset = base + pos
        return out

    def size(self) -> int:
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
