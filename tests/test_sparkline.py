"""`ctl status`'s inline charts: the shape of a series in one line."""

from controller.sparkline import BARS, downsample, sparkline


def test_a_series_runs_from_the_lowest_to_the_highest_bar():
    line = sparkline([3.0, 1.0, 2.0, 5.0], width=4)
    assert line == BARS[4] + BARS[0] + BARS[2] + BARS[-1]  # (v - 1) / 4 of the 7 steps up


def test_a_falling_loss_falls_and_a_flat_series_is_flat():
    falling = sparkline([6.2 - 0.01 * i for i in range(300)], width=20)
    assert len(falling) == 20 and falling[0] == BARS[-1] and falling[-1] == BARS[0]
    assert list(falling) == sorted(falling, key=BARS.index, reverse=True)
    assert len(set(sparkline([7.0] * 50))) == 1


def test_long_series_are_bucketed_by_their_means_and_gaps_are_skipped():
    assert downsample([1, 1, 3, 3, None, 5, 5], 3) == [1.0, 3.0, 5.0]
    assert sparkline([], 10) == "" and sparkline([None, None]) == ""


def test_status_shows_loss_and_rate_over_the_run_from_the_run_directory(tmp_path):
    """agent.runview reads the step events (one row a step, every k-th past 200) and
    `ctl status` draws them beside the numbers."""
    import json

    from agent import runview
    from controller.status import render_status

    events = tmp_path / "events.jsonl"
    with open(events, "w") as fh:
        for step in range(1, 501):
            for rank in (0, 1):  # two ranks report the same step: one row
                fh.write(json.dumps({"kind": "step", "rank": rank, "step": step, "loss": 7.0 - step / 100,
                                     "tokens_per_s": 1000.0 + step}) + "\n")
        fh.write('{"kind": "phase", "phase": "done"}\n')
    hist = runview.history(str(tmp_path))
    assert len(hist["step"]) == 167 and hist["step"][:3] == [1, 4, 7]
    reply = {"run_id": "r", "status": {"state": "completed", "step": 500, "total": 500, "loss": 2.0,
                                       "tokens_per_s": 1500.0}, "history": hist}
    lines = render_status(reply, "200", "sim")
    loss = next(line for line in lines if line.startswith("loss"))
    rate = next(line for line in lines if line.startswith("tok/s"))
    def chart(line):
        return line.rsplit("(", 1)[0].split()[-1]

    assert len(chart(loss)) == 24 and chart(loss)[0] == BARS[-1] and chart(loss)[-1] == BARS[0]  # falls
    assert chart(rate)[0] == BARS[0] and chart(rate)[-1] == BARS[-1] and "over the run" in rate


def test_status_shows_tau_over_the_run_and_the_best_checkpoint_from_eval_events(tmp_path):
    """τ measured at each save (eval events) is charted as loss is, with the best checkpoint
    (the one retention keeps and `ctl export --best` exports) beside the latest τ."""
    import json

    from agent import runview
    from controller.status import render_status

    with open(tmp_path / "events.jsonl", "w") as fh:
        for step, tau in ((10, 1.5), (20, 2.5), (30, 2.1)):
            fh.write(json.dumps({"kind": "step", "step": step, "loss": 3.0}) + "\n")
            fh.write(json.dumps({"kind": "eval", "step": step, "tau": tau, "best_step": 20 if step >= 20 else 10,
                                 "best_tau": 2.5 if step >= 20 else 1.5}) + "\n")
    hist = runview.history(str(tmp_path))
    assert hist["eval_step"] == [10, 20, 30] and hist["tau"] == [1.5, 2.5, 2.1]
    reply = {"run_id": "r", "status": {"state": "running", "step": 30, "total": 40, "loss": 3.0}, "history": hist}
    tau = next(line for line in render_status(reply, "200", "sim") if line.startswith("tau"))
    assert tau.startswith("tau      2.100 at step 30  (best 2.500 at step 20")
    assert "1.5…2.5 over the run" in tau
