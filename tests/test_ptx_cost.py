"""scripts/ptx_cost.py: static instruction counts of the CUDA kernels (no GPU needed).

The parser runs everywhere; the end-to-end run needs nvcc (it compiles the kernels to PTX
for one architecture, about 15 s on 2 cores) and is skipped without it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ptx_cost.py"


PTX = """
.visible .entry _Z3fooPf(
\t.param .u64 _Z3fooPf_param_0
)
{
\t.reg .b32 \t%r<4>;
\t// a comment;
\tld.param.u64 \t%rd1, [_Z3fooPf_param_0];
\tmul.lo.s32 \t%r1, %r2, %r3;
\txor.b32 \t%r2, %r1, %r3;
\t@%p1 bra \t$L__BB0_2;
$L__BB0_2:
\tmad.lo.s32 \t%r3, %r1, %r2, %r3;
\tret;
}
.visible .entry _Z3barv()
{
\tret;
}
"""


def test_counts_instructions_per_kernel_not_directives_or_labels():
    counts = load_script("ptx_cost").kernel_counts(PTX)
    assert set(counts) == {"_Z3fooPf", "_Z3barv"}
    foo = counts["_Z3fooPf"]
    assert foo[""] == 6  # ld, mul, xor, bra (predicated), mad, ret
    assert (foo["mul"], foo["xor"], foo["mad"], foo["bra"]) == (1, 1, 1, 1)
    assert counts["_Z3barv"][""] == 1


def test_unknown_revision_and_no_match_are_one_line_errors(capsys):
    m = load_script("ptx_cost")
    with pytest.raises(SystemExit):
        m.table({"quantize_kernel<float>": m.collections.Counter({"": 3})}, None, "nothing-matches")
    err = capsys.readouterr().err
    assert err.startswith("error: no kernel matches") and "quantize_kernel<float>" in err
    with pytest.raises(SystemExit):
        m.checkout("no-such-revision-xyz", Path("/tmp"))
    assert capsys.readouterr().err.startswith("error: unknown revision 'no-such-revision-xyz'")


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(),
                    reason="needs nvcc (a CUDA toolkit; no GPU)")
def test_reports_the_quantize_kernels():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kernels", "^quantize_kernel<float, unsigned int, 16"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| `quantize_kernel<float")]
    assert len(rows) == 2, proc.stdout  # nearest and stochastic
    nearest, stochastic = (int(r.split("|")[2]) for r in rows)
    assert stochastic > nearest > 0  # the rounding hash costs instructions
