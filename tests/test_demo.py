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
