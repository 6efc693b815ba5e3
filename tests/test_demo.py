"""mesa_train.demo: both runs go through the training pipeline and the table compares them
(shortened here: one epoch on a slice of the digits)."""
from mesa_train import demo


def test_demo_runs_stock_and_mesa_and_compares(tmp_path):
    results = demo.run(["trainer.epochs=1", "data.train_size=128", "data.val_size=64", "trainer.progress=false"],
                       out_dir=str(tmp_path))
    stock, mesa = results["stock"], results["Mesa"]
    assert not stock["mesa"] and mesa["mesa"] and mesa["mesa_ops"] == "all"
    assert stock["step"] == mesa["step"] == 2  # 128 images / batch 64, one epoch
    assert mesa["saved_bytes"] < stock["saved_bytes"] / 2  # 8-bit copies of what is saved
    text = demo.table(results)
    for needle in ("top-1 (val)", "train images/s (mean)", "saved for backward", "top-1 difference Mesa - stock"):
        assert needle in text
    assert stock["val_images"] == mesa["val_images"] == 64  # data.val_size: what the gap is read against
    assert "of 64 validation images" in text
    assert (tmp_path / "stock" / "checkpoints" / "last.pt").exists()
    assert (tmp_path / "mesa" / "metrics.csv").exists()


def test_demo_help_and_bad_overrides_are_one_line(capsys):
    """-h prints the usage; an argument that is not an override, an unknown key and a bad value
    each end in one 'error: ...' line naming what to do, exit code 2, no traceback (as train.py)."""
    assert demo.main(["--help"]) == 0
    assert "python -m mesa_train.demo trainer.epochs=3" in capsys.readouterr().out
    cases = [(["--foo"], "'--foo' is not a Hydra override"),
             (["trainer.nope=3"], "trainer.nope=3: trainer has no setting 'nope'; valid: epochs, "),
             (["model=bogus"], "model=bogus: no such option in configs/model; valid: deit_b, deit_s, deit_ti, "),
             (["trainer.epochs=abc"], "trainer.epochs='abc' must be an integer >= 1")]
    for args, needle in cases:
        assert demo.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err, err
        assert "Traceback" not in err


def test_top1_gap_is_read_against_the_validation_sample():
    """The last line says whether one run on this many validation images can tell the two apart
    (the 95% half-width of a difference of two binomial proportions), not a fixed one point."""
    # p = 0.5 on 100 images each: 1.96 * sqrt((0.25 + 0.25) / 100) = 13.86 points
    assert abs(demo.chance_half_width(50.0, 50.0, 100) - 13.859) < 1e-3
    assert demo.chance_half_width(100.0, 100.0, 360) == 0.0
    # the digits demo's 360 images at 95%: -1.67 points (6 images) is inside about 3.3 points
    line = demo.top1_gap_line(95.56, 93.89, 360)
    assert line.startswith("top-1 difference Mesa - stock: -1.67 points (6 of 360 validation images): within the +-3.3")
    assert "does not tell the two apart" in line
    far = demo.top1_gap_line(95.56, 85.0, 360)
    assert "(38 of 360 validation images): beyond the +-4.3 points" in far
    assert demo.top1_gap_line(95.56, 93.89, None) == "top-1 difference Mesa - stock: -1.67 points."
