"""Rows and what is written from them: the ratios, a row's JSON, the text tables, the geometric means
over the standard grid and the JSON files.

Every ratio is ours / a peer in the row's unit (so above 1 is faster, or for GiB, more memory).  `ratio`
is ours / the faster of FA4 and cuDNN that ran ("ratio_to" names it; "ratio_fa4" and "ratio_cudnn"
keep both); where neither ran, ours / the best peer that did (on the CPU: SDPA).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

from .cases import Case

# column order of the table; names not listed go last
PEER_ORDER = ("fa4", "cudnn", "sdpa", "flash", "efficient", "flex", "varlen_attn", "ours_padded", "ours_default")
SHORT = {"efficient": "mem-eff", "varlen_attn": "fa-varlen", "ours_padded": "ours-pad",
         "ours_default": "ours-dflt"}
YARDSTICK = ("fa4", "cudnn")
PASSES = ("fwd", "fwd+bwd")


def ratios(ours: Optional[float], peers: dict, unit: str) -> dict:
    """ratio (ours / the best of FA4 and cuDNN that ran, else of any peer that ran), ratio_to (its name),
    ratio_fa4 and ratio_cudnn (None where that peer has no number).  GiB: the best is the least."""
    out = {"ratio": None, "ratio_to": None, "ratio_fa4": None, "ratio_cudnn": None}
    if ours is None:
        return out
    for name in YARDSTICK:
        if peers.get(name):
            out[f"ratio_{name}"] = ours / peers[name]
    ran = {n: peers[n] for n in YARDSTICK if peers.get(n)} or {n: v for n, v in peers.items() if v}
    if ran:
        best = (min if unit == "GiB" else max)(ran, key=ran.get)
        out.update(ratio=ours / ran[best], ratio_to=best)
    return out


def make_row(case: Case, ours: Optional[float], peers: dict, *, ok: bool, error: str = "", ms: Optional[dict] = None,
             check: Optional[dict] = None, peer_errors: Optional[dict] = None, extra: Optional[dict] = None,
             layout: Optional[str] = None, unit: Optional[str] = None) -> dict:
    unit = unit or case.unit
    desc = case.describe()
    name = case.label
    if layout:
        desc["layout"] = layout
        name += f" {layout}"
    return {"suite": case.suite, "name": name, "pass": case.pass_label, "case": desc, "unit": unit,
            "ours": ours, "peers": dict(peers), **ratios(ours, peers, unit),
            "ok": bool(ok), "error": error, "ms": ms or {}, "check": check or {}, "peer_errors": peer_errors or {},
            "extra": extra or {}}


def skipped_row(case: Case, why: str, unit: Optional[str] = None) -> dict:
    return make_row(case, None, {n: None for n in case.peers}, ok=True, error=why, extra={"skipped": True}, unit=unit)


def fmt_value(x: Optional[float], unit: str) -> str:
    if x is None:
        return "-"
    if unit == "GiB":
        return f"{x:.2f}"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def peer_columns(rows: Sequence[dict]) -> list:
    names = {n for r in rows for n in r["peers"]}
    return [n for n in PEER_ORDER if n in names] + sorted(names - set(PEER_ORDER))


def _err(row: dict) -> str:
    """The largest of ours' errors against the reference ("-": unchecked, or a dropout row)."""
    errs = row["check"].get("ours") if not row["check"].get("note") else None
    return f"{max(errs.values()):.0e}" if errs else "-"


def format_table(rows: Sequence[dict], title: str = "", fa4_error: Optional[str] = None) -> str:
    """One compact table (one row per case): ours, each peer, ours / the best yardstick, the error, ok.
    fa4_error: why FA4 could not be imported, stated under the title when the rows ask for it."""
    if not rows:
        return ""
    cols = peer_columns(rows)
    units = sorted({r["unit"] for r in rows})
    wname = max(28, max(len(r["name"]) for r in rows))
    head = f"{'case':<{wname}} {'pass':<7} {'ours':>7}" + "".join(f" {SHORT.get(c, c):>9}" for c in cols)
    head += f" {'ours/best':>15} {'err':>6}  ok"
    lines = []
    if title:
        best = ("ours / max(FA4, cuDNN), else / the peer named" if set(cols) & set(YARDSTICK)
                else "ours / the peer named")
        lines.append(f"== {title} ({', '.join(units)}; ours/best = {best}) ==")
    if fa4_error and "fa4" in cols:
        lines.append(f"FA4 not available ({fa4_error}): its column is '-' and ours/best is ours / cuDNN")
    lines += [head, "-" * len(head)]
    for r in rows:
        u = r["unit"]
        line = f"{r['name']:<{wname}} {r['pass']:<7} {fmt_value(r['ours'], u):>7}"
        line += "".join(f" {fmt_value(r['peers'].get(c), u) if c in r['peers'] else '':>9}" for c in cols)
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f} {SHORT.get(r['ratio_to'], r['ratio_to'])}"
        status = "skip" if r["extra"].get("skipped") else ("ok" if r["ok"] else "FAIL")
        lines.append(line + f" {ratio:>15} {_err(r):>6}  {status}")
    notes = [f"  {r['name']} {r['pass']}: {r['error']}" for r in rows if r["error"] and not r["extra"].get("skipped")]
    skipped = [r for r in rows if r["extra"].get("skipped")]
    if skipped:
        notes.append(f"  {len(skipped)} rows not run: {skipped[0]['error']}")
    if notes:
        lines.append("notes:")
        lines += notes
    return "\n".join(lines)


def _geomean(xs: Sequence[float]) -> Optional[float]:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def grid_geomeans(rows: Sequence[dict]) -> dict:
    """Per pass, over the standard-grid rows (Case.grid): the geometric means of ratio, ratio_fa4 and
    ratio_cudnn, each over the rows that have it, and how many rows that is."""
    out = {}
    for p in PASSES:
        sub = [r for r in rows if r["case"].get("grid") and r["pass"] == p and not r["extra"].get("skipped")]
        if sub:
            out[p] = {"rows": len(sub)}
            for key in ("ratio", "ratio_fa4", "ratio_cudnn"):
                vals = [r[key] for r in sub if r[key]]
                out[p][key] = _geomean(vals)
                out[p][key + "_rows"] = len(vals)
    return out


def format_geomeans(rows: Sequence[dict]) -> str:
    """One line per pass: the grid's geometric means (empty without grid rows)."""
    lines = []
    for p, g in grid_geomeans(rows).items():
        parts = [f"{label} {g[key]:.3f} ({g[key + '_rows']} rows)" if g[key] else f"{label} -"
                 for label, key in (("ours/best", "ratio"), ("ours/FA4", "ratio_fa4"), ("ours/cuDNN", "ratio_cudnn"))]
        lines.append(f"geomean over the {g['rows']} standard-grid rows, {p}: " + ", ".join(parts))
    return "\n".join(lines)


def short_error(e: BaseException, caught: Sequence = ()) -> str:
    """The exception's first line (and the first warnings caught with it), short enough for a table."""
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:240]
    why = [str(w.message).strip().splitlines()[0][:160] for w in caught if str(w.message).strip()]
    return msg + (" | " + "; ".join(why[:2]) if why else "")


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
    """Write atomically (a run killed mid-write leaves the previous file, not half of one)."""
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
        line = f"{r['name']:<{wname}} {fmt_value(r['ours'], 'GB/s'):>10} {fmt_value(ours, 'GB/s'):>10}"
        line += "".join(f" {fmt_value(g.get(c), 'GB/s'):>9}" for c in cols)
        ratio = f"{ours / g['cudnn']:.2f}" if ours and g.get("cudnn") else "-"
        of_read = f"{ours / g['read']:.2f}" if ours and g.get("read") else "-"
        lines.append(line + f" {ratio:>11} {of_read:>9}")
    return "\n".join(lines)
