"""CI without a GPU: every kernel variant (1x32 and 32x1) compiles for sm_90a and sm_100a (CuTe DSL cross-compile).

Runs moe_quant.kernels.compile_check (one subprocess per arch, in parallel) and checks that
ptxas reports no register spills and no local-memory stack frame for any variant.
"""

import pytest

pytest.importorskip("cutlass")

from moe_quant.kernels import compile_check  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")


@pytest.fixture(scope="module")
def results():
    return compile_check.run(list(ARCHS))


def test_every_variant_compiles_for_each_arch(results):
    keys = {compile_check.variant_name(v) for v in compile_check.all_variants()}
    for arch in ARCHS:
        got = {r["variant"] for r in results if r["arch"] == arch}
        assert got == keys, f"{arch}: missing {sorted(keys - got)}"


def test_no_spills_no_stack(results, capsys):
    with capsys.disabled():
        print()
        for r in results:
            print(f"  {r['arch']:8s} {r['variant']:48s} regs={r['registers']} spill={r['spill_bytes']}B "
                  f"stack={r['stack_bytes']}B smem={r['smem_bytes']}B {r['seconds']:.2f}s tvm_ffi={r['tvm_ffi']}")
    for r in results:
        assert r["registers"] is not None, f"no ptxas report for {r}"
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, r
        assert r["registers"] <= 128, r
