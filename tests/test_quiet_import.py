"""`import moe_quant` writes nothing: torchao's import-time messages stay out of the terminal,
and the registration with torchao's ``quantize_`` still works."""

import logging

from repo_subprocess import run_python


def test_import_prints_nothing():
    # nor imports transformers (its experts interface gets moe_quant's implementation when it is imported)
    proc = run_python("-c", "import sys, moe_quant; assert 'transformers' not in sys.modules")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", f"`import moe_quant` wrote to stderr:\n{proc.stderr}"
    assert proc.stdout == ""


def test_demo_help_prints_only_help():
    proc = run_python("-m", "moe_quant.demo", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    assert "--threads" in proc.stdout and "--plot" in proc.stdout


def test_torchao_import_filters_are_removed_and_quantize_registration_works():
    from torchao.quantization import quantize_

    from moe_quant import MXFP8MoEConfig, _torchao
    from moe_quant.conversion import is_converted
    from moe_quant.moe import MoE

    for name, _ in _torchao._IMPORT_NOISE:  # the filters were scoped to torchao's import
        assert not [f for f in logging.getLogger(name).filters if isinstance(f, _torchao._HoldBack)], name
    model = MoE(dim=64, hidden_dim=64, num_experts=2, top_k=1)
    quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
    assert is_converted(model.experts)
