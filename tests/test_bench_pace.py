"""mesa_train.bench.pace: each Mesa row's measured throughput ratio beside its GPU-time ratio
(the ceiling where both steps run GPU-bound), from a GPU profile: the table, its place in the
profile's Markdown, and the command that rebuilds it from a committed run's JSON and CSV."""
from __future__ import annotations

import csv
import json

import pytest

from test_bench_profile import _table  # the Markdown table under a heading

from mesa_train.bench import pace
from mesa_train.bench.measure import Measurement
from mesa_train.bench.presets import make_row
from mesa_train.bench.profile import RowProfile, render_markdown, write_files
from mesa_train.bench.runner import _row_dict

GPU_ENV = {"device": "GPU", "device_type": "cuda", "date": "d", "torch": "t", "timm": "t",
           "mesa_train": "m", "cuda": "c", "mesa_extension": "e", "git": "g"}


def _rows():
    """A stock row and two Mesa rows of its group, and a second group whose baseline is alone."""
    return [make_row({"model": "deit_ti"}, {"label": "stock", "baseline": True, "group": "g"}),
            make_row({"model": "deit_ti"}, {"label": "Mesa", "mesa": True, "ops": ["all"], "group": "g"}),
            make_row({"model": "deit_ti"}, {"label": "Mesa sdpa", "mesa": True, "ops": ["sdpa"], "group": "g"}),
            make_row({"model": "deit_ti"}, {"label": "other stock", "baseline": True, "group": "h"})]


def _profiles():
    """GPU times: stock 20 ms of kernels and 10 of host; Mesa 25 and 20; Mesa sdpa 40 and 12."""
    def prof(label, gpu, host):
        return RowProfile(label, ops={("aten::mm", "matmul"): (gpu / 2, 1.0), ("aten::add", "other"): (gpu / 2, 1.0)},
                          host_ops={("aten::mm", "matmul"): (host, 10.0)}, wall_ms=gpu + 1)
    return [prof("stock", 20.0, 10.0), prof("Mesa", 25.0, 20.0), prof("Mesa sdpa", 40.0, 12.0),
            prof("other stock", 5.0, 5.0)]


def test_pace_table_reads_each_time_as_a_throughput_ratio():
    """baseline / row for the measured steps, the GPU totals and the host totals; a missing
    measurement is a dash, not a ratio of nothing."""
    md = pace.pace_table([pace.RowTimes("Mesa", "stock", 25.0, 20.0, 20.0, 10.0, 50.0, 40.0),
                          pace.RowTimes("Mesa sdpa", "stock", 40.0, 20.0, 12.0, 10.0)])
    rows = _table("## t\n" + md, "## t")
    assert [(r["Row"], r["Measured throughput ratio"], r["GPU-time ratio (GPU-bound ceiling)"],
             r["Host-time ratio (profiled)"]) for r in rows] == [("Mesa", "0.80x", "**0.80x**", "0.50x"),
                                                                 ("Mesa sdpa", "–", "**0.50x**", "0.83x")]
    assert rows[0]["GPU ms/step (baseline -> row)"] == "20.00 -> 25.00"
    assert rows[1]["Host ms/step, profiled (baseline -> row)"] == "10.0 -> 12.0"


def test_the_gpu_profile_says_who_set_the_pace():
    """On a GPU the profile's Markdown has the table, each Mesa row against its group's
    baseline with the measured steps passed in; on a CPU (no kernel time) it has none."""
    rows, profiles = _rows(), _profiles()
    md = render_markdown(preset="p", env=GPU_ENV, command="c", steps=1, rows=rows, profiles=profiles,
                         step_ms={"stock": 30.0, "Mesa": 40.0, "Mesa sdpa": None})
    table = _table(md, "## Who set the pace")
    assert [(r["Row"], r["Baseline"], r["Measured throughput ratio"], r["GPU-time ratio (GPU-bound ceiling)"])
            for r in table] == [("Mesa", "stock", "0.75x", "**0.80x**"), ("Mesa sdpa", "stock", "–", "**0.50x**")]
    assert pace.EXPLANATION in md
    cpu = render_markdown(preset="p", env={**GPU_ENV, "device_type": "cpu"}, command="c", steps=1, rows=rows,
                          profiles=[RowProfile(p.label, ops=p.ops) for p in profiles])
    assert "Who set the pace" not in cpu


def test_a_mesa_row_whose_baseline_failed_has_no_pace_row():
    """A baseline that was not profiled (its measurement failed) leaves its Mesa rows out,
    rather than dividing by a missing total."""
    rows, profiles = _rows(), _profiles()
    profiles[0] = RowProfile("stock", status="skipped", error="measurement: oom")
    md = render_markdown(preset="p", env=GPU_ENV, command="c", steps=1, rows=rows, profiles=profiles)
    assert "Who set the pace" not in md


def _committed_run(tmp_path, rows, profiles, steps_ms):
    """The bench's own files for a run: its JSON (as runner writes it) and its profile CSV."""
    meta = {"preset": "p", "environment": GPU_ENV, "command": "c",
            "rows": [{"config": _row_dict(r), "measurement": Measurement(step_ms_median=s).as_dict()}
                     for r, s in zip(rows, steps_ms)]}
    results = tmp_path / "gpu.json"
    results.write_text(json.dumps(meta, default=str))
    write_files(tmp_path / "gpu.profile.md", tmp_path / "gpu.profile.csv", preset="p", env=GPU_ENV, command="c",
                steps=1, rows=rows, profiles=profiles)
    return results, tmp_path / "gpu.profile.csv"


def test_the_table_is_rebuilt_from_a_committed_run(tmp_path, capsys):
    """``python -m mesa_train.bench.pace RESULTS.json PROFILE.csv``: rows paired by group as the
    bench pairs them, the totals summed back from the CSV, the measured steps from the JSON;
    ``--output`` writes the same text."""
    rows, profiles = _rows(), _profiles()
    results, csv_path = _committed_run(tmp_path, rows, profiles, [30.0, 40.0, 60.0, 5.0])
    times = pace.times_from_files(results, csv_path)
    assert times == [pace.RowTimes("Mesa", "stock", 25.0, 20.0, 20.0, 10.0, 40.0, 30.0),
                     pace.RowTimes("Mesa sdpa", "stock", 40.0, 20.0, 12.0, 10.0, 60.0, 30.0)]
    out = tmp_path / "pace.md"
    assert pace.main([str(results), str(csv_path), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text()
    assert [r["Measured throughput ratio"] for r in _table("## t\n" + printed, "## t")] == ["0.75x", "0.50x"]


@pytest.mark.parametrize("case, message", [
    ("missing json", "no such file"),
    ("corrupt json", "not a bench results JSON"),
    ("cpu profile", "no self_cuda times (a CPU profile)"),
    ("corrupt csv", "not a bench profile CSV"),
    ("no pair", "no Mesa row profiled together with its baseline"),
    # the same preset's profile from another GPU, or from the same GPU on another day
    ("another gpu", "gpu.profile.csv is another run's profile (H100, d) than "),
    ("another day", "gpu.profile.csv is another run's profile (GPU, e) than "),
])
def test_files_that_cannot_give_the_table_are_one_line_errors(tmp_path, capsys, case, message):
    rows, profiles = _rows(), _profiles()
    results, csv_path = _committed_run(tmp_path, rows, profiles, [30.0, 40.0, 60.0, 5.0])
    if case == "missing json":
        results = tmp_path / "absent.json"
    elif case == "corrupt json":
        results.write_text('{"rows": [')
    elif case == "cpu profile":
        csv_path.write_text(csv_path.read_text().replace("self_cuda", "self_cpu"))
    elif case == "corrupt csv":
        csv_path.write_text("preset,label\np,stock\n")
    elif case in ("another gpu", "another day"):
        env = {**GPU_ENV, "device": "H100"} if case == "another gpu" else {**GPU_ENV, "date": "e"}
        write_files(tmp_path / "gpu.profile.md", csv_path, preset="p", env=env, command="c", steps=1, rows=rows,
                    profiles=profiles)
    else:  # only the baselines profiled
        write_files(tmp_path / "gpu.profile.md", csv_path, preset="p", env=GPU_ENV, command="c", steps=1, rows=rows,
                    profiles=[profiles[0], profiles[3]])
    assert pace.main([str(results), str(csv_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_an_older_run_pairs_by_model_and_has_no_host_side(tmp_path):
    """A run from before groups and the host profile (the H200's table1 of 2026-11-26): its rows
    pair as the bench pairs them, by model where no group is set, and its host columns are dashes."""
    rows = [make_row({"model": "deit_s"}, {"label": "DeiT-S", "baseline": True}),
            make_row({"model": "deit_s"}, {"label": "DeiT-S w/ Mesa", "mesa": True, "ops": ["all"]})]
    profiles = [RowProfile("DeiT-S", ops={("aten::mm", "matmul"): (35.0, 1.0)}),
                RowProfile("DeiT-S w/ Mesa", ops={("aten::mm", "matmul"): (44.0, 1.0)})]
    results, csv_path = _committed_run(tmp_path, rows, profiles, [40.0, 50.0])
    (times,) = pace.times_from_files(results, csv_path)
    assert times == pace.RowTimes("DeiT-S w/ Mesa", "DeiT-S", 44.0, 35.0, None, None, 50.0, 40.0)
    (row,) = _table("## t\n" + pace.pace_table([times]), "## t")
    assert (row["GPU-time ratio (GPU-bound ceiling)"], row["Host-time ratio (profiled)"],
            row["Host ms/step, profiled (baseline -> row)"]) == ("**0.80x**", "–", "–")


def test_an_output_that_cannot_be_written_is_refused(tmp_path, capsys):
    """--output under a file was a NotADirectoryError traceback after the table was made."""
    rows, profiles = _rows(), _profiles()
    results, csv_path = _committed_run(tmp_path, rows, profiles, [30.0, 40.0, 60.0, 5.0])
    with pytest.raises(SystemExit) as exit_:
        pace.main([str(results), str(csv_path), "--output", str(csv_path / "pace.md")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --output") and "cannot make the folder" in err and err.count("\n") == 1


def test_a_profile_that_does_not_name_its_run_is_noted(tmp_path, capsys):
    """A committed CSV from before the device and date columns was paired with any results JSON
    without a word (the H200's JSON with the H100's profile gave a mixed table): it is now noted,
    with the file names where they differ; a CSV that names its run is not."""
    rows, profiles = _rows(), _profiles()
    results, csv_path = _committed_run(tmp_path, rows, profiles, [30.0, 40.0, 60.0, 5.0])
    pace.times_from_files(results, csv_path)
    assert "note:" not in capsys.readouterr().err
    with open(csv_path, newline="") as f:
        lines = list(csv.DictReader(f))
    old = tmp_path / "h100.profile.csv"
    with open(old, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in lines[0] if k not in ("device", "date")],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(lines)
    pace.times_from_files(results, old)
    err = capsys.readouterr().err
    assert err.startswith(f"note: {old} does not name its run") and "their names differ (gpu vs h100)" in err, err
