"""A/B kernel candidates (quantize_32x1.config / permute.config CANDIDATES): distinct cache keys, compile-checked, the
defaults' keys as recorded here; no cutlass import (config modules)."""

import pytest

from moe_quant.kernels.quantize_32x1 import config as config_32x1
from moe_quant.kernels.permute import config as config_permute


def test_default_keys_unchanged():
    """Defaults keep their keys (the on-disk cache and the measured kernels stay what they were) until a change
    of default records its new key here."""
    assert config_32x1.Variant("bfloat16", "rceil", "kgroups").key == "bfloat16-rceil-kgroups-float8_e4m3fn"
    # permute: the fp8 outputs rows since 2026-11-28 (the A/B on the H200), dequant scatter with register staging
    # since 2026-11-26 (the A/B on the H100); scatter and gather keep their keys
    assert config_permute.Variant("blocked").key == "blocked-float8_e4m3fn-t256i4b1024-rows"
    assert config_permute.Variant("plain").key == "plain-float8_e4m3fn-t256i4b1024-rows"
    assert config_permute.Variant("dequant", "bfloat16").key == "dequant-bfloat16-t256i4b1024-scatter"
    assert config_permute.Variant("blocked", order="scatter").key == "blocked-float8_e4m3fn-t256i4b1024-scatter"
    assert config_permute.Variant("blocked", order="gather", staging="registers").key == \
        "blocked-float8_e4m3fn-t256i4b1024"
    assert not config_32x1.CANDIDATES[next(iter(config_32x1.CANDIDATES))]  # the first candidate is the default
    assert not config_permute.CANDIDATES[next(iter(config_permute.CANDIDATES))]


@pytest.mark.parametrize("config", [config_32x1, config_permute])
def test_candidates_have_distinct_keys_and_are_compile_checked(config):
    pytest.importorskip("cutlass")
    from moe_quant.kernels import compile_check

    cands = config.candidate_variants()
    if config is config_32x1:
        assert len(cands) == sum(1 for kw in config.CANDIDATES.values() if kw) * len(config_32x1.GROUPS)
    else:  # a candidate naming the default's own order ("rows" for blocked) is the default, not listed again
        default = config.Variant("blocked")
        assert len(cands) == sum(1 for kw in config.CANDIDATES.values() if kw and config.Variant("blocked", **kw)
                                 != default)
        assert cands and default not in cands
    keys = [v.key for v in cands] + [v.key for v in config.all_variants()]
    assert len(set(keys)) == len(keys)
    names = {compile_check.variant_name(v) for v in compile_check.all_variants()}
    assert {compile_check.variant_name(v) for v in cands} <= names


@pytest.mark.parametrize("make", [
    lambda: config_32x1.Variant("bfloat16", "rceil", "kgroups", tile_cols=32),
    lambda: config_permute.Variant("blocked", threads=100),
    lambda: config_permute.Variant("blocked", iters=0),
    lambda: config_permute.Variant("blocked", order="sorted"),
    lambda: config_permute.Variant("blocked", order="rows", iters=9),  # rows holds iters chunks per lane
    lambda: config_permute.Variant("blocked", order="rows", staging="smem"),
    lambda: config_permute.Variant("blocked", order="gather", staging="smem"),  # gather has no smem staging
    lambda: config_permute.Variant("blocked", staging="tmem"),
    lambda: config_permute.Variant("blocked", staging="smem", iters=8),  # past the 24 KB stage
])
def test_bad_tiles_raise(make):
    with pytest.raises(ValueError):
        make()


def test_32x1_threads_follow_tile_cols():
    assert config_32x1.Variant("bfloat16", "rceil", "kgroups").threads == 256
    assert config_32x1.Variant("bfloat16", "rceil", "kgroups", tile_cols=64).threads == 128
