"""CPU tests of the benchmark library (flashforge/benchmark/), its command line benchmarks/attention_bench.py
and benchmarks/tune/sweep.py: the pure parts (FLOP and byte formulas, case lists, ratios, rows, tables,
geometric means, JSON, plots, the CPU timer's stopping rule), FA4's peer through a fake module, a few
shrunk cases run end to end on the CPU, and the scripts' clean exit without CUDA."""
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from flashforge.benchmark import fa4
from flashforge.benchmark.cases import Case
from flashforge.benchmark.checks import finite_check, rel_errors
from flashforge.benchmark.cli import main
from flashforge.benchmark.flex import band_mod, doc_mod
from flashforge.benchmark.flops import case_bytes, case_flops, row_unit, throughput
from flashforge.benchmark.inputs import band_mask
from flashforge.benchmark.plots import plot_rows
from flashforge.benchmark.report import (format_geomeans, format_graph_table, format_table, grid_geomeans, make_row,
                                         ratios, write_json)
from flashforge.benchmark.runner import Runner
from flashforge.benchmark.suites import (ALL_ORDER, DECODE_CACHE_LIMIT, SUITES, build_cases, compare_cases,
                                         decode_cases, feature_cases, grid_cases, headdim_cases, memory_cases,
                                         parse_suites, shrink, trim_flex, varlen_cases, varlen_lengths)
from flashforge.benchmark.timing import Timing, count_timed, timing_plan

from fake_fa4 import fake_fa4_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", "tune", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sweep = _load("sweep")


def _case(**kw):
    base = dict(suite="fwd", mode="fwd", B=4, Sq=4096, Sk=4096, Hq=16, Hkv=16, D=128)
    base.update(kw)
    return Case(**base)


# ---------------------------------------------------------------------------------------------
# formulas


def test_flops_follow_perf_md():
    dense = 4.0 * 4 * 16 * 4096 * 4096 * 128
    assert case_flops(_case()) == dense
    assert case_flops(_case(causal=True)) == dense / 2
    assert case_flops(_case(mode="fwdbwd", causal=True)) == pytest.approx(3.5 * dense / 2)
    # causal window 1024 counted on the band: 4 * B * H * S * 1024 * D
    assert case_flops(_case(causal=True, window=1023)) == 4.0 * 4 * 16 * 4096 * 1024 * 128
    # prefill: Sq = 1k queries at offset 15k see 15k + i + 1 keys: Sq * offset + Sq^2 / 2
    pre = _case(Sq=1024, Sk=16384, causal=True, offset=15 * 1024)
    assert case_flops(pre) == 4.0 * 4 * 16 * 128 * (1024 * 15 * 1024 + 1024 * 1024 / 2)
    # varlen: the sum over the sequences
    vl = _case(suite="varlen", B=3, Sq=300, Sk=300, seqlens=(100, 200, 300))
    assert case_flops(vl) == 4.0 * 16 * 128 * (100**2 + 200**2 + 300**2)
    assert case_flops(dataclasses.replace(vl, causal=True)) == case_flops(vl) / 2


def test_decode_bytes_and_units():
    c = Case("decode", "decode", 32, 1, 8192, 32, 8, 128)
    assert case_bytes(c) == 2 * 32 * 8192 * 8 * 128 * 2
    assert c.unit == "GB/s" and c.pass_label == "decode" and not c.backward
    assert throughput(c, 1.0) == pytest.approx(case_bytes(c) / 1e-3 / 1e9)
    assert throughput(_case(), 2.0) == pytest.approx(case_flops(_case()) / 2e-3 / 1e12)
    assert throughput(_case(), None) is None
    assert memory_cases()[0].unit == "GiB"
    # a CPU counts GFLOP/s (bytes stay GB/s)
    assert row_unit(_case(), "cpu") == "GFLOP/s" and row_unit(_case(), "cuda") == "TFLOP/s"
    assert row_unit(c, "cpu") == "GB/s"
    assert throughput(_case(), 2.0, "GFLOP/s") == pytest.approx(1e3 * throughput(_case(), 2.0))


# ---------------------------------------------------------------------------------------------
# case lists


def test_standard_grid():
    for mode in ("fwd", "fwdbwd"):
        cases = grid_cases(mode)
        assert len(cases) == 12
        assert {(c.D, c.Sq, c.causal) for c in cases} == {(d, s, c) for d in (64, 128) for s in (1024, 4096, 16384)
                                                           for c in (False, True)}
        for c in cases:
            assert c.B * c.Sq == 16384 and c.Hq * c.D == 2048 and c.Hq == c.Hkv and c.Sq == c.Sk
            assert c.mode == mode and c.suite == mode and c.grid
            assert c.peers[:2] == ("fa4", "cudnn")


def test_compare_suite():
    """The FA4 / cuDNN table: the 24 grid rows first (a run cut short still has the geomeans), then GQA 32/8
    S = 4k causal, a causal window of 1023 at S = 16k, D = 256 (H = 8) at 4k and 16k, causal or not."""
    cases = compare_cases()
    assert len(cases) == 24 + 2 + 2 + 8 + 2
    assert all(c.peers == ("fa4", "cudnn") and c.suite == "compare" and c.dtype == "bfloat16" for c in cases)
    assert [c.grid for c in cases] == [True] * 24 + [False] * 14
    assert [c.mode for c in cases[:24]] == ["fwd"] * 12 + ["fwdbwd"] * 12
    gqa, win, d256, cap = cases[24:26], cases[26:28], cases[28:36], cases[36:]
    assert all((c.B, c.Sq, c.Hq, c.D, c.causal, c.softcap) == (4, 4096, 16, 128, True, 30.0) for c in cap)
    assert all(c.softcap == 0 for c in cases[:36]) and cap[0].label == "D=128 S=4k causal softcap 30"
    assert all((c.B, c.Sq, c.Hq, c.Hkv, c.D, c.causal) == (4, 4096, 32, 8, 128, True) for c in gqa)
    assert all((c.B, c.Sq, c.Hq, c.D, c.causal, c.window) == (1, 16384, 16, 128, True, 1023) for c in win)
    assert {(c.Sq, c.B, c.causal, c.mode) for c in d256} == {(s, 16384 // s, causal, m) for s in (4096, 16384)
                                                             for causal in (False, True) for m in ("fwd", "fwdbwd")}
    assert all(c.D == 256 and c.Hq == c.Hkv == 8 for c in d256)
    # PERF.md's counts: the window on its band, 4 * B * H * S * 1024 * D; D = 256 causal halved
    assert case_flops(win[0]) == 4.0 * 16 * 16384 * 1024 * 128 and case_flops(win[1]) == 3.5 * case_flops(win[0])
    causal16k = next(c for c in d256 if c.Sq == 16384 and c.causal and c.mode == "fwd")
    assert case_flops(causal16k) == 4.0 * 8 * 16384 * 16384 * 256 / 2
    assert len({(c.label, c.mode) for c in cases}) == len(cases)
    assert {c.dtype for c in compare_cases("float16")} == {"float16"}


def test_other_suites():
    feats = feature_cases()
    assert len(feats) == 16 and len({(c.label, c.mode) for c in feats}) == 16
    gqa = [c for c in feats if c.Hq != c.Hkv]
    assert {(c.Hq, c.Hkv, c.causal) for c in gqa} == {(32, 8, True)}
    assert any(c.dropout == 0.1 and c.bias and c.mode == "fwdbwd" for c in feats)
    assert any(c.bias_grad for c in feats) and any(c.deterministic for c in feats)
    # FA4 where it can take the row: no bias, no dropout, no deterministic comparison
    assert all(("fa4" in c.peers) == (not c.bias and not c.deterministic) for c in feats)
    assert all(fa4.unsupported(c) is None for c in feats if "fa4" in c.peers)
    win = [c for c in feats if c.window is not None]
    assert win and all(c.window == 1023 and c.causal and "flash" not in c.peers for c in win)
    pre = [c for c in feats if c.offset]
    assert len(pre) == 1 and pre[0].Sq == 1024 and pre[0].Sk == 16384 and pre[0].offset == 15 * 1024

    dec = decode_cases()
    assert len(dec) == 11  # 4 x 3 minus B = 128 with a 128k cache (69 GB)
    assert all(case_bytes(c) <= DECODE_CACHE_LIMIT and c.Sq == 1 and (c.Hq, c.Hkv, c.D) == (32, 8, 128)
               for c in dec)
    assert (128, 131072) not in {(c.B, c.Sk) for c in dec}

    lens = varlen_lengths(16, 16384)
    assert len(lens) == 16 and sum(lens) == 16384 and min(lens) >= 128 and len(set(lens)) > 1
    assert lens == varlen_lengths(16, 16384)  # reproducible
    # the random lengths, then 4 x 4k: the padded batch of those is the dense B = 4, S = 4k batch
    assert [c.seqlens for c in varlen_cases()] == [lens] * 4 + [(4096,) * 4] * 4
    assert len({(c.label, c.mode) for c in varlen_cases()}) == 8

    mem = memory_cases()
    assert [(c.B, c.Sq, c.Hq, c.D, c.causal, c.mode) for c in mem] == [(1, 131072, 16, 128, True, "memory")]

    hd = headdim_cases()
    assert len(hd) == 10 and {c.D for c in hd} == {32, 96, 256, 64, 128}
    assert {c.D for c in hd if c.dtype == "float32"} == {64, 128}
    assert len(headdim_cases("float32")) == 6
    assert all(("fa4" in c.peers) == (c.dtype != "float32") for c in hd)


def test_parse_suites():
    assert parse_suites("all") == list(ALL_ORDER)
    assert sorted(ALL_ORDER) == sorted(set(SUITES) - {"compare"})  # compare repeats rows of the others
    assert parse_suites("compare") == ["compare"]
    assert parse_suites("fwd, decode") == ["fwd", "decode"]
    with pytest.raises(ValueError, match="unknown suite"):
        parse_suites("fwd,nope")
    assert count_timed(decode_cases()) == 11 * 6  # ours, paged, fa4, cudnn, flash, flex


def test_trim_flex_for_all():
    cases = [c for s in ALL_ORDER for c in build_cases(s)]
    trimmed = trim_flex(cases)
    assert [(c.suite, c.mode, c.label) for c in trimmed] == [(c.suite, c.mode, c.label) for c in cases]
    flex = {(c.suite, c.D) for c in trimmed if "flex" in c.peers}
    assert ("fwd", 64) not in flex and ("fwd", 128) in flex and ("fwdbwd", 128) in flex
    assert {d for s, d in flex if s == "headdims"} == {256}
    assert ("decode", 128) in flex and ("varlen", 128) in flex and ("features", 128) in flex


def test_timing_plan():
    assert timing_plan(300, 25, 100, 200) == (25, 100)
    assert timing_plan(300, 25, 100, None) == (25, 100)
    w, r = timing_plan(3000, 25, 100, 200)
    assert 5 <= w < 25 and 20 <= r < 100


# ---------------------------------------------------------------------------------------------
# rows, table, plots


def test_ratios():
    # ours / the faster of FA4 and cuDNN, whichever it is; both kept
    r = ratios(300.0, {"fa4": 600.0, "cudnn": 500.0, "flex": 900.0}, "TFLOP/s")
    assert r == {"ratio": 0.5, "ratio_to": "fa4", "ratio_fa4": 0.5, "ratio_cudnn": 0.6}
    assert ratios(300.0, {"fa4": 400.0, "cudnn": 600.0}, "TFLOP/s")["ratio_to"] == "cudnn"
    # FA4 missing (None: not importable, or it refused the case): cuDNN alone
    r = ratios(300.0, {"fa4": None, "cudnn": 600.0, "flex": 400.0}, "TFLOP/s")
    assert r == {"ratio": 0.5, "ratio_to": "cudnn", "ratio_fa4": None, "ratio_cudnn": 0.5}
    # neither: the best peer that ran (the CPU's SDPA, or the varlen peers)
    r = ratios(300.0, {"cudnn": None, "flash": 200.0, "flex": 400.0}, "TFLOP/s")
    assert (r["ratio"], r["ratio_to"], r["ratio_cudnn"]) == (0.75, "flex", None)
    assert ratios(30.0, {"sdpa": 40.0}, "GFLOP/s")["ratio"] == 0.75
    # memory: the best is the least
    assert ratios(2.0, {"fa4": 8.0, "cudnn": 4.0}, "GiB")["ratio"] == 0.5
    assert ratios(2.0, {"cudnn": None, "flash": 4.0, "x": 8.0}, "GiB")["ratio_to"] == "flash"
    assert ratios(None, {"cudnn": 1.0}, "TFLOP/s") == {"ratio": None, "ratio_to": None, "ratio_fa4": None,
                                                       "ratio_cudnn": None}
    assert ratios(1.0, {"cudnn": None, "fa4": None}, "TFLOP/s")["ratio"] is None


def _fake_rows():
    rows = []
    for c in grid_cases("fwd"):
        rows.append(make_row(c, 300.0 + c.D, {"cudnn": 500.0, "flash": None if c.causal else 320.0,
                                                 "efficient": 200.0, "flex": 350.0}, ok=True))
    for c in decode_cases()[:4]:
        for layout in ("contiguous", "paged"):
            rows.append(make_row(c, 2000.0, {"cudnn": 3000.0, "flash": None, "flex": 1500.0}, ok=True,
                                    layout=layout))
    for c in feature_cases()[:6]:
        rows.append(make_row(c, 250.0, {n: (None if n == "cudnn" else 260.0) for n in c.peers},
                                ok=c.mode == "fwd", error="" if c.mode == "fwd" else "differs from cudnn: o=1e-1"))
    return rows


def test_row_json_and_table():
    rows = _fake_rows()
    r = rows[0]
    assert set(r) >= {"suite", "case", "ours", "peers", "unit", "ratio_cudnn", "ok", "error"}
    assert r["ratio_cudnn"] == pytest.approx(364 / 500) and r["ratio_to"] == "cudnn"
    json.loads(json.dumps({"environment": {}, "rows": rows}))  # plain JSON
    dec = [x for x in rows if x["suite"] == "decode"]
    assert {x["case"]["layout"] for x in dec} == {"contiguous", "paged"} and dec[0]["unit"] == "GB/s"

    table = format_table([x for x in rows if x["suite"] == "fwd"], "fwd bfloat16")
    lines = table.splitlines()
    assert lines[0].startswith("== fwd bfloat16 (TFLOP/s")
    assert len(lines) == 2 + 1 + 12  # title, header, rule, rows
    assert "D=64 S=1k causal" in table and " - " in table and "0.73" in table and "mem-eff" in table
    feats = format_table([x for x in rows if x["suite"] == "features"], "features")
    assert "FAIL" in feats and "notes:" in feats and "differs from cudnn" in feats
    assert "flash" in feats.splitlines()[3] or "flex" in feats  # ratio to the best peer is named
    assert format_table([]) == ""


def _grid_row(c, ours, fa4_v, cudnn_v, **kw):
    return make_row(c, ours, {"fa4": fa4_v, "cudnn": cudnn_v}, ok=True, **kw)


def test_table_ratio_to_the_faster_yardstick_and_fa4_missing():
    c = grid_cases("fwd")[0]
    faster = format_table([_grid_row(c, 300.0, 600.0, 500.0)], "t")
    assert "0.50 fa4" in faster and "FA4 not available" not in faster
    # FA4 could not be imported: its column is "-", the ratio is to cuDNN, and the table says so
    missing = format_table([_grid_row(c, 300.0, None, 500.0)], "t", fa4_error="ModuleNotFoundError: flash_attn")
    lines = missing.splitlines()
    assert lines[1] == ("FA4 not available (ModuleNotFoundError: flash_attn): its column is '-' and ours/best is "
                        "ours / cuDNN")
    head, row = lines[2].split(), lines[4].split()
    assert head[3:5] == ["fa4", "cudnn"] and row[3:8] == ["300", "-", "500", "0.60", "cudnn"]
    # a table whose rows never ask for FA4 does not mention it
    cpu = Case("cpu", "fwd", 1, 512, 512, 8, 8, 64, "float32", peers=("sdpa",))
    text = format_table([make_row(cpu, 30.0, {"sdpa": 40.0}, ok=True, unit="GFLOP/s")], "cpu", fa4_error="x")
    assert "FA4 not available" not in text and "0.75 sdpa" in text
    assert text.splitlines()[0] == "== cpu (GFLOP/s; ours/best = ours / the peer named) =="


def test_grid_geomeans():
    rows = []
    for i, c in enumerate(grid_cases("fwd") + grid_cases("fwdbwd")):
        # fwd: ours at 0.5x FA4 in half the rows and 0.8x in the rest; FA4 missing in two fwd+bwd rows
        fa4_v = None if c.mode == "fwdbwd" and i % 6 == 0 else 100.0
        rows.append(_grid_row(c, 50.0 if i % 2 else 80.0, fa4_v, 80.0))
    rows.append(_grid_row(feature_cases()[0], 1.0, 100.0, 100.0))  # not a grid row: left out
    rows.append(make_row(grid_cases("fwd")[0], None, {"fa4": None, "cudnn": None}, ok=True,
                         extra={"skipped": True}))  # skipped: left out
    g = grid_geomeans(rows)
    assert g["fwd"]["rows"] == 12 and g["fwd"]["ratio_rows"] == 12
    assert g["fwd"]["ratio"] == pytest.approx(math.sqrt(0.5 * 0.8))
    assert g["fwd"]["ratio_cudnn"] == pytest.approx(math.sqrt(0.625 * 1.0))
    # where FA4 is missing the row's best is cuDNN; ours/FA4 is over the rows that have FA4
    assert g["fwd+bwd"]["ratio_fa4_rows"] == 10 and g["fwd+bwd"]["ratio_rows"] == 12
    text = format_geomeans(rows)
    assert text.splitlines()[0].startswith("geomean over the 12 standard-grid rows, fwd: ours/best 0.632 (12 rows)")
    assert "ours/FA4" in text and len(text.splitlines()) == 2
    assert format_geomeans(rows[-2:-1]) == "" and grid_geomeans([]) == {}


def test_json_round_trip(tmp_path):
    rows = _fake_rows()
    rows[0]["check"] = {"ours": {"o": math.inf, "dq": 1e-3}}
    path = tmp_path / "sub" / "r.json"
    write_json(str(path), {"environment": {"fa4": {"available": False, "error": "x"}}, "rows": rows})
    back = json.loads(path.read_text())  # strict JSON: no Infinity
    assert back["rows"][0]["check"]["ours"] == {"o": "inf", "dq": 1e-3}
    assert [r["ratio"] for r in back["rows"]] == [r["ratio"] for r in rows]
    assert back["rows"][1]["case"] == json.loads(json.dumps(rows[1]["case"]))
    assert not (tmp_path / "sub" / "r.json.tmp").exists()


def test_cpu_timing_stops_by_count_budget_or_cap():
    t = Timing(cpu_budget_s=0.5, cpu_min_runs=3, cpu_cap_s=1.5, cpu_max_runs=10)
    assert t.more_runs([], True)                      # always one run
    assert t.more_runs([10.0, 10.0], True)            # fewer than the minimum of short runs
    assert not t.more_runs([10.0] * 3, True)          # the minimum, budget spent
    assert t.more_runs([10.0] * 3, False) and not t.more_runs([10.0] * 10, False)
    assert not t.more_runs([1600.0], False)           # one run of seconds is enough
    assert t.more_runs([700.0], False) and not t.more_runs([700.0, 900.0], False)


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _fake_rows()
    for suite in ("fwd", "decode", "features"):
        path = tmp_path / f"{suite}.png"
        assert plot_rows([x for x in rows if x["suite"] == suite], str(path), suite) is None
        assert path.read_bytes()[:4] == b"\x89PNG"
    assert plot_rows(rows, str(tmp_path / "all.png"), "all") is None
    assert (tmp_path / "all.png").stat().st_size > 1000


def test_plot_without_data_or_matplotlib(tmp_path):
    c = grid_cases("fwd")[0]
    assert plot_rows([make_row(c, None, {"cudnn": None}, ok=False)], str(tmp_path / "x.png"), "x") \
        == "nothing to plot"
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------
# masks: the peers get the same problem as flashforge


def test_band_mask_matches_flashforge_and_flex_mask_mod():
    import flashforge
    g = torch.Generator().manual_seed(0)
    Sq, Sk, off, w = 12, 40, 28, 9
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for n in (Sq, Sk, Sk))
    keep = band_mask(Sq, Sk, off, w)
    ours = flashforge.attention(q, k, v, causal=True, causal_offset=off, window=(w, 0), backend="torch")
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=keep).transpose(1, 2)
    torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)
    i, j = torch.arange(Sq).view(-1, 1), torch.arange(Sk).view(1, -1)
    assert torch.equal(band_mod(off, w)(0, 0, i, j), keep[0, 0])
    assert band_mod(off, w) is band_mod(off, w)  # one function object: no Flex recompiles
    assert torch.equal(band_mod(0, None)(0, 0, i, j[:, :Sq]), torch.ones(Sq, Sq).tril().bool())
    doc = torch.tensor([0, 0, 1, 1, 1])
    m = doc_mod(doc, True)(0, 0, torch.arange(5).view(-1, 1), torch.arange(5).view(1, -1))
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_rel_errors():
    a = torch.ones(4, 4)
    assert rel_errors([a], [a]) == {"o": 0.0}
    assert rel_errors([a * 1.01], [a])["o"] == pytest.approx(0.01, rel=1e-3)
    assert rel_errors([a.clone().fill_(float("nan"))], [a])["o"] == math.inf
    assert rel_errors([a[:2]], [a])["o"] == math.inf
    assert finite_check([a, a[:1]], [(4, 4), (4, 4)]) == {"o": 0.0, "dq": math.inf}


# ---------------------------------------------------------------------------------------------
# shrunk cases, end to end on the CPU (the harness, not the numbers)


@pytest.mark.parametrize("pick", [
    lambda: grid_cases("fwd")[1],
    lambda: grid_cases("fwdbwd")[1],
    lambda: decode_cases()[0],
    lambda: next(c for c in feature_cases() if c.dropout),
    lambda: next(c for c in feature_cases() if c.bias_grad),
    lambda: varlen_cases()[3],
], ids=["fwd", "fwdbwd", "decode", "dropout", "bias-grad", "varlen"])
def test_cpu_smoke_case(pick):
    case = shrink(pick())
    runner = Runner(torch.device("cpu"), flex_compiled=False, skip=("flex",))
    rows = runner.run_case(case)
    assert len(rows) == (2 if case.mode == "decode" else 1)
    for r in rows:
        assert r["ok"], r
        assert r["ours"] is not None and r["ours"] > 0
        assert set(r["peers"]) == set(case.peers) - {"flex"}
        if not case.dropout:
            assert r["check"]["ref"] and max(r["check"]["ours"].values()) < 2e-2
    json.dumps(rows)


def test_main_cpu_smoke_writes_json(tmp_path, capsys):
    rc = main(["--suite", "fwd", "--filter", "D=64 S=1k causal", "--cpu-smoke", "--out", str(tmp_path),
                  "--skip", "flex"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "fwd.json").read_text())
    assert report["ok"] and len(report["rows"]) == 1 and report["environment"]["torch"] == torch.__version__
    assert "== fwd" in out and out.rstrip().splitlines()[-1].startswith("RESULT: ok")


def test_runner_sets_threads_per_case(monkeypatch):
    """A case with threads runs (and is timed) on that many, and torch's setting comes back after."""
    seen = []
    real = Timing.cpu_ms

    def spy(self, fn, grad_to_none=None):
        seen.append(torch.get_num_threads())
        return real(self, fn, grad_to_none)
    monkeypatch.setattr(Timing, "cpu_ms", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        case = Case("cpu", "fwd", 1, 32, 32, 2, 2, 16, "float32", peers=("sdpa",), threads=1)
        rows = Runner(torch.device("cpu")).run_case(case)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1] and rows[0]["ok"] and rows[0]["unit"] == "GFLOP/s"
    assert rows[0]["case"]["threads"] == 1 and rows[0]["name"].endswith("fp32 1 thread")
    assert rows[0]["ratio_to"] == "sdpa" and rows[0]["check"]["ref"] == "math"


# ---------------------------------------------------------------------------------------------
# FA4: a fake module stands in for flash_attn.cute (the real one needs an sm90 GPU)


@pytest.fixture
def fresh_fa4():
    fa4.load.cache_clear()  # the import is cached per process
    yield
    fa4.load.cache_clear()


@pytest.mark.parametrize("pick", [
    lambda: compare_cases()[1],                                       # grid, causal, fwd
    lambda: compare_cases()[13],                                      # grid, causal, fwd+bwd
    lambda: compare_cases()[25],                                      # GQA 32/8 causal, fwd+bwd
    lambda: compare_cases()[27],                                      # causal window, fwd+bwd
    lambda: compare_cases()[37],                                      # softcap, fwd+bwd
    lambda: next(c for c in feature_cases() if c.offset),             # prefill: offset Sk - Sq
    lambda: next(c for c in varlen_cases() if c.causal and c.backward),
    lambda: decode_cases()[0],
], ids=["grid-fwd", "grid-fwdbwd", "gqa", "window", "softcap", "prefill", "varlen", "decode"])
def test_fa4_peer_through_a_fake_module(pick, monkeypatch, fresh_fa4):
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake_fa4_module(calls))
    case = shrink(pick())
    rows = Runner(torch.device("cpu"), flex_compiled=False, skip=("flex",)).run_case(case)
    assert calls and calls[0][1] == (case.causal and case.mode != "decode")
    if case.window is not None:
        assert calls[0][2] == (case.window, 0)
    if case.softcap:  # FA4 got the softcap; SDPA has none, so our PyTorch path is the reference
        assert calls[0][3] == case.softcap
        assert all(r["check"]["ref"] == "fp32_torch" and "softcap" in r["peer_errors"]["cudnn"] for r in rows)
    for r in rows:
        assert r["ok"], r
        assert r["peers"]["fa4"] > 0 and r["ratio_fa4"] == pytest.approx(r["ours"] / r["peers"]["fa4"])
        # FA4 ran on the same problem: its output (and gradients) match the same reference as ours
        assert max(r["check"]["peers"]["fa4"].values()) < 2e-2, r["check"]
        if "cudnn" in r["peers"] and r["peers"]["cudnn"] is None:  # cuDNN cannot run on the CPU
            assert r["ratio_to"] == "fa4"


def test_fa4_missing_leaves_a_dash_and_the_reason(monkeypatch, fresh_fa4):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ImportError
    assert fa4.status() == {"available": False,
                            "error": "ModuleNotFoundError: import of flash_attn.cute halted; None in sys.modules"}
    case = shrink(compare_cases()[0])
    r = Runner(torch.device("cpu")).run_case(case)[0]
    assert r["ok"] and r["peers"]["fa4"] is None and "FA4 not importable" in r["peer_errors"]["fa4"]


def test_fa4_says_what_it_cannot_take():
    c = compare_cases()[0]
    assert fa4.unsupported(c) is None
    assert "float32" in fa4.unsupported(dataclasses.replace(c, dtype="float32"))
    assert "bias" in fa4.unsupported(dataclasses.replace(c, bias=True))
    assert "dropout" in fa4.unsupported(dataclasses.replace(c, dropout=0.1))
    assert "bottom-right" in fa4.unsupported(dataclasses.replace(c, Sq=100, Sk=300, causal=True, offset=7))
    assert fa4.unsupported(dataclasses.replace(c, Sq=100, Sk=300, causal=True, offset=200)) is None
    assert "head dims" in fa4.unsupported(dataclasses.replace(c, D=260))
    with pytest.raises(NotImplementedError, match="bias"):
        fa4.fa4_impl(dataclasses.replace(c, bias=True), None)


def test_compare_suite_cpu_smoke_prints_fa4_and_geomeans(tmp_path, capsys, monkeypatch, fresh_fa4):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake_fa4_module([]))
    rc = main(["--suite", "compare", "--filter", "D=64 S=1k", "--cpu-smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert len(report["rows"]) == 4 and all(r["peers"]["fa4"] for r in report["rows"])
    assert report["environment"]["fa4"]["available"] is True
    assert set(report["grid_geomeans"]["compare"]) == {"fwd", "fwd+bwd"}
    text = (tmp_path / "compare.txt").read_text()
    assert "geomean over the 2 standard-grid rows, fwd: ours/best" in text and "fa4" in text.splitlines()[1]
    assert out.rstrip().splitlines()[-1].startswith("RESULT: ok")


# ---------------------------------------------------------------------------------------------
# no CUDA: a clear message, no traceback


def test_script_exits_cleanly_without_cuda(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "attention_bench.py"), "--suite", "fwd",
                           "--out", str(tmp_path / "x")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_sweep_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sweep.main(["--head-dim", "128"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_sweep_pure_parts():
    from flashforge.ops.triton.configs import TileConfig
    assert sweep.shape(128) == (4, 16) and sweep.shape(64, 1024) == (16, 32)
    assert sweep.fwd_flops(4, 16, 4096, 128, True) == 4.0 * 4 * 16 * 4096 * 4096 * 128 / 2
    assert sweep.head_dim_bucket(96) == 128 and sweep.head_dim_bucket(32) == 64
    cur = TileConfig(128, 64, 8, 3)
    cands = sweep.candidates("fwd", current=cur)
    # the forward grid four times: pointer loads, TMA descriptors, warp-specialized, both
    assert cands[0] == cur and len(cands) == 144 and len(set(cands)) == 144
    assert sum(c.tma for c in cands) == 72 and sum(c.ws for c in cands) == 72
    assert sum(c.tma and c.ws for c in cands) == 36
    odd = TileConfig(32, 16, 2, 1)
    assert sweep.candidates("bwd_q", quick=True, current=odd)[0] == odd
    bwd_kv = sweep.candidates("bwd_kv", quick=True)
    assert len(bwd_kv) == 48 and sum(c.fused_dq for c in bwd_kv) == 24
    assert sweep.parse_configs("64x128w8s3fdq,128x64w8s3tma") == [TileConfig(64, 128, 8, 3, fused_dq=True),
                                                                   TileConfig(128, 64, 8, 3, tma=True)]
    with pytest.raises(ValueError):
        sweep.parse_configs("64x128w8")
    quick_fwd = sweep.candidates("fwd", quick=True)
    assert len(quick_fwd) == 48 and all(c.num_warps == (8 if c.block_m == 128 else 4) for c in quick_fwd)
    assert sweep.table_line("fwd", 128, 2, cur).strip() == '("fwd", 128, 2): TileConfig(128, 64, 8, 3),'
    assert sweep.table_line("fwd", 128, 2, TileConfig(128, 64, 8, 3, tma=True)).strip() == \
        '("fwd", 128, 2): TileConfig(128, 64, 8, 3, tma=True),'
    assert sweep.table_line("fwd", 128, 2, TileConfig(128, 64, 8, 3, ws=True)).strip() == \
        '("fwd", 128, 2): TileConfig(128, 64, 8, 3, ws=True),'


def test_bwd256_sweep_candidates_parse():
    """benchmarks/tune/bwd256_sweep.py: every candidate's spec parses (split_kv: the "skv" suffix)
    and its table line reads back; without CUDA the run exits 2."""
    from flashforge.ops.triton.configs import TileConfig
    b256 = _load("bwd256_sweep")
    assert sweep.parse_configs("16x128w8s1skvfdq") == [TileConfig(16, 128, 8, 1, fused_dq=True, split_kv=True)]
    assert sweep.table_line("bwd_kv", 256, 2, TileConfig(16, 128, 8, 2, split_kv=True)).strip() == \
        '("bwd_kv", 256, 2): TileConfig(16, 128, 8, 2, split_kv=True),'
    names = [n for n, _ in b256.CANDIDATES + b256.FWD_CANDIDATES]
    assert len(set(names)) == len(names) and names[0] == "table"
    for _, spec in b256.CANDIDATES + b256.FWD_CANDIDATES:
        for kind, cfg in b256.configs_of(spec).items():
            assert kind in ("fwd", "bwd_kv", "bwd_q") and b256.short(cfg) == spec[kind]
    if not torch.cuda.is_available():
        assert b256.main(["--budget", "1"]) == 2


def test_sweep_kind_ranks_correct_configs_only():
    from flashforge.ops.triton import configs
    from flashforge.ops.triton.configs import TileConfig
    ref = [torch.ones(8)]
    seen = []

    def run():  # what the kernel would compute under the config now in the table
        cfg = configs.get_config("fwd", 128, 2, False)
        seen.append(cfg)
        if cfg.block_n == 32:
            raise RuntimeError("out of resources: shared memory")
        return [ref[0] * (2.0 if cfg.num_warps == 8 else 1.0)]
    cands = [TileConfig(128, 64, 4, 3), TileConfig(64, 32, 4, 2), TileConfig(128, 128, 8, 2), TileConfig(64, 64, 4, 2)]
    times = iter([2.0, 1.0])
    res = sweep.sweep_kind("fwd", {"fwd": (run, ref)}, cands, 128, 2, 2e-2, 1e12, None, lambda fn: next(times),
                           log=lambda s: None)
    assert seen == cands
    assert configs.get_config("fwd", 128, 2, False) == configs._TABLE[("fwd", 128, 2)]  # restored
    assert [r["ok"] for r in res] == [True, False, False, True]
    assert "shared memory" in res[1]["error"] and res[2]["error"].startswith("wrong")
    assert res[3]["tflops"] == pytest.approx(1e12 / 1e-3 / 1e12)
    text = sweep.report("fwd", res, 128, 2, 3)
    assert "2 of 4 configs ran correctly" in text and "(2.00x table)" in text
    assert text.splitlines()[-1].strip() == 'table entry: ("fwd", 128, 2): TileConfig(64, 64, 4, 2),'


@pytest.mark.parametrize("n_k, n_v", [(3 * 8192 + 5, 2 * 4096 + 1), (1000, 70000)])
def test_read_floor_reads_every_element_once(n_k, n_v):
    """The decode table's floor kernel (flashforge/benchmark/read_floor.py) sums each of k's
    and v's elements exactly once, for every program shape it is timed with (interpreter)."""
    from flashforge.benchmark import read_floor
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors only in the interpreter
    k = torch.randn(n_k, dtype=torch.bfloat16, device=device)
    v = torch.randn(n_v, dtype=torch.bfloat16, device=device)
    want = k.double().sum() + v.double().sum()
    for fn in read_floor.readers(k, v):
        sink = fn()
        assert torch.isclose(sink.double().sum(), want, rtol=1e-4, atol=1e-2), (sink.sum(), want)
    with pytest.raises(ValueError, match="contiguous"):
        read_floor.readers(k[::2], v)


def test_graph_table_shows_the_read_floor_and_ratio():
    case = decode_cases()[0]
    row = make_row(case, 300.0, {"cudnn": 500.0}, ok=True, layout="contiguous",
                   extra={"cudagraph_gbps": {"ours": 1200.0, "cudnn": 1300.0, "read": 2400.0}})
    text = format_graph_table([row])
    assert "read" in text.splitlines()[1] and "ours/read" in text.splitlines()[1]
    assert text.splitlines()[-1].split()[-2:] == ["0.92", "0.50"]


def test_launcher_host_cpu_runs_the_sm90_launchers():
    """benchmarks/profile/launcher_host_cpu.py: the forward and backward launch code for sm_90
    runs without a GPU (kernels recorded) and reports its Gluon launches."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "benchmarks/profile/launcher_host_cpu.py", "--steps", "2", "--S", "256"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if "us a step" in line]
    # D = 128 (the script's default), 256 keys: the table's forward is the persistent warp-specialized kernel
    assert len(lines) == 2 and all("attn_bwd_dkdv_sm90_kernel" in line and "attn_fwd_persistent_sm90_kernel" in line
                                   for line in lines), out.stdout
