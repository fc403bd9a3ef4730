"""Turn rows into a table (plain or Markdown) and JSON; the machine and provenance lines."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any

from ._harness import Row


REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    """`git args...` in the checkout bench/ runs from; None where git or the checkout is absent."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None  # (rstrip: status lines begin with a space)


def provenance() -> dict[str, Any]:
    """What was measured: the commit, the source files of fastcall/ and bench/ that differ
    from it (a run from a working tree measures that tree), and the day (UTC)."""
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", "fastcall/*.py", "fastcall/*.c", "bench/*.py")
    return {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "changed": sorted(line[3:] for line in changed.splitlines()) if changed else [],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def machine(argv: list[str]) -> dict[str, Any]:
    """The machine, the versions, and the command (`argv`: the bench's arguments)."""
    import equinox
    import flax
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "equinox": equinox.__version__,
        "flax": flax.__version__,
        "command": shlex.join(["python", "-m", "bench", *argv]),
        **provenance(),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(rows: list[Row], markdown: bool) -> str:
    header = ["workload", "variant", "median us/call", "min-max", "x floor", "x fastcall", "note"]
    lines = []
    for r in rows:
        if r.error:
            lines.append([r.workload, r.variant, "FAILED", "", "", "", r.error])
            continue
        lines.append(
            [
                r.workload,
                r.variant,
                _fmt(r.median_us, ".1f"),
                f"{r.min_us:.1f}-{r.max_us:.1f}",
                _fmt(r.x_floor, ".2f"),
                _fmt(r.x_subject, ".2f"),
                r.note,
            ]
        )
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(line.rstrip() for line in out)  # (no padding after the last column)


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"machine: {info['platform']}, {info['cpu_count']} cores, {info['devices']} ({info['jax_backend']}); "
        f"python {info['python']}, jax {info['jax']}, jaxlib {info['jaxlib']}, "
        f"equinox {info['equinox']}, flax {info['flax']}\ncommand: {info['command']}"
    )


def write_json(path: str, rows: list[Row], info: dict[str, Any], extra: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        listed = [{k: v for k, v in dataclasses.asdict(r).items() if k != "samples"} for r in rows]
        json.dump({"machine": info, "rows": listed, **extra}, f, indent=2)
        f.write("\n")
