"""The main job, `python -m flashforge.bench` (scripts/main.sh): its rows, a preset of the benchmark
library's, and its driver -- output, JSON, --check-only and the exit status -- on the CPU."""
import json

import pytest
import torch

from flashforge import bench
from flashforge.benchmark.cases import Case
from flashforge.benchmark.report import make_row
from flashforge.benchmark.suites import cpu_cases, gpu_main_cases, main_cases


def test_cpu_rows():
    """float32 and bfloat16, torch's threads and one: B=1, H=8, D=64, S 512/1024/2048 causal or not, fwd and
    fwd+bwd, and a decoding step of 1 query against 16k keys, each against SDPA."""
    cases = cpu_cases(default_threads=2)
    assert len(cases) == 2 * 2 * (12 + 1)
    assert len({(c.label, c.mode) for c in cases}) == len(cases)
    assert all(c.peers == ("sdpa",) and (c.B, c.Hq, c.Hkv, c.D) == (1, 8, 8, 64) for c in cases)
    for threads in (None, 1):
        for dtype in ("float32", "bfloat16"):
            sub = [c for c in cases if c.threads == threads and c.dtype == dtype]
            grid = [c for c in sub if c.Sq == c.Sk]
            assert {(c.Sq, c.causal, c.mode) for c in grid} == {(s, causal, m) for s in (512, 1024, 2048)
                                                                for causal in (False, True) for m in ("fwd", "fwdbwd")}
            (dec,) = [c for c in sub if c.Sq != c.Sk]
            assert (dec.Sq, dec.Sk, dec.causal, dec.mode) == (1, 16384, False, "fwd")
    # the historical rows first: float32 on torch's threads
    assert [c.dtype for c in cases[:13]] == ["float32"] * 13 and all(c.threads is None for c in cases[:26])
    # one thread is not run twice on a one-core machine
    assert len(cpu_cases(default_threads=1)) == 26 and all(c.threads is None for c in cpu_cases(1))
    assert main_cases("cpu", 4) == cases


def test_gpu_rows():
    cases = gpu_main_cases()
    assert len(cases) == 24 and cases == main_cases("cuda")
    assert [c.mode for c in cases] == ["fwd", "fwdbwd"] * 12  # each shape, forward then forward+backward
    assert all(c.grid and c.peers == ("fa4", "cudnn") and c.dtype == "bfloat16" for c in cases)
    assert {(c.D, c.Sq, c.causal) for c in cases} == {(d, s, causal) for d in (64, 128) for s in (1024, 4096, 16384)
                                                       for causal in (False, True)}


def _tiny(monkeypatch):
    cases = [Case("cpu", "fwd", 1, 24, 24, 2, 2, 16, "float32", peers=("sdpa",)),
             Case("cpu", "fwdbwd", 1, 24, 24, 2, 2, 16, "bfloat16", causal=True, peers=("sdpa",), threads=1)]
    monkeypatch.setattr(bench, "main_cases", lambda device_type, threads: cases)
    return cases


def test_check_only_writes_the_self_check(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    assert bench.main(["--check-only", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["ok"] and report["bench"] == [] and len(report["check"]) == 7
    assert all(c["ok"] and c["dtype"] == "float32" for c in report["check"])
    assert report["environment"]["device"] == "cpu" and "fa4" not in report["environment"]
    assert "self-check: 7 passed, 0 failed" in out and "benchmark," not in out
    assert out.rstrip().splitlines()[-1] == "RESULT: ok"


def test_benchmark_tables_json_and_exit_status(tmp_path, capsys, monkeypatch):
    _tiny(monkeypatch)
    monkeypatch.setattr(bench, "self_check", lambda device, report, path: True)
    path = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert [r["name"] for r in report["bench"]] == ["D=16 S=24 fp32", "D=16 S=24 causal 1 thread"]
    assert all(r["ok"] and r["unit"] == "GFLOP/s" and r["ratio_to"] == "sdpa" for r in report["bench"])
    first = report["bench"][0]
    assert first["ratio"] == pytest.approx(first["ours"] / first["peers"]["sdpa"])
    # one table per dtype and thread count, each row with ours / SDPA
    n = torch.get_num_threads()
    assert f"== benchmark, cpu float32, {n} thread" in out and "== benchmark, cpu bfloat16, 1 thread (" in out
    assert out.count(" sdpa  ") >= 2 and "RESULT: ok" in out


def test_a_failed_row_fails_the_job(tmp_path, capsys, monkeypatch):
    cases = _tiny(monkeypatch)
    monkeypatch.setattr(bench, "self_check", lambda device, report, path: True)
    monkeypatch.setattr(bench.Runner, "run_or_report",
                        lambda self, case: [make_row(case, 1.0, {"sdpa": 2.0}, ok=case is not cases[1],
                                                     error="" if case is not cases[1] else "differs from math")])
    assert bench.main(["--device", "cpu", "--json", str(tmp_path / "b.json")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "differs from math" in out
    assert out.rstrip().splitlines()[-1] == "RESULT: FAILED (benchmark)"
    assert json.loads((tmp_path / "b.json").read_text())["ok"] is False


def test_gpu_rows_table_has_fa4_cudnn_and_geomeans(tmp_path, capsys, monkeypatch):
    """The GPU preset's rows, shrunk onto the CPU with a fake FA4: ours, FA4 and cuDNN per row (cuDNN cannot
    run on the CPU: '-'), ours / the faster, and the grid's geometric means."""
    import sys

    from fake_fa4 import fake_fa4_module
    from flashforge.benchmark import fa4
    from flashforge.benchmark.suites import shrink
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake_fa4_module([]))
    fa4.load.cache_clear()
    cases = [shrink(c) for c in gpu_main_cases()[:4]]
    monkeypatch.setattr(bench, "main_cases", lambda device_type, threads: cases)
    monkeypatch.setattr(bench, "self_check", lambda device, report, path: True)
    try:
        assert bench.main(["--device", "cpu", "--json", str(tmp_path / "b.json")]) == 0
    finally:
        fa4.load.cache_clear()
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "b.json").read_text())
    assert all(r["peers"]["fa4"] and r["peers"]["cudnn"] is None and r["ratio_to"] == "fa4" for r in report["bench"])
    assert set(report["grid_geomeans"]) == {"fwd", "fwd+bwd"} and report["grid_geomeans"]["fwd"]["rows"] == 2
    head = next(line for line in out.splitlines() if line.startswith("case"))
    assert head.split()[2:6] == ["ours", "fa4", "cudnn", "ours/best"]
    assert "geomean over the 2 standard-grid rows, fwd+bwd: ours/best" in out
