"""CPU checks of the EP measurements whose real use is on GPUs: ``benchmarks/bench_ep.py`` end to end on two
gloo ranks (every row, its record), and the slow-wire model of ``scripts/ep_wire_fit.py`` on records made
from a known model (it must give that model back, flag a point it cannot predict, and project the gains)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from repo_subprocess import ROOT, run_python

sys.path.insert(0, str(ROOT / "scripts"))
import ep_wire_fit  # noqa: E402

D = 7168
MX_ROW, BF16_ROW = D + D // 32, 2 * D
LEGS = ("dispatch", "combine", "combine backward", "dispatch backward")


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_bench_ep_runs_every_row_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "ep.json"
    res = run_python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                     "benchmarks.bench_ep", "--device", "cpu", "--rounds", "2", "--steps", "1", "--json", str(out),
                     timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = {r["row"]: r for r in record["rows"]}
    want = {"bf16", "conv_bf16", "conv_mxfp8", "p2p", "p2p_c2", "p2p_c4", "sync_free", "sync_free_c2"}
    assert want <= set(rows) and (set(rows) - want <= {"titan"}), set(rows)
    assert "titan" in rows or "titan" in record["notes"]  # run, or said why not
    assert record["world"] == 2 and record["rounds"] == 2
    d = record["sizes"]["dim"]
    for name, r in rows.items():
        assert len(r["samples"]) == 2 and r["round_min"] <= r["ms"] <= r["round_max"], (name, r)
        assert r["vs_bf16"] == pytest.approx(r["ms"] / rows["bf16"]["ms"]), name
        assert len(r["ms_per_rank"]) == 2
        rows_sent = r["wire"]["dispatch"]["rows"]
        if "capacity_factor" in r["settings"]:  # sync-free: every slot, filled or not
            assert rows_sent >= 2 * record["sizes"]["tokens"] and r["dropped"] == 0, (name, r["wire"])
        else:
            assert rows_sent == 2 * record["sizes"]["tokens"], (name, r["wire"])  # top-2 copies of each token
        mx = r["settings"].get("wire") == "mxfp8"
        assert r["wire"]["dispatch"]["bytes"] == rows_sent * ((d + d // 32) if mx else 2 * d), (name, r["wire"])
        assert r["wire"]["combine"]["bytes"] == r["wire"]["combine"]["rows"] * 2 * d, (name, r["wire"])
        # the backward legs mirror the forward ones: the gradient of the expert output on the dispatch's wire,
        # the input gradient in bf16
        assert r["wire"]["combine backward"] == r["wire"]["dispatch"], (name, r["wire"])
        assert r["wire"]["dispatch backward"] == r["wire"]["combine"], (name, r["wire"])
    assert [p["wire"] for p in record["legs_alone"]] == ["bf16"] * 3 + ["mxfp8"] * 3
    for p in record["legs_alone"]:
        assert p["bytes_to_others"] == p["bytes"] // 2 and p["ms"] > 0
    assert "EP MoE block fwd + bwd" in res.stdout and "One leg alone" in res.stdout


def _record(fixed_ms, gbps, rows, world=2, scale=None):
    """A bench_ep record whose every number follows the model with the given transport and rows
    ``(name, compute ms, row bytes of the MXFP8-able legs, chunks)``; ``scale``: {row: factor} off the model."""
    legs_alone = []
    for wire, rb in (("bf16", BF16_ROW), ("mxfp8", MX_ROW)):
        for n in (8192, 16384, 32768):
            to_others = n * rb * (world - 1) // world
            legs_alone.append({"wire": wire, "rows": n, "bytes": n * rb, "bytes_to_others": to_others,
                               "ms": fixed_ms + to_others / (gbps * 1e6)})
    out = []
    for name, compute, rb, chunks in rows:
        wire = {"dispatch": rb, "combine": BF16_ROW, "combine backward": rb, "dispatch backward": BF16_ROW}
        wire = {leg: {"rows": 32768, "bytes": 32768 * b} for leg, b in wire.items()}
        wire["counts"] = {"rows": world, "bytes": 8 * world}
        nbytes = sum(wire[leg]["bytes"] for leg in LEGS) * (world - 1) / world
        ms = compute + (1 + 4 * chunks) * fixed_ms + nbytes / (gbps * 1e6)
        out.append({"row": name, "label": name, "ms": ms * (scale or {}).get(name, 1.0), "wire": wire,
                    "settings": {"chunks": chunks}})
    return {"world": world, "sizes": {"dim": D, "hidden": 2048, "experts_per_rank": 8, "top_k": 2, "tokens": 16384},
            "rows": out, "legs_alone": legs_alone}


ROWS = [("bf16", 20.0, BF16_ROW, 1), ("conv_bf16", 21.0, BF16_ROW, 1), ("conv_mxfp8", 21.6, MX_ROW, 1),
        ("p2p_c2", 19.0, MX_ROW, 2)]
WIRES = {"nvlink": (0.03, 150.0), "shm": (0.06, 20.0), "socket": (0.2, 2.0)}


def _records(**kw):
    return {t: _record(f, b, ROWS, **kw) for t, (f, b) in WIRES.items()}


def test_fit_gives_the_model_back_and_predicts_every_point():
    model = ep_wire_fit.fit(_records())
    for t, (f, b) in WIRES.items():
        assert model["wires"][t]["fixed_ms"] == pytest.approx(f, rel=1e-6)
        assert model["wires"][t]["gbps"] == pytest.approx(b, rel=1e-6)
    for name, compute, _, chunks in ROWS:
        info = model["rows"][name]
        assert info["fitted"] == (chunks == 1), name  # overlapped rows are measured, not modelled
        if chunks == 1:
            assert info["compute_ms"] == pytest.approx(compute, rel=1e-6)
            assert max(abs(e) for e in info["error"].values()) < 1e-6
    assert model["ok"]


def test_wire_log_records_legs_sent_from_other_threads():
    """On CUDA autograd runs the backward legs on its device threads: the log must see them."""
    import threading

    from moe_quant.ep import WireLog

    with WireLog() as log:
        WireLog.record_rows("dispatch", 3, 30)
        t = threading.Thread(target=WireLog.record_rows, args=("combine backward", 5, 50))
        t.start()
        t.join()
    WireLog.record_rows("dispatch", 7, 70)  # after the scope: not recorded
    assert log.by_leg("dispatch") == (3, 30)
    assert log.by_leg("combine backward") == (5, 50)


def test_fit_takes_compute_from_the_fastest_transport_and_predicts_the_others():
    records = _records()
    off = copy.deepcopy(records["nvlink"])
    off["rows"][2]["ms"] += 2.0  # conv_mxfp8 on NVLink: 2 ms more compute than the other transports show
    records["nvlink"] = off
    model = ep_wire_fit.fit(records)
    assert model["compute_from"] == "nvlink"  # the highest fitted bandwidth
    assert model["rows"]["conv_mxfp8"]["compute_ms"] == pytest.approx(21.6 + 2.0, rel=1e-9)
    assert model["rows"]["conv_mxfp8"]["error"]["nvlink"] == pytest.approx(0.0, abs=1e-9)
    assert model["rows"]["conv_mxfp8"]["error"]["shm"] > 0.01  # shm and socket predicted 2 ms too slow
    by_socket = ep_wire_fit.fit(records, compute_from="socket")
    assert by_socket["rows"]["conv_mxfp8"]["compute_ms"] == pytest.approx(21.6, rel=1e-9)
    assert by_socket["rows"]["conv_mxfp8"]["error"]["nvlink"] < -0.01
    with pytest.raises(ValueError, match="compute_from must be one of"):
        ep_wire_fit.fit(records, compute_from="ib")


def test_fit_flags_a_point_it_cannot_predict():
    records = _records()
    off = copy.deepcopy(records["shm"])
    off["rows"][2]["ms"] *= 1.5  # conv_mxfp8 on shm: far off the sum model
    records["shm"] = off
    model = ep_wire_fit.fit(records)
    assert not model["ok"]
    assert max(abs(e) for e in model["rows"]["conv_mxfp8"]["error"].values()) > 0.10


def test_projection_gains_and_crossover():
    model = ep_wire_fit.fit(_records())
    proj = ep_wire_fit.at_bandwidths(model, "nvlink")
    gains = {(mx, ref): (g, cross) for mx, ref, g, cross in proj["gains"]}
    w_bf16 = 32768 * BF16_ROW * 4 / 2
    w_mx = 32768 * (2 * MX_ROW + 2 * BF16_ROW) / 2
    for b in ep_wire_fit.BANDWIDTHS:
        want = (21.0 + 5 * 0.03 + w_bf16 / (b * 1e6)) / (21.6 + 5 * 0.03 + w_mx / (b * 1e6))
        assert gains[("conv_mxfp8", "conv_bf16")][0][b] == pytest.approx(want, rel=1e-9)
    # MXFP8 costs 0.6 ms of compute and saves w_bf16 - w_mx bytes: faster below their ratio
    assert gains[("conv_mxfp8", "conv_bf16")][1] == pytest.approx((w_bf16 - w_mx) / 0.6 / 1e6, rel=1e-6)
    assert ep_wire_fit.crossover_gbps({"compute_ms": 1.0, "bytes": 1e6, "exchanges": 5},
                                      {"compute_ms": 2.0, "bytes": 2e6, "exchanges": 5}, 0.1) is None


def test_script_writes_table_and_plot(tmp_path):
    paths = []
    for t, rec in _records().items():
        p = tmp_path / f"{t}.json"
        p.write_text(json.dumps(rec))
        paths.append(f"{t}={p}")
    md, png = tmp_path / "fit.md", tmp_path / "fit.png"
    res = run_python("scripts/ep_wire_fit.py", *paths, "--md", str(md), "--png", str(png))
    assert res.returncode == 0, res.stderr
    text = md.read_text()
    assert "within 10%" in text and "gain at 50 GB/s" in text and "crossover" in text
    assert png.stat().st_size > 10_000


def test_script_rejects_mixed_world_sizes_and_bad_arguments(tmp_path):
    a, b = _record(0.03, 150.0, ROWS), _record(0.06, 20.0, ROWS, world=4)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    res = run_python("scripts/ep_wire_fit.py", f"nvlink={tmp_path / 'a.json'}", f"shm={tmp_path / 'b.json'}")
    assert res.returncode == 2 and "world size" in res.stderr, res.stderr
    res = run_python("scripts/ep_wire_fit.py", str(tmp_path / "a.json"))
    assert res.returncode == 2 and "NAME=FILE" in res.stderr, res.stderr
    res = run_python("-m", "benchmarks.bench_ep", "--device", "cpu", "--rows", "bf16,fp4")
    assert res.returncode == 2 and "argument --rows" in res.stderr and "fp4" in res.stderr, res.stderr
    assert Path(ROOT / "scripts" / "ep_wire_runs.sh").exists()
