"""A test module's Triton-interpreter cases, all run in ONE subprocess (TRITON_INTERPRET must be set before triton is
imported and must not leak into other tests): `run_cases` runs there (the module's __main__) and prints the report,
`collect` starts that subprocess and reads the report back; each test then checks its case's entry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cases(cases, namespace: dict, *args) -> None:
    """namespace["case_" + name](*args) for each case (or the names given on the command line); prints
    "REPORT {name: {ok, info | error, tb}}"."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    report = {}
    for name in sys.argv[1:] or cases:
        try:
            report[name] = {"ok": True, "info": namespace["case_" + name](*args)}
        except Exception as e:  # noqa: BLE001
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:]}
    print("REPORT " + json.dumps(report))


def collect(path: str, timeout: int) -> dict:
    """Runs the test module at `path` as a script under the interpreter; its report."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"no report (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("REPORT "):])


def check(report: dict, case: str) -> None:
    r = report[case]
    assert r["ok"], r.get("error", "") + "\n" + r.get("tb", "")
