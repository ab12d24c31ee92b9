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
