"""examples.titan.rounds: the trainer's time against bf16 as the median of interleaved bench rounds (no GPU, no
trainer job: the bench is replaced by a stand-in that writes records)."""

from __future__ import annotations

import json

import pytest

from examples.titan import rounds


def _result(variant, mode, tokens, allocated=None, rc=0):
    return {"variant": variant, "mode": mode, "rc": rc, "tokens_per_s_per_gpu": {"median": tokens},
            "peak_active_gib": {} if allocated is None else {"0": allocated}}


def _record(layers, *results):
    return {"layers": layers, "results": list(results)}


def test_orders_alternate_so_no_variant_always_runs_first():
    assert rounds.round_orders(["bf16", "converted", "mxfp8"], 3) == [
        ["bf16", "converted", "mxfp8"], ["mxfp8", "converted", "bf16"], ["bf16", "converted", "mxfp8"]]


def test_each_ratio_is_taken_within_its_round_then_summarized():
    # bf16's own speed moves between rounds: pooling the tokens/s (median 100 vs 90) would give 1.111; the ratios
    # within each round are 1.111, 1.000 and 1.031, median 1.031
    recs = [_record(4, _result("bf16", "compiled", 100.0, 41.5), _result("converted", "compiled", 90.0, 40.2)),
            _record(4, _result("converted", "compiled", 80.0, 40.3), _result("bf16", "compiled", 80.0, 41.5)),
            _record(4, _result("bf16", "compiled", 100.0, 41.6), _result("converted", "compiled", 97.0, 40.2),
                    _result("mxfp8", "compiled", 50.0, rc=1)),  # a failed job gives no ratio
            _record(8, _result("bf16", "compiled", 50.0), _result("converted", "compiled", 40.0)),
            _record(4, _result("converted", "eager", 70.0))]  # no bf16 in that mode: no ratio
    rows = {(r["layers"], r["mode"], r["variant"]): r for r in rounds.summarize(recs)}
    assert set(rows) == {(4, "compiled", "bf16"), (4, "compiled", "converted"), (8, "compiled", "bf16"),
                         (8, "compiled", "converted")}
    conv = rows[(4, "compiled", "converted")]
    assert conv["rounds"] == 3
    assert conv["ratios"] == pytest.approx([100 / 90, 1.0, 100 / 97])
    assert conv["ratio_median"] == pytest.approx(100 / 97)
    assert (conv["ratio_min"], conv["ratio_max"]) == pytest.approx((1.0, 100 / 90))
    assert conv["peak_allocated_gib"] == 40.3
    assert rows[(8, "compiled", "converted")]["ratio_median"] == pytest.approx(1.25)
    assert rows[(8, "compiled", "converted")]["peak_allocated_gib"] is None
    text = rounds.table(rounds.summarize(recs))
    assert "| 4 | compiled | converted | 3 | 1.031 (1.000-1.111) | 1.111 1.000 1.031 | 40.30 |" in text


def test_main_runs_one_bench_per_round_in_alternating_orders_and_summarizes(tmp_path, monkeypatch):
    calls = []

    def fake_bench(argv):
        calls.append(argv)
        out = argv[argv.index("--out") + 1]
        order = argv[argv.index("--variants") + 1].split(",")
        speed = {"bf16": 100.0, "converted": 95.0}
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        (tmp_path / out / "bench.json").write_text(json.dumps(
            _record(4, *[_result(v, "compiled", speed[v] - 5 * len(calls), 40.0) for v in order])))
        return 0

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rounds.bench, "main", fake_bench)
    rc = rounds.main(["--out", "r", "--rounds", "2", "--variants", "bf16,converted", "--nproc", "1", "--layers", "4",
                      "--", "--moe_quant.memory_gib", "76"])
    assert rc == 0
    assert [c[c.index("--variants") + 1] for c in calls] == ["bf16,converted", "converted,bf16"]
    assert [c[c.index("--out") + 1] for c in calls] == ["r/round0", "r/round1"]
    for c in calls:  # the bench's own options before its "--", the trainer's after
        assert c[:4] == ["--nproc", "1", "--layers", "4"]
        assert c[-3:] == ["--", "--moe_quant.memory_gib", "76"]
    summary = json.loads((tmp_path / "r" / "rounds.json").read_text())
    conv = next(r for r in summary if r["variant"] == "converted")
    assert conv["ratios"] == pytest.approx([95 / 90, 90 / 85])


def test_bad_arguments_say_what_was_expected(capsys):
    with pytest.raises(SystemExit):
        rounds.parse_args(["--out", "r", "--variants", "converted,mxfp8"])
    assert "--variants must include bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rounds.parse_args(["--out", "r", "--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rounds.parse_args(["--rounds", "2"])
    assert "--out is required" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no bench record"):
        rounds.load(["/nonexistent/bench-folder"])
