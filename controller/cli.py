"""`ctl`: the operator's command line (the ``ctl`` entry point).

The plainest forms of the one-shot commands (controller/front.py) run without importing typer;
everything else, --help and every option error included, goes to typer's app
(controller/app.py), which says it exactly as before.
"""

from __future__ import annotations

import sys


def main() -> None:
    # Start-up (typer, click, the command's modules) makes a few hundred thousand objects and
    # no garbage; the collector's passes over them were ≈ 10 % of a one-shot command's time
    # (docs/benchmarks.md). Off until the command runs; then they are frozen out of every
    # later pass (the one at exit too) and collection is on again for the command itself.
    import gc

    gc.disable()
    argv = sys.argv[1:]
    from controller import front

    call = front.plain_call(argv)
    if call is None:
        from controller.app import run

        run(argv)
        return
    gc.freeze()
    gc.enable()
    front.run(call)


def __getattr__(name: str):
    """``app`` and ``_register`` (tests, bench/): typer's app, imported only when asked for."""
    if name in ("app", "_register"):
        from controller import app as typer_app

        return getattr(typer_app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
