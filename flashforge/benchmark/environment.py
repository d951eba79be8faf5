"""What a result file says about where it was measured: versions, device, threads, the git commit, FA4."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from typing import Any, Optional

import torch

import flashforge

# the checkout holding this file: flashforge/benchmark/environment.py, three folders up
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit(repo: str = _REPO) -> dict:
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
    except Exception as e:  # no git, an installed copy rather than a checkout
        return {"commit": None, "dirty": None, "git_error": f"{type(e).__name__}: {e}"[:200]}


def environment(device: torch.device, args: Optional[dict] = None, fa4: bool = False) -> dict:
    """fa4=True also imports FA4 (seconds on a GPU machine) and records whether it could."""
    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "flashforge": flashforge.__version__, "python": platform.python_version(),
                           "torch": torch.__version__, "device": str(device), "args": args or {}}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env.update(git_commit())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    else:
        env.update(cpu=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                   threads=torch.get_num_threads())
    if fa4:
        from .fa4 import status
        env["fa4"] = status()
    return env


def fa4_error(env: dict) -> Optional[str]:
    """Why FA4 is missing, from an environment made with fa4=True (None when it imported or was not asked)."""
    info = env.get("fa4")
    return None if not info or info.get("available") else info.get("error")
