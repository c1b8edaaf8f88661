"""moe_quant's torchtitan model converter on torchtitan's model configs (CPU, no process group).

Converting twice (re-configuration, idempotent with the same settings), converting the experts only
(``dispatcher=False``), a conversion that fails leaving the config as it was, and pickling: a converted
config, a model built from it, and that model unconverted pickle like torchtitan's own (``pickle``,
``copy.deepcopy``, ``torch.save`` read back in a fresh process).
"""

import copy
import dataclasses
import io
import pickle

import pytest
import torch
from repo_subprocess import run_python

from examples.titan.launch import stub_missing_fsdp_names

stub_missing_fsdp_names()  # torchtitan 0.3.0 imports a name torch 2.11 lacks (a placeholder; see the launcher)
pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan not importable")
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry  # noqa: E402

from moe_quant.conversion import is_converted, unconvert  # noqa: E402
from moe_quant.ep.titan import converter_config, dispatcher_class  # noqa: E402


def _config(layers=2):
    """torchtitan's DeepSeek-V3 debug config cut to ``layers`` blocks (block 0 dense, the others MoE)."""
    cfg = model_registry("debugmodel").model
    return dataclasses.replace(cfg, layers=cfg.layers[:layers], mtp_layers=[])


def _routed(cfg):
    return [c for _, c, _, _ in cfg.traverse(RoutedExperts.Config)]


def _convert(cfg, **kw):
    return converter_config(**kw).build().convert(cfg)


def _experts(model):
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def test_converting_twice_with_the_same_settings_changes_nothing():
    """The converter run on a config it already converted (issue 32 item 8: raised ``Config() got
    multiple values for keyword argument 'scale_mode'``)."""
    once = _convert(_config(3))
    before = pickle.dumps(once)
    twice = _convert(once)
    assert twice is once and pickle.dumps(twice) == before
    for routed in _routed(twice):
        assert type(routed)._mxfp8_parent is RoutedExperts.Config  # not a subclass of a subclass
        assert type(routed.inner_experts) is GroupedExperts.Config
    model = twice.build()
    assert all(is_converted(m) for m in _experts(model)) and len(_experts(model)) == 2


def test_converting_again_takes_the_new_settings():
    cfg = _convert(_config(), scale_mode="rceil", wire="mxfp8")
    (experts,) = _experts(cfg.build())
    assert not experts._mxfp8_config.dswiglu_cols_fp8
    _convert(cfg, scale_mode="floor", wire="bf16", capacity_factor=2.0, max_tokens=64, dswiglu_cols_fp8=True)
    (routed,) = _routed(cfg)
    assert routed.scale_mode == "floor" and routed.dswiglu_cols_fp8
    d = routed.token_dispatcher
    assert (d.scale_mode, d.wire, d.capacity_factor, d.max_tokens) == ("floor", "bf16", 2.0, 64)
    assert (d.num_experts, d.top_k) == (8, 3)
    (experts,) = _experts(cfg.build())
    assert experts._mxfp8_config.scale_mode.value == "floor" and experts._mxfp8_config.dswiglu_cols_fp8
    assert _routed(pickle.loads(pickle.dumps(cfg)))[0].dswiglu_cols_fp8  # the field travels with the config


def test_experts_only_keeps_the_models_dispatcher():
    """``dispatcher=False``: the experts are converted, torchtitan's token dispatcher config stays (the
    same object); after a conversion that replaced it, asking for that raises and changes nothing."""
    cfg = _config()
    (routed,) = _routed(cfg)
    theirs = routed.token_dispatcher
    _convert(cfg, dispatcher=False)
    assert _routed(cfg)[0].token_dispatcher is theirs and type(theirs) is AllToAllTokenDispatcher.Config
    model = cfg.build()
    (experts,) = _experts(model)
    assert is_converted(experts)
    (built,) = [m.token_dispatcher for m in model.modules() if isinstance(m, RoutedExperts)]
    assert type(built) is AllToAllTokenDispatcher

    ours = _convert(_config())
    before = pickle.dumps(ours)
    with pytest.raises(ValueError, match=r"dispatcher=False.*already moe_quant's"):
        _convert(ours, dispatcher=False)
    assert pickle.dumps(ours) == before
    with pytest.raises(TypeError, match="dispatcher must be True or False"):
        converter_config(dispatcher="no").build()
    with pytest.raises(TypeError, match="dswiglu_cols_fp8 must be True or False, got 1"):
        converter_config(dswiglu_cols_fp8=1).build()


def test_the_settings_the_ranks_compare_are_recorded_on_the_experts():
    """The converted routed experts ``Config`` records the converter's settings in effect (``converter``), the built experts
    carries them to ``parallelize``, where the ranks compare them (``tests/test_titan_settings.py``); the dispatcher
    settings only with moe_quant's dispatcher; ``unconvert`` drops them; re-converting replaces them."""
    from moe_quant.conversion import ranks

    cfg = _convert(_config(), dispatcher=False, wire="bf16")  # wire unused without moe_quant's dispatcher
    (routed,) = _routed(cfg)
    assert routed.converter == {"dispatcher": False}
    model = cfg.build()
    (experts,) = _experts(model)
    assert ranks.settings(experts) == {"scale_mode": "rceil", "backend": "auto", "out_dtype": None,
                                       "allow_fallback": True, "fused_block": True, "dswiglu_cols_fp8": False,
                                       "dispatcher": False}
    assert ranks.settings(copy.deepcopy(model).get_submodule(_fqn(model, experts))) == ranks.settings(experts)
    unconvert(model)
    assert ranks.EXTRA not in experts.__dict__

    cfg = _convert(_config(), scale_mode="floor", capacity_factor=2.0, max_tokens=64)
    (routed,) = _routed(cfg)
    assert routed.converter == {"dispatcher": True, "wire": "mxfp8", "capacity_factor": 2.0, "overflow": "error",
                                "max_tokens": 64}
    _convert(cfg, scale_mode="floor")
    assert _routed(cfg)[0].converter["capacity_factor"] is None
    (experts,) = _experts(cfg.build())
    s = ranks.settings(experts)
    assert (s["scale_mode"], s["dispatcher"], s["capacity_factor"]) == ("floor", True, None)


def _fqn(model, module):
    return next(name for name, m in model.named_modules() if m is module)


def test_a_failing_conversion_leaves_the_config_as_it_was():
    """The second MoE layer's experts are not a ``GroupedExperts.Config``: ``TypeError`` naming it, and
    the first MoE layer keeps torchtitan's dispatcher and experts (no half-converted config)."""
    cfg = _config(3)
    first, second = _routed(cfg)
    second.inner_experts = AllToAllTokenDispatcher.Config(num_experts=8, top_k=3)  # not a GroupedExperts.Config
    theirs = (first.token_dispatcher, first.inner_experts)
    with pytest.raises(TypeError, match=r"converts GroupedExperts .*got 'AllToAllTokenDispatcher.Config'"):
        _convert(cfg)
    assert (first.token_dispatcher, first.inner_experts) == theirs
    assert type(first.inner_experts) is GroupedExperts.Config


def test_converted_config_and_models_pickle(tmp_path):
    """issue 32 item 9: a converted config, a model built from it, and that model after ``unconvert``
    pickle and deep-copy like the plain ones; ``torch.save`` files load in a fresh process."""
    cfg = _convert(_config())
    back = pickle.loads(pickle.dumps(cfg))
    assert back.to_dict() == cfg.to_dict()
    assert type(_routed(back)[0]) is type(_routed(cfg)[0])
    assert copy.deepcopy(cfg).to_dict() == cfg.to_dict()

    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights(buffer_device=None)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    (experts,) = _experts(loaded)
    assert is_converted(experts) and type(experts) is type(_experts(model)[0])
    assert isinstance(_routed_module(loaded).token_dispatcher, dispatcher_class())
    _assert_same_state(loaded, model)
    _assert_same_state(copy.deepcopy(model), model)

    torch.save({"config": cfg, "model": model}, tmp_path / "converted.pt")
    unconvert(model)
    assert not is_converted(_experts(model)[0])
    torch.save(model, tmp_path / "unconverted.pt")
    _assert_same_state(pickle.loads(pickle.dumps(model)), model)

    script = (
        "import sys, torch\n"
        "from examples.titan.launch import stub_missing_fsdp_names\n"
        "stub_missing_fsdp_names()  # unpickling imports torchtitan (torch 2.11: its missing name)\n"
        "from moe_quant.conversion import is_converted\n"
        "saved = torch.load(sys.argv[1], weights_only=False)\n"
        "plain = torch.load(sys.argv[2], weights_only=False)\n"
        "experts = [m for m in saved['model'].modules() if hasattr(m, 'w1_EFD')]\n"
        "print(type(saved['config']).__qualname__, [is_converted(m) for m in experts],"
        " [is_converted(m) for m in plain.modules() if hasattr(m, 'w1_EFD')])\n"
    )
    proc = run_python("-c", script, str(tmp_path / "converted.pt"), str(tmp_path / "unconverted.pt"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "DeepSeekV3Model.Config [True] [False]", proc.stdout


def _routed_module(model):
    (routed,) = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    return routed


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_converted_routed_experts_config_per_class_object():
    """Two ``RoutedExperts.Config`` classes of the same name (a factory, a re-definition) each get their own
    converted ``Config``, a subclass of that very class; anything else is refused."""
    from moe_quant.ep.titan_classes import routed_config_class

    def make():
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(RoutedExperts.Config):
            pass

        return Config

    a, b = make(), make()
    assert a.__qualname__ == b.__qualname__ and a is not b
    ca, cb = routed_config_class(a), routed_config_class(b)
    assert ca is not cb and issubclass(ca, a) and issubclass(cb, b) and not issubclass(ca, b)
    assert routed_config_class(ca) is ca
    with pytest.raises(TypeError, match="converts RoutedExperts"):
        routed_config_class(GroupedExperts.Config)
