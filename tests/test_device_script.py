"""scripts/device.sh's test shards: together they run every test function of the GPU files they
name, each once (a function left out of both of test_gluon_sm90.py's lists would never run on the
device; one in both would run twice)."""
import ast
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _bash_array(text: str, name: str) -> list[str]:
    m = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M)
    assert m, f"{name}=(...) not found in scripts/device.sh"
    return m.group(1).split()


def _test_functions(path: str) -> set[str]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_gluon_shards_split_the_file_by_function():
    with open(os.path.join(ROOT, "scripts", "device.sh")) as f:
        text = f.read()
    fwd, bwd = _bash_array(text, "GLUON_FWD"), _bash_array(text, "GLUON_BWD")
    assert len(fwd) == len(set(fwd)) and len(bwd) == len(set(bwd))
    assert not set(fwd) & set(bwd), set(fwd) & set(bwd)
    assert set(fwd) | set(bwd) == _test_functions("tests/test_gluon_sm90.py")


def test_shard_files_exist():
    with open(os.path.join(ROOT, "scripts", "device.sh")) as f:
        text = f.read()
    for name in ("SHARD2", "SHARD3"):
        for item in _bash_array(text, name):
            path, _, func = item.partition("::")
            assert os.path.isfile(os.path.join(ROOT, path)), item
            if func:
                assert func in _test_functions(path), item


def _pytest_under_watchdog(tmp_path, source: str, *args: str):
    """pytest run in a subprocess on `source` (test_sleep.py) beside a copy of conftest.py, with
    FF_TEST_HANG_S=1."""
    import shutil
    import subprocess
    import sys
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_sleep.py").write_text(source)
    env = dict(os.environ, FF_TEST_HANG_S="1")
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "test_sleep.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)


def test_a_test_past_ff_test_hang_s_ends_its_process(tmp_path):
    """conftest.py's watchdog: the hung test is named and its process exits 70 (under xdist, the
    worker is replaced and the test reported as crashed)."""
    r = _pytest_under_watchdog(tmp_path, "import time\n\ndef test_sleeps():\n    time.sleep(60)\n", "-q")
    assert r.returncode == 70, (r.returncode, r.stdout[-500:], r.stderr[-500:])
    assert "test_sleep.py::test_sleeps still running after 1 s" in r.stderr


def test_hang_s_marker_extends_the_watchdog(tmp_path):
    """A test marked hang_s(M) gets max(FF_TEST_HANG_S, M) seconds: one that sleeps past the
    environment's limit but within its own passes; an unmarked one beside it still ends the process."""
    r = _pytest_under_watchdog(
        tmp_path, "import time\nimport pytest\n\n@pytest.mark.hang_s(30)\ndef test_long():\n    time.sleep(2)\n\n"
        "def test_short():\n    time.sleep(60)\n", "-v")
    assert "test_sleep.py::test_long PASSED" in r.stdout, (r.stdout[-800:], r.stderr[-500:])
    assert r.returncode == 70 and "test_sleep.py::test_short still running after 1 s" in r.stderr
