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
    assert (tmp_path / "stock" / "checkpoints" / "last.pt").exists()
    assert (tmp_path / "mesa" / "metrics.csv").exists()


def test_demo_help_and_bad_overrides_are_one_line(capsys):
    """-h prints the usage; an argument that is not an override, an unknown key and a bad value
    each end in one 'error: ...' line naming what to do, exit code 2, no traceback (as train.py)."""
    assert demo.main(["--help"]) == 0
    assert "python -m mesa_train.demo trainer.epochs=3" in capsys.readouterr().out
    cases = [(["--foo"], "'--foo' is not a Hydra override"),
             (["trainer.nope=3"], "Could not override 'trainer.nope'. To append to your config use +trainer.nope=3"),
             (["trainer.epochs=abc"], "trainer.epochs='abc' must be an integer >= 1")]
    for args, needle in cases:
        assert demo.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err, err
        assert "Traceback" not in err
