"""A test module's Triton-interpreter cases, run in subprocesses (TRITON_INTERPRET must be set before triton is
imported and must not leak into other tests): `run_cases` runs there (the module's __main__) and prints the report
(each case's outcome and seconds), `collect` starts them (one per core, up to 4, the cases dealt out among them)
and merges their reports; each test then checks its case's entry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def mend_interpreter_splat() -> None:
    """Makes triton's interpreter splat a scalar into data of the block's element type. Its comparisons keep the
    operands' integer type on the scalar they return (triton 3.6 to 3.9), so `block_mask & (b < n)` splats the flag
    into int32 data, and from triton 3.9 the interpreter's masked loads and stores (C++) reject a mask that is not
    bool. Compiled kernels are not affected: there the flag is an i1."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder, "_kosmos_splat_mended", False):
        return
    splat = builder.create_splat

    def create_splat(self, ret_ty, arg):
        if isinstance(arg.dtype, tl.block_type):
            return splat(self, ret_ty, arg)
        dtype = interp._get_np_dtype(ret_ty.scalar)
        return interp.TensorHandle(np.full(ret_ty.shape, arg.data, dtype=dtype), ret_ty.scalar)

    builder.create_splat = create_splat
    builder._kosmos_splat_mended = True


def mend_interpreter_index() -> None:
    """Makes triton's interpreter turn a one-element block into an index by its one item. triton 3.6 does it by
    int(data), which numpy >= 2.4 refuses for a 1-d array ("only 0-dimensional arrays can be converted to Python
    scalars", triton-lang/triton#9171): `tl.range(tl.program_id(0), ...)` then fails in every persistent kernel.
    triton 3.7 to 3.9 take the item themselves, through the same _patch_lang_tensor(tensor, scope)."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_kosmos_index_mended", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def index(self):
        return int(self.handle.data.item())

    def _patch_lang_tensor(tensor, scope):
        # triton's own __index__ is never set, not even for a moment: in the threads subprocess every rank's
        # device-function calls patch again while the other ranks' kernels run
        set_attr = scope.set_attr
        scope.set_attr = lambda obj, name, value: set_attr(obj, name, index if name == "__index__" else value)
        try:
            patch_tensor(tensor, scope)
        finally:
            del scope.set_attr

    interp._patch_lang_tensor = _patch_lang_tensor
    interp._kosmos_index_mended = True


def mend_interpreter() -> None:
    """Every mend of triton's interpreter these tests need; each interpreter subprocess calls it first."""
    mend_interpreter_splat()
    mend_interpreter_index()


def run_cases(cases, namespace: dict, *args) -> None:
    """namespace["case_" + name](*args) for each case (or the names given on the command line); prints
    "REPORT {name: {ok, info | error, tb}}"."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    mend_interpreter()
    report = {}
    for name in sys.argv[1:] or cases:
        t0 = time.perf_counter()
        try:
            report[name] = {"ok": True, "info": namespace["case_" + name](*args)}
        except Exception as e:  # noqa: BLE001
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:]}
        report[name]["secs"] = round(time.perf_counter() - t0, 1)
    print("REPORT " + json.dumps(report))


def timeout_then_broken(call) -> list:
    """The messages of what two calls of `call` must raise once a fused kernel's error word is set: KernelTimeout,
    then WorkspaceBroken (the control tensor is unusable from then on)."""
    from kosmos.kernels.runtime import KernelTimeout, WorkspaceBroken

    msgs = []
    for exc in (KernelTimeout, WorkspaceBroken):
        try:
            call()
        except exc as e:
            msgs.append(str(e))
            continue
        raise AssertionError(f"no {exc.__name__}")
    return msgs


def interpreter_env() -> dict:
    """The environment of an interpreter subprocess: TRITON_INTERPRET=1, the repository and tests/ ahead of the
    caller's PYTHONPATH."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


def collect(path: str, timeout: int, cases) -> dict:
    """Runs the test module at `path` as a script under the interpreter, its `cases` dealt out among one subprocess
    per core; the merged report."""
    env = interpreter_env()
    names = list(cases)
    jobs = min(len(names), len(os.sched_getaffinity(0)), 4)
    procs = [subprocess.Popen([sys.executable, path, *names[i::jobs]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=REPO) for i in range(jobs)]
    report = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
            assert lines, f"no report (rc {proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
            report.update(json.loads(lines[-1][len("REPORT "):]))
    finally:
        for proc in procs:
            proc.kill()
    return report


def case_tests(path: str, cases, timeout: int):
    """What a module of interpreter cases binds at its top level, `report, test_interpreted_case =
    _interp.case_tests(__file__, CASES, timeout)`: the module-scoped `report` fixture (`collect` of its cases) and
    the test of each case (`check`)."""
    import pytest

    @pytest.fixture(scope="module", name="report")
    def report():
        return collect(path, timeout=timeout, cases=cases)

    @pytest.mark.parametrize("case", list(cases))
    def test_interpreted_case(report, case):
        check(report, case)

    return report, test_interpreted_case


def check(report: dict, case: str) -> None:
    r = report[case]
    print(f"{case}: {r.get('secs')} s in its subprocess")  # shown with -rP / on failure: where the batch's time goes
    assert r["ok"], r.get("error", "") + "\n" + r.get("tb", "")
