"""A progress line over bytes moved, on stderr: the transfers of `ctl export` and
`ctl env cache export/import`."""

from __future__ import annotations

from typing import Callable, Optional


class ByteProgress:
    """A rich progress bar of bytes (total None when unknown); a context manager whose value
    is the advance function."""

    def __init__(self, what: str, total: Optional[int]):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self.bar = Progress(what, BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task(what, total=total)

    def __enter__(self) -> Callable[[int], None]:
        self.bar.start()
        return lambda n: self.bar.advance(self.task, n)

    def __exit__(self, *exc) -> None:
        self.bar.stop()


def receiving(total: Optional[int]) -> ByteProgress:
    return ByteProgress("receiving", total)
