"""calibrate-sim's own arithmetic (the figures themselves come from simulator runs)."""

from __future__ import annotations

from pearl_hpc.sim.validation import Difference, _config, _hysteresis


def test_static_names_give_their_configuration() -> None:
    assert _config("static-coloc", 8) == (0, 0, 8)
    assert _config("static-3P5D", 8) == (3, 5, 0)
    assert _config("static-10P2D", 12) == (10, 2, 0)


def test_hysteresis_counts_the_switches_above_the_threshold_that_really_gain() -> None:
    diffs = [
        Difference(0.20, 0.15, "mode", 0.10),  # predicted and real gain
        Difference(-0.12, 0.03, "mode", 0.10),  # predicted gain, real loss
        Difference(0.05, -0.30, "mode", 0.10),  # under the threshold: not a switch
        Difference(0.06, 0.01, "P:D ratio", 0.05),
    ]
    mode, ratio = _hysteresis(diffs)
    assert mode.ours.startswith("1/2 ") and not mode.ok
    assert "median error 15.0" in mode.ours
    assert ratio.ours.startswith("1/1 ") and ratio.ok
