"""Rows and what is written from them: ratios, a row's JSON, the text table, the environment (versions,
device, git commit) and the JSON files."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from typing import Any, Optional, Sequence

import torch

from .cases import Case

# column order of the table; names not listed go last
PEER_ORDER = ("cudnn", "flash", "efficient", "flex", "varlen_attn", "ours_padded", "ours_default")
SHORT = {"efficient": "mem-eff", "varlen_attn": "fa-varlen", "ours_padded": "ours-pad",
         "ours_default": "ours-dflt"}


def ratios(ours: Optional[float], peers: dict, unit: str):
    """(ours / cuDNN or None, ours / (cuDNN, else the best peer that ran), the name of that peer)."""
    if ours is None:
        return None, None, None
    c = peers.get("cudnn")
    if c:
        return ours / c, ours / c, "cudnn"
    ran = {n: v for n, v in peers.items() if v}
    if not ran:
        return None, None, None
    best = (min if unit == "GiB" else max)(ran, key=ran.get)
    return None, ours / ran[best], best


def make_row(case: Case, ours: Optional[float], peers: dict, *, ok: bool, error: str = "", ms: Optional[dict] = None,
             check: Optional[dict] = None, peer_errors: Optional[dict] = None, extra: Optional[dict] = None,
             layout: Optional[str] = None) -> dict:
    ratio_cudnn, ratio, ratio_to = ratios(ours, peers, case.unit)
    desc = case.describe()
    name = case.label
    if layout:
        desc["layout"] = layout
        name += f" {layout}"
    return {"suite": case.suite, "name": name, "pass": case.pass_label, "case": desc, "unit": case.unit,
            "ours": ours, "peers": dict(peers), "ratio_cudnn": ratio_cudnn, "ratio": ratio, "ratio_to": ratio_to,
            "ok": bool(ok), "error": error, "ms": ms or {}, "check": check or {}, "peer_errors": peer_errors or {},
            "extra": extra or {}}


def skipped_row(case: Case, why: str) -> dict:
    return make_row(case, None, {n: None for n in case.peers}, ok=True, error=why, extra={"skipped": True})


def _fmt_value(x: Optional[float], unit: str) -> str:
    if x is None:
        return "-"
    if unit == "GiB":
        return f"{x:.2f}"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def peer_columns(rows: Sequence[dict]) -> list:
    names = {n for r in rows for n in r["peers"]}
    return [n for n in PEER_ORDER if n in names] + sorted(names - set(PEER_ORDER))


def format_table(rows: Sequence[dict], title: str = "") -> str:
    """One compact table (one row per case): ours, each peer, the ratio, ok."""
    if not rows:
        return ""
    cols = peer_columns(rows)
    units = sorted({r["unit"] for r in rows})
    wname = max(28, max(len(r["name"]) for r in rows))
    head = f"{'case':<{wname}} {'pass':<7} {'ours':>7}" + "".join(f" {SHORT.get(c, c):>9}" for c in cols)
    head += f" {'ratio':>14}  ok"
    lines = []
    if title:
        lines.append(f"== {title} ({', '.join(units)}; ratio = ours / cuDNN, else / the named best peer) ==")
    lines += [head, "-" * len(head)]
    for r in rows:
        u = r["unit"]
        line = f"{r['name']:<{wname}} {r['pass']:<7} {_fmt_value(r['ours'], u):>7}"
        line += "".join(f" {_fmt_value(r['peers'].get(c), u) if c in r['peers'] else '':>9}" for c in cols)
        if r["ratio"] is None:
            ratio = "-"
        elif r["ratio_to"] == "cudnn":
            ratio = f"{r['ratio']:.2f}"
        else:
            ratio = f"{r['ratio']:.2f} {SHORT.get(r['ratio_to'], r['ratio_to'])}"
        status = "skip" if r["extra"].get("skipped") else ("ok" if r["ok"] else "FAIL")
        lines.append(line + f" {ratio:>14}  {status}")
    notes = [f"  {r['name']} {r['pass']}: {r['error']}" for r in rows if r["error"] and not r["extra"].get("skipped")]
    skipped = [r for r in rows if r["extra"].get("skipped")]
    if skipped:
        notes.append(f"  {len(skipped)} rows not run: {skipped[0]['error']}")
    if notes:
        lines.append("notes:")
        lines += notes
    return "\n".join(lines)


def _short_error(e: BaseException, caught: Sequence = ()) -> str:
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:240]
    why = [str(w.message).strip().splitlines()[0][:160] for w in caught if str(w.message).strip()]
    return msg + (" | " + "; ".join(why[:2]) if why else "")


def git_commit(repo: str) -> dict:
    """The checkout's commit and whether it has local changes (None without git; $GIT_COMMIT wins)."""
    if os.environ.get("GIT_COMMIT"):
        return {"commit": os.environ["GIT_COMMIT"], "dirty": None}

    def run(*args):
        proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10)
        if proc.returncode:
            raise RuntimeError((proc.stderr.strip().splitlines() or ["git failed"])[0])
        return proc.stdout.strip()
    try:
        return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}
    except Exception as e:  # no git, not a checkout
        return {"commit": None, "dirty": None, "git_error": f"{type(e).__name__}: {e}"[:200]}


def environment(device: torch.device, args: Optional[dict] = None) -> dict:
    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "device": str(device), "args": args or {}}
    try:
        import flashforge
        env["flashforge"] = flashforge.__version__
    except Exception as e:
        env["flashforge"] = f"import failed: {e}"
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    # the checkout: benchmarks/attention/report.py, three folders up
    env.update(git_commit(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def _plain(x):
    """JSON-safe copy: non-finite floats become strings ("inf"), so strict parsers read the file."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_plain(report), f, indent=1, default=str, allow_nan=False)
    os.replace(tmp, path)


def format_graph_table(rows: Sequence[dict]) -> str:
    """Decode rows timed inside CUDA graphs (``--cudagraph``): kernel throughput without the
    per-call host work that eager timing includes when the host is slower than the GPU."""
    rows = [r for r in rows if r["extra"].get("cudagraph_gbps")]
    if not rows:
        return ""
    wname = max(28, max(len(r["name"]) for r in rows))
    cols = ("cudnn", "flash", "read")
    head = f"{'case':<{wname}} {'ours eager':>10} {'ours graph':>10}" + "".join(f" {SHORT.get(c, c):>9}" for c in cols)
    head += f" {'graph ratio':>11} {'ours/read':>9}"
    lines = ["== decode in CUDA graphs (GB/s; ratio = ours / cuDNN, both graphed; read: a kernel that only "
             "streams the same K and V bytes, the floor) ==", head, "-" * len(head)]
    for r in rows:
        g = r["extra"]["cudagraph_gbps"]
        ours = g.get("ours_paged" if r["case"].get("layout") == "paged" else "ours")
        line = f"{r['name']:<{wname}} {_fmt_value(r['ours'], 'GB/s'):>10} {_fmt_value(ours, 'GB/s'):>10}"
        line += "".join(f" {_fmt_value(g.get(c), 'GB/s'):>9}" for c in cols)
        ratio = f"{ours / g['cudnn']:.2f}" if ours and g.get("cudnn") else "-"
        of_read = f"{ours / g['read']:.2f}" if ours and g.get("read") else "-"
        lines.append(line + f" {ratio:>11} {of_read:>9}")
    return "\n".join(lines)
