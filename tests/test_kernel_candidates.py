"""A/B kernel candidates (quantize_32x1.config / permute.config / block.config CANDIDATES): distinct cache keys,
compile-checked, the defaults' keys as recorded here; no cutlass import (config modules)."""

import pytest

from moe_quant.kernels.block import config as config_block
from moe_quant.kernels.quantize_32x1 import config as config_32x1
from moe_quant.kernels.permute import config as config_permute


def test_default_keys_unchanged():
    """Defaults keep their keys (the on-disk cache and the measured kernels stay what they were) until a change
    of default records its new key here."""
    # K-groups (bf16 in): every per-element field where it applies since 2026-12-03 evening (the A/B on the H200);
    # pre-lean is the default before, with its key
    off = config_32x1.CANDIDATES["pre-lean"]
    for out, tags in (("float8_e4m3fn", "-lean-pamax-flat"), ("bfloat16", "-lean-round"), ("float32", "-lean-pamax")):
        default = config_32x1.Variant("bfloat16", "rceil", "kgroups", out)
        assert default.key == f"bfloat16-rceil-kgroups-{out}{tags}"
        assert config_32x1.with_candidate(default, off).key == f"bfloat16-rceil-kgroups-{out}"
    # 3D along N: 16 column tiles side by side since 2026-11-29 (the A/B on the H200)
    assert config_32x1.Variant("bfloat16", "rceil", "uniform").key == "bfloat16-rceil-uniform-float8_e4m3fn-g16"
    assert config_32x1.Variant("bfloat16", "rceil", "uniform", raster=1).key == "bfloat16-rceil-uniform-float8_e4m3fn"
    # the per-element fields: on in the bf16-input K-groups variants only (3D weights and fp32 inputs not measured)
    for v in config_32x1.all_variants():
        on = v.in_dtype == "bfloat16" and v.groups == "kgroups"
        assert [getattr(v, f) for f in config_32x1.ELEMENT_FIELDS] == [
            on and config_32x1.applies(f, v) for f in config_32x1.ELEMENT_FIELDS], v
    assert config_32x1.Variant("bfloat16", "rceil", "kgroups", lean=True, packed_amax=True, flat_scales=True).key == \
        "bfloat16-rceil-kgroups-float8_e4m3fn-lean-pamax-flat"
    assert config_32x1.Variant("bfloat16", "floor", "uniform", "bfloat16", lean=True, round_bf16=True).key == \
        "bfloat16-floor-uniform-bfloat16-g16-lean-round"
    # permute: the fp8 outputs rows since 2026-11-28 (the A/B on the H200), dequant rows with pair stores since
    # 2026-12-03 (the A/B on the H200; scatter with register staging before, its key unchanged); scatter and gather
    # keep their keys
    assert config_permute.Variant("blocked").key == "blocked-float8_e4m3fn-t256i4b1024-rows"
    assert config_permute.Variant("plain").key == "plain-float8_e4m3fn-t256i4b1024-rows"
    assert config_permute.Variant("dequant", "bfloat16").key == "dequant-bfloat16-t256i4b1024-rows-pairs"
    assert config_permute.Variant("dequant", "float32").key == "dequant-float32-t256i4b1024-rows-pairs"
    assert config_permute.Variant("dequant", "bfloat16", order="scatter", pair_stores=False).key == \
        "dequant-bfloat16-t256i4b1024-scatter"
    assert config_permute.Variant("blocked", order="scatter").key == "blocked-float8_e4m3fn-t256i4b1024-scatter"
    assert config_permute.Variant("blocked", order="gather", staging="registers").key == \
        "blocked-float8_e4m3fn-t256i4b1024"
    # several tiles per CTA and the dequant pair stores (candidates, 2026-12-03); pair_stores leaves the fp8 outputs'
    # code as it is, so it is off there (one key, one compiled kernel)
    assert config_permute.Variant("dequant", "float32", order="scatter", tiles=4, iters=2).key == \
        "dequant-float32-t256i2b1024-scatter-x4-pairs"
    assert config_permute.Variant("blocked", tiles=2).key == "blocked-float8_e4m3fn-t256i4b1024-rows-x2"
    for out in ("blocked", "plain"):
        assert config_permute.Variant(out, pair_stores=True) == config_permute.Variant(out)
    with pytest.raises(ValueError, match="tiles > 1 is for the scatter and rows orders"):
        config_permute.Variant("dequant", "bfloat16", order="gather", tiles=2)
    assert config_permute.Variant("blocked", counts_first=True, tiles=4).key == \
        "blocked-float8_e4m3fn-t256i4b1024-rows-x4-cfirst"
    with pytest.raises(ValueError, match="counts_first is for the scatter and rows orders"):
        config_permute.Variant("blocked", order="gather", counts_first=True)
    # block: the SwiGLU ops staged with the fast division since 2026-11-29, lean since 2026-12-02, and dswiglu's two
    # outputs in one CTA since 2026-12-02; since 2026-12-03 the signed residual, bf16 outputs rounded on the packed
    # words and fp8 outputs' scale bytes by flat stores (the A/Bs on the H200), and later that day the staged inputs'
    # swizzled layout (pre-stage: the layout before, the keys of that morning); dual unchanged
    keys = {("swiglu", "bfloat16", False): "swiglu-bfloat16-rceil-bfloat16-staged-fastdiv-lean-round-sres",
            ("swiglu", "float8_e4m3fn", False): "swiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-lean-sres-flat",
            ("dswiglu", "bfloat16", False): "dswiglu-bfloat16-rceil-bfloat16-staged-fastdiv-fused-lean-round-sres",
            ("dswiglu", "float8_e4m3fn", False):
                "dswiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-fused-lean-sres-flat",
            ("dswiglu", "bfloat16", True): "dswiglu-bfloat16-rceil-bfloat16-stacked-staged-fastdiv-fused-lean-round-sres"}
    for (op, out, stacked), key in keys.items():
        default = config_block.Variant(op, "bfloat16", "rceil", out, stacked=stacked)
        assert default.key == key + "-stageswizzled" + ("-t4" if (op, out) == ("swiglu", "float8_e4m3fn") else "")
        assert default.replace(**config_block.candidates(op, out)["pre-stage"]).key == key
    # the former defaults, candidates now, keep their keys (the code they compile to): pre-round / pre-flat is the
    # default of 2026-12-02, pre-lean the one of 2026-11-29, registers the one before it
    for op in config_block.SWIGLU_OPS:
        for out, name, key in (
                ("bfloat16", "pre-round", f"{op}-bfloat16-rceil-bfloat16-staged-fastdiv"
                 + ("-fused" if op == "dswiglu" else "") + "-lean"),
                ("float8_e4m3fn", "pre-flat", f"{op}-bfloat16-rceil-float8_e4m3fn-staged-fastdiv"
                 + ("-fused" if op == "dswiglu" else "") + "-lean"),
                ("float8_e4m3fn", "pre-lean", f"{op}-bfloat16-rceil-float8_e4m3fn-staged-fastdiv"),
                ("bfloat16", "pre-lean", f"{op}-bfloat16-rceil-bfloat16-staged-fastdiv"),
                ("float8_e4m3fn", "staged-plain-div", f"{op}-bfloat16-rceil-float8_e4m3fn-staged"),
                ("float8_e4m3fn", "registers", f"{op}-bfloat16-rceil-float8_e4m3fn")):
            kw = config_block.candidates(op, out)[name]
            assert config_block.Variant(op, "bfloat16", "rceil", out, **kw).key == key
            assert config_block.Variant(op, "bfloat16", "rceil", out).replace(**kw).key == key  # as the A/B swaps it
    assert config_block.Variant("dswiglu", "bfloat16", "rceil", "bfloat16", stacked=True).replace(
        **config_block.DSWIGLU_CANDIDATES["pre-lean"]).key == "dswiglu-bfloat16-rceil-bfloat16-stacked-staged-fastdiv"
    # the fields of 2026-12-03 off where their preconditions are: dual has no division, fp8 outputs no rounding
    plain = config_block.Variant("dual", "bfloat16", "rceil")
    assert not (plain.round_bf16 or plain.signed_residual or plain.flat_scales)
    assert not config_block.Variant("swiglu", "bfloat16", "rceil", fast_div=False).signed_residual
    # an explicit field is honoured: lean without the fused outputs, and fused_grads off where fast_div is
    assert config_block.Variant("dswiglu", "bfloat16", "rceil", fused_grads=False).key == \
        "dswiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-lean-sres-flat-stageswizzled"
    assert not config_block.Variant("dswiglu", "bfloat16", "rceil", fast_div=False).fused_grads
    # the staged layout resolves per op: swizzled where staged, the plain layout elsewhere; a layout needs staging
    assert config_block.Variant("dual", "bfloat16", "rceil").stage_order == "thread"
    assert config_block.Variant("swiglu", "bfloat16", "rceil", staged=False, fast_div=False).stage_order == "thread"
    with pytest.raises(ValueError, match="stage_order.*staged"):
        config_block.Variant("dual", "bfloat16", "rceil", stage_order="swizzled")
    with pytest.raises(ValueError, match="stage_order must be one of"):
        config_block.Variant("swiglu", "bfloat16", "rceil", stage_order="columns")
    assert not config_block.Variant("dswiglu", "bfloat16", "rceil", lean=False).fused_grads
    assert config_block.Variant("dual", "bfloat16", "rceil").key == "dual-bfloat16-rceil-float8_e4m3fn"
    # dual's bf16 outputs rounded on the packed words since 2026-12-03 (the A/B on the H200)
    assert config_block.Variant("dual", "bfloat16", "rceil", "bfloat16").key == "dual-bfloat16-rceil-bfloat16-round"
    assert config_block.Variant("dual", "bfloat16", "rceil", "bfloat16", **config_block.DUAL_CANDIDATES[
        "pre-round"]).key == "dual-bfloat16-rceil-bfloat16"
    # dual's candidate: the packed amax (the SwiGLU ops' default) under a 3-CTA register cap, the former rounding
    assert config_block.Variant("dual", "bfloat16", "rceil", "bfloat16", **config_block.DUAL_CANDIDATES[
        "packed-c3"]).key == "dual-bfloat16-rceil-bfloat16-pamax-c3"
    assert "-nopamax" in config_block.Variant("swiglu", "bfloat16", "rceil", packed_amax=False).key
    # the lean quantization and dswiglu's one CTA for both outputs (candidates since 2026-12-02)
    assert config_block.Variant("dual", "bfloat16", "rceil", lean=True, ctas_per_sm=3).key == \
        "dual-bfloat16-rceil-float8_e4m3fn-c3-lean"
    fused = config_block.Variant("dswiglu", "bfloat16", "rceil", "bfloat16", stacked=True, lean=True, fused_grads=True,
                                 **config_block.PRE_1203)
    assert fused.key == "dswiglu-bfloat16-rceil-bfloat16-stacked-staged-fastdiv-fused-lean"
    with pytest.raises(ValueError, match="ctas_per_sm"):
        config_block.Variant("dual", "bfloat16", "rceil", ctas_per_sm=5)
    # the bf16 outputs rounded on the packed words (a default since 2026-12-03): bf16 outputs only
    assert config_block.Variant("swiglu", "bfloat16", "rceil", "bfloat16", signed_residual=False).key == \
        "swiglu-bfloat16-rceil-bfloat16-staged-fastdiv-lean-round-stageswizzled"
    with pytest.raises(ValueError, match="round_bf16.*out_dtype must be 'bfloat16'"):
        config_block.Variant("dual", "bfloat16", "rceil", round_bf16=True)
    # the fast division with the signed residual (a default since 2026-12-03)
    assert config_block.Variant("dswiglu", "bfloat16", "rceil", flat_scales=False).key == \
        "dswiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-fused-lean-sres-stageswizzled"
    with pytest.raises(ValueError, match="signed_residual.*needs fast_div"):
        config_block.Variant("swiglu", "bfloat16", "rceil", fast_div=False, signed_residual=True)
    # the fp8 outputs' scale bytes by predicated stores (a default since 2026-12-03)
    assert config_block.Variant("swiglu", "bfloat16", "rceil", signed_residual=False).key == \
        "swiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-lean-flat-stageswizzled-t4"
    for bad in (dict(op="dual"), dict(op="swiglu", out_dtype="bfloat16")):
        with pytest.raises(ValueError, match="flat_scales.*'float8_e4m3fn'"):
            config_block.Variant(**{"in_dtype": "bfloat16", "mode": "rceil", **bad}, flat_scales=True)
    # the SwiGLU ops' fp8 scale bytes gathered in shared memory (candidate "gather", 2026-12-03; dual's always are)
    assert config_block.Variant("dswiglu", "bfloat16", "rceil", gather_scales=True).key == \
        "dswiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-fused-lean-sres-flat-stageswizzled-gather"
    assert config_block.Variant("swiglu", "bfloat16", "rceil").replace(
        **config_block.candidates("swiglu", "float8_e4m3fn")["gather"]).gather_scales
    for bad in (dict(op="dual"), dict(op="swiglu", out_dtype="bfloat16")):
        with pytest.raises(ValueError, match="gather_scales.*'float8_e4m3fn'"):
            config_block.Variant(**{"in_dtype": "bfloat16", "mode": "rceil", **bad}, gather_scales=True)
    # the colwise tile written as whole lines (candidates "cw-smem", "pre-t4-cw-smem", "cw-gather", dual's "cw-smem-c3";
    # "cw-smem-bf16" for bf16 outputs)
    for op in config_block.OPS:
        for out, name in (("float8_e4m3fn", "cw-smem"), ("bfloat16", "cw-smem-bf16")):
            default = config_block.Variant(op, "bfloat16", "rceil", out)
            v = default.replace(**config_block.candidates(op, out)[name])
            assert v.colwise_smem and not default.colwise_smem and v.key == default.key + "-cwsmem"
    assert config_block.Variant("swiglu", "bfloat16", "rceil").replace(
        **config_block.candidates("swiglu", "float8_e4m3fn")["pre-t4-cw-smem"]).key == \
        "swiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-lean-sres-flat-stageswizzled-cwsmem"
    assert config_block.Variant("dual", "bfloat16", "rceil", **config_block.DUAL_FP8_CANDIDATES["cw-smem-c3"]).key == \
        "dual-bfloat16-rceil-float8_e4m3fn-c3-cwsmem"
    # several column tiles per CTA (candidates "t2", "t4", 2026-12-03): the staged swiglu, dswiglu with fused outputs
    for op in config_block.SWIGLU_OPS:
        for out in config_block.OUT_DTYPES:
            default = config_block.Variant(op, "bfloat16", "rceil", out)
            v = default.replace(**config_block.candidates(op, out)["t2"])
            assert v.tiles_per_cta == 2 and v.key == default.key.removesuffix("-t4") + "-t2"
    # swiglu with fp8 outputs: 4 tiles a CTA by default since 2026-12-03 night (the A/B and sanitizer runs on the H200),
    # pre-t4 the default before with its key; the other ops and outputs one tile
    swiglu_fp8 = config_block.Variant("swiglu", "bfloat16", "rceil")
    assert swiglu_fp8.tiles_per_cta == 4 and swiglu_fp8.key.endswith("-flat-stageswizzled-t4")
    assert swiglu_fp8.replace(**config_block.candidates("swiglu", "float8_e4m3fn")["pre-t4"]).key == \
        "swiglu-bfloat16-rceil-float8_e4m3fn-staged-fastdiv-lean-sres-flat-stageswizzled"
    assert "pre-t4" not in config_block.candidates("dswiglu", "float8_e4m3fn")
    assert [v.tiles_per_cta for v in config_block.all_variants()] == [
        4 if (v.op, v.out_dtype) == ("swiglu", "float8_e4m3fn") else 1 for v in config_block.all_variants()]
    assert config_block.Variant("dswiglu", "bfloat16", "rceil", "bfloat16", stacked=True, tiles_per_cta=4).key == \
        "dswiglu-bfloat16-rceil-bfloat16-stacked-staged-fastdiv-fused-lean-round-sres-stageswizzled-t4"
    # dual staged (candidates "dstage*", issue 57): the SwiGLU ops' swizzled stage; several tiles a CTA need the stage
    for out in config_block.OUT_DTYPES:
        default = config_block.Variant("dual", "bfloat16", "rceil", out)
        for name, tiles in (("dstage", 1), ("dstage-t4", 4)):
            v = default.replace(**config_block.candidates("dual", out)[name])
            assert v.staged and v.stage_order == "swizzled" and not v.fast_div and v.tiles_per_cta == tiles
            assert v.round_bf16 == (out == "bfloat16")  # on the default
        c3 = default.replace(**config_block.candidates("dual", out)["dstage-t2-c3"])
        assert c3.ctas_per_sm == 3 and c3.tiles_per_cta == 2 and not c3.round_bf16  # round spills under the cap
    assert config_block.Variant("dual", "bfloat16", "rceil", "bfloat16", staged=True, tiles_per_cta=2).key == \
        "dual-bfloat16-rceil-bfloat16-staged-round-stageswizzled-t2"
    assert config_block.Variant("dual", "bfloat16", "rceil", staged=True, stage_order="row").key == \
        "dual-bfloat16-rceil-float8_e4m3fn-staged-stagerow"
    # dual's words read back from the stage by each form (candidates "dreread*"): staged dual, one tile a CTA only
    assert config_block.Variant("dual", "bfloat16", "rceil", "bfloat16").replace(
        **config_block.candidates("dual", "bfloat16")["dreread-c4"]).key == \
        "dual-bfloat16-rceil-bfloat16-staged-c4-round-stageswizzled-reread"
    for bad in (dict(op="dual"), dict(op="swiglu"), dict(op="dual", staged=True, tiles_per_cta=2)):
        with pytest.raises(ValueError, match="reread reads dual's words"):
            config_block.Variant(**{"in_dtype": "bfloat16", "mode": "rceil", **bad}, reread=True)
    with pytest.raises(ValueError, match="tiles_per_cta must be one of"):
        config_block.Variant("swiglu", "bfloat16", "rceil", tiles_per_cta=3)
    for bad in (dict(op="dual"), dict(op="swiglu", staged=False, fast_div=False),
                dict(op="dswiglu", fused_grads=False)):
        with pytest.raises(ValueError, match="tiles_per_cta overlaps"):
            config_block.Variant(**{"in_dtype": "bfloat16", "mode": "rceil", **bad}, tiles_per_cta=2)
    for config in (config_32x1, config_permute, config_block):  # the first candidate is the default
        assert not config.CANDIDATES[next(iter(config.CANDIDATES))]


@pytest.mark.parametrize("config", [config_32x1, config_permute, config_block])
def test_candidates_have_distinct_keys_and_are_compile_checked(config):
    pytest.importorskip("cutlass")
    from moe_quant.kernels import compile_check

    cands = config.candidate_variants()
    if config is config_32x1:  # a candidate naming a group kind's own default is not listed again; those with
        # per-element fields in both A/B output kinds (the fields that apply there)
        outs = ("float8_e4m3fn", "bfloat16")
        defaults = [config.Variant("bfloat16", "rceil", g, o) for g in config.GROUPS for o in outs]
        want = {config.with_candidate(d, kw) for kw in config.CANDIDATES.values() for d in defaults
                if d.out_dtype == outs[0] or set(config.ELEMENT_FIELDS) & set(kw)}
        assert set(cands) == want - set(defaults) and len(cands) == len(set(cands))
        assert {v.key.split("-")[3] for v in cands} == set(outs)
        # each per-element field is compiled on (a default or a candidate), in each group and output kind where it applies
        for name in config.ELEMENT_FIELDS:
            assert {(v.groups, v.out_dtype) for v in cands + defaults if getattr(v, name)} == {
                (d.groups, d.out_dtype) for d in defaults if config.applies(name, d)}, name
        # every CTA order a variant may name is compiled (and so compile-checked) by some default or candidate
        assert {v.raster for v in cands + config.all_variants()} == set(config.RASTER_CHOICES)
    elif config is config_block:  # every candidate of every op and output, and the stacked variant of dswiglu's
        # staged fast-division ones (the former defaults' stacked code)
        stacked = [kw for kw in config.candidates("dswiglu", "bfloat16").values()
                   if kw and kw.get("staged", True) and kw.get("fast_div", True)]
        assert len(stacked) == 10 and len(cands) == sum(len(config.candidates(op, o)) - 1 for op in config.OPS
                                                       for o in config.OUT_DTYPES) + len(stacked)
        assert {v.op for v in cands} == set(config.OPS) and sum(v.stacked for v in cands) == len(stacked)
        for op in config.OPS:  # every op's candidates are the same in both output kinds but dual's packed-c3 (spills)
            names = [set(config.candidates(op, o)) for o in config.OUT_DTYPES]  # and round (bf16 outputs only)
            want = ({"pre-round", "round", "pre-flat", "flat", "gather", "cw-smem", "cw-gather", "cw-smem-bf16"}
                    if op != "dual" else {"packed-c3", "pre-round", "cw-smem", "cw-smem-c3", "cw-smem-bf16"})
            assert names[0] ^ names[1] == want | ({"t4", "pre-t4", "pre-t4-cw-smem"} if op == "swiglu" else set()), \
                names  # and flat, gather, cw-smem (fp8 outputs only); swiglu's fp8 outputs have pre-t4 for t4 (their
            # default)
        assert not set(cands) & set(config.all_variants())
    else:  # a candidate naming an output's default code ("rows" for blocked, pair_stores for the fp8 outputs) is
        # not listed again; both A/B outputs (blocked, bf16 dequant)
        defaults = {config.Variant(o, d) for o, d in config.CANDIDATE_OUTS}
        want = {config.Variant(o, d, **kw) for kw in config.CANDIDATES.values() for o, d in config.CANDIDATE_OUTS}
        assert set(cands) == want - defaults and len(cands) == len(set(cands))
        assert {v.out for v in cands} == {"blocked", "dequant"}
        assert any(v.pair_stores for v in cands) and any(v.tiles > 1 for v in cands)
        assert all(any(v.counts_first and v.out == o for v in cands) for o in ("blocked", "dequant"))
    keys = [v.key for v in cands] + [v.key for v in config.all_variants()]
    assert len(set(keys)) == len(keys)
    names = {compile_check.variant_name(v) for v in compile_check.all_variants()}
    assert {compile_check.variant_name(v) for v in cands} <= names


@pytest.mark.parametrize("make", [
    lambda: config_32x1.Variant("bfloat16", "rceil", "kgroups", tile_cols=32),
    lambda: config_32x1.Variant("bfloat16", "rceil", "uniform", raster=3),
    lambda: config_32x1.Variant("float32", "rceil", "kgroups", packed_amax=True),  # packed words: bf16 input only
    lambda: config_32x1.Variant("bfloat16", "rceil", "kgroups", "bfloat16", flat_scales=True),  # no scales
    lambda: config_32x1.Variant("bfloat16", "rceil", "kgroups", round_bf16=True),  # e4m3 outputs
    lambda: config_32x1.Variant("float32", "rceil", "uniform", "bfloat16", as_bf16=True, round_bf16=True),
    lambda: config_32x1.Variant("bfloat16", "rceil", "kgroups", "bfloat16", packed_amax=True, round_bf16=True),
    lambda: config_permute.Variant("blocked", threads=100),
    lambda: config_permute.Variant("blocked", iters=0),
    lambda: config_permute.Variant("blocked", order="sorted"),
    lambda: config_permute.Variant("blocked", order="rows", iters=9),  # rows holds iters chunks per lane
    lambda: config_permute.Variant("blocked", order="rows", staging="smem"),
    lambda: config_permute.Variant("blocked", order="gather", staging="smem"),  # gather has no smem staging
    lambda: config_permute.Variant("blocked", staging="tmem"),
    lambda: config_permute.Variant("blocked", staging="smem", iters=8),  # past the 24 KB stage
    lambda: config_permute.Variant("blocked", tiles=0),
    lambda: config_permute.Variant("blocked", tiles=9),
    lambda: config_permute.Variant("blocked", order="gather", tiles=2),  # gather builds the table before its loads
    lambda: config_permute.Variant("blocked", order="scatter", staging="smem", tiles=2),  # one stage per CTA
    lambda: config_block.Variant("dual", "bfloat16", "rceil", fast_div=True),  # dual has no SwiGLU math
    lambda: config_block.Variant("dual", "bfloat16", "rceil", staged=True, fast_div=True),
    lambda: config_block.Variant("swiglu", "bfloat16", "rceil", lean=True, fused_grads=True),  # one output only
    lambda: config_block.Variant("dswiglu", "bfloat16", "rceil", lean=False, fused_grads=True),  # fused implies lean
    lambda: config_block.Variant("dswiglu", "bfloat16", "rceil", fast_div=False, fused_grads=True),
    lambda: config_block.Variant("dswiglu", "bfloat16", "rceil").replace(staged=False),  # replace keeps fused_grads
    lambda: config_block.Variant("dswiglu", "bfloat16", "rceil", lean=True, fused_grads=True, staged=False),
])
def test_bad_tiles_raise(make):
    with pytest.raises(ValueError):
        make()


def test_32x1_with_candidate_keeps_the_fields_that_apply():
    """One candidate name is put in place of every 32x1 variant (the GPU tests, ab_kernels.py, sanitize_32x1.py):
    its fields that do not apply to a variant are left out, the others kept."""
    every = config_32x1.CANDIDATES["lean-all"]
    fp8 = config_32x1.Variant("bfloat16", "rceil", "kgroups", **config_32x1.CANDIDATES["pre-lean"])
    assert config_32x1.with_candidate(fp8, every) == config_32x1.Variant("bfloat16", "rceil", "kgroups")  # the default
    bf16 = config_32x1.Variant("bfloat16", "floor", "uniform", "bfloat16")
    f32_in = config_32x1.Variant("float32", "rceil", "kgroups", "bfloat16")
    assert config_32x1.with_candidate(fp8, every) == fp8.replace(lean=True, packed_amax=True, flat_scales=True)
    assert config_32x1.with_candidate(bf16, every) == bf16.replace(lean=True, round_bf16=True)
    assert config_32x1.with_candidate(f32_in, every) == f32_in.replace(lean=True)
    assert config_32x1.with_candidate(fp8, config_32x1.CANDIDATES["round"]) == fp8
    assert config_32x1.with_candidate(bf16, config_32x1.CANDIDATES["lean-pamax"]) == bf16.replace(lean=True,
                                                                                                   packed_amax=True)
    assert config_32x1.with_candidate(fp8, {"tile_cols": 64, "lean": True}) == fp8.replace(tile_cols=64, lean=True)
    # an explicit False is kept (turns a field off)
    assert config_32x1.with_candidate(fp8.replace(lean=True), {"lean": False}) == fp8


def test_32x1_flat_scale_stores_hit_each_byte_of_the_tile_once():
    """``flat_scales``: the 32x1 kernel stores the scale of column c of a thread at ``tile_byte(row0 + tile_col, blk)
    + 16 c`` (kernel.py ``quantize_tile``), predicated on lane ``quad == c // 2``: that is column c's own byte, for every
    thread of both tile widths, and the CTAs of one 128-row scale tile write each of its 512 bytes exactly once."""
    from moe_quant.layouts import TILE_BYTES, TILE_ROWS, tile_byte

    for tile_cols in config_32x1.TILE_COLS_CHOICES:
        halves = tile_cols // config_32x1.HALF_COLS
        written = []
        for by in range(TILE_ROWS // tile_cols):  # the CTAs of one scale tile
            row0 = by * tile_cols % TILE_ROWS
            for warp in range(4 * halves):
                blk = warp // halves
                for lane in range(32):
                    tile_col = (warp % halves) * config_32x1.HALF_COLS + (lane // 4) * config_32x1.COLS_PER_THREAD
                    first = tile_byte(row0 + tile_col, blk)
                    for c in range(config_32x1.COLS_PER_THREAD):
                        assert first + 16 * c == tile_byte(row0 + tile_col + c, blk)
                        if lane % 4 == c // 2:
                            written.append(first + 16 * c)
        assert sorted(written) == list(range(TILE_BYTES)), tile_cols


def test_32x1_threads_follow_tile_cols():
    assert config_32x1.Variant("bfloat16", "rceil", "kgroups").threads == 256
    assert config_32x1.Variant("bfloat16", "rceil", "kgroups", tile_cols=64).threads == 128


@pytest.fixture
def launches(monkeypatch):
    """The ops run on CPU tensors with compiling and launching stubbed: each launch records the variant whose
    kernel the op took (``get_kernel`` returns a kernel whose call logs its variant)."""
    import torch

    from moe_quant.kernels import compile_cache as cc

    log = []

    class Kernel:
        def __init__(self, variant):
            self.call = lambda *args: log.append(variant)

    monkeypatch.setattr(cc, "_FAST", {})
    monkeypatch.setattr(cc, "arch", lambda device: "sm_90a")
    monkeypatch.setattr(cc, "get_kernel", lambda variant, arch: Kernel(variant))
    cc.forget_plans()  # the ops' plans hold the kernels they launch: none from before the stubs
    yield log, torch.device("cpu")
    cc.forget_plans()  # nor the stubs after


def test_32x1_variant_in_place_reaches_every_op(launches):
    """``variant_in_place`` (how ab_kernels.py and the GPU tests run a candidate) swaps the kernel the op itself
    looks up, for every default variant: ab_kernels.py once built that key by hand, and from the day a field
    (``as_bf16``) joined the ops' key it timed the default under every candidate's name."""
    import torch

    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    log, cpu = launches
    variants = config_32x1.all_variants()
    assert any(v.as_bf16 for v in variants) and {v.groups for v in variants} == set(config_32x1.GROUPS)
    for v in variants:
        cand = v.replace(raster=4)
        assert cand != v
        x = torch.zeros(64, 64, dtype=getattr(torch, v.in_dtype))
        offs = torch.tensor([40, 64], dtype=torch.int32)
        with ops_32x1.variant_in_place(cand, cpu):
            if v.groups == "kgroups":
                ops_32x1._quantize_32x1_k_groups_impl(x, v.mode, offs, getattr(torch, v.out_dtype))
            else:
                ops_32x1._quantize_32x1_3d_impl(x.view(2, 32, 64), v.mode, getattr(torch, v.out_dtype), v.as_bf16)
        assert log[-1] == cand, f"{v}: the op launched {log[-1]}"
        # and outside the block the op's own default again
        if v.groups == "uniform":
            ops_32x1._quantize_32x1_3d_impl(x.view(2, 32, 64), v.mode, getattr(torch, v.out_dtype), v.as_bf16)
            assert log[-1] == v


def test_variant_in_place_replaces_the_kernel_of_a_plan_made_before(launches):
    """The ops' plans hold their compiled kernel (``compile_cache.plan``): a shape called before the block must launch
    the candidate inside it, and its own kernel again after."""
    import torch

    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    log, cpu = launches
    v = config_32x1.Variant("bfloat16", "rceil", "kgroups")
    cand = v.replace(raster=4)
    x, offs = torch.zeros(64, 64, dtype=torch.bfloat16), torch.tensor([40, 64], dtype=torch.int32)
    calls = []
    for where in ("before", "inside", "after"):
        if where == "inside":
            with ops_32x1.variant_in_place(cand, cpu):
                ops_32x1.run_quantize_32x1_k_groups(x, "rceil", offs)
        else:
            ops_32x1.run_quantize_32x1_k_groups(x, "rceil", offs)
        calls.append(log[-1])
    assert calls == [v, cand, v]


def test_permute_variant_in_place_reaches_every_op(launches):
    import torch

    from moe_quant.kernels.permute import ops as ops_permute

    log, cpu = launches
    data = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(64, 2, dtype=torch.float8_e8m0fnu)
    counts = torch.tensor([[30, 34]], dtype=torch.int32)
    for v in config_permute.all_variants():
        cand = v.replace(order="gather" if v.order != "gather" else "scatter")
        with ops_permute.variant_in_place(cand, cpu):
            ops_permute._permute_impl(data, scales, counts, v.out, getattr(torch, v.out_dtype))
        assert log[-1] == cand, f"{v}: the op launched {log[-1]}"


def test_block_cols_fp8_variants_are_their_own_and_refuse_what_they_cannot_do():
    """``cols_fp8`` (dswiglu with bf16 outputs: fp8 colwise forms beside bf16 rowwise ones) is a variant of its own in
    both modes, stacked and not (compile-checked in CI: ``all_variants``), with its own key: both forms quantized from
    the words (no round_bf16), its colwise scale bytes by flat stores; the combinations it does not implement raise,
    naming the field."""
    own = [v for v in config_block.all_variants() if v.cols_fp8 and v.op == "dswiglu"]
    assert sorted((v.mode, v.stacked) for v in own) == [("floor", False), ("floor", True), ("rceil", False),
                                                        ("rceil", True)]
    v = config_block.Variant("dswiglu", "bfloat16", "rceil", "bfloat16", cols_fp8=True)
    assert v.key == "dswiglu-bfloat16-rceil-bfloat16-staged-fastdiv-fused-lean-sres-flat-stageswizzled-fp8cols"
    assert v.fake and v.fp8_cols and not v.round_bf16 and v.flat_scales and v.fused_grads
    assert not config_block.Variant("dswiglu", "bfloat16", "rceil", "bfloat16").fp8_cols
    for kw, match in ((dict(op="swiglu"), "cols_fp8 writes fp8 colwise forms"),
                      (dict(out_dtype="float8_e4m3fn"), "cols_fp8 writes fp8 colwise forms"),
                      (dict(round_bf16=True), "round_bf16, gather_scales and colwise_smem must be off"),
                      (dict(colwise_smem=True), "round_bf16, gather_scales and colwise_smem must be off"),
                      (dict(gather_scales=True), "round_bf16, gather_scales and colwise_smem must be off")):
        args = {**dict(op="dswiglu", in_dtype="bfloat16", mode="rceil", out_dtype="bfloat16", cols_fp8=True), **kw}
        with pytest.raises(ValueError, match=match):
            config_block.Variant(**args)


def test_block_variant_in_place_reaches_every_op(launches):
    import torch

    from moe_quant.kernels.block import ops as ops_block

    log, cpu = launches
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    offs = torch.tensor([40, 64], dtype=torch.int32)
    variants = [v for v in config_block.all_variants() if v.op in config_block.SWIGLU_OPS]  # dual has no candidates
    assert {v.op for v in variants} == set(config_block.SWIGLU_OPS) and any(v.stacked for v in variants)
    for v in variants:
        cand = v.replace(staged=False, fast_div=False, lean=False, fused_grads=False, **config_block.PRE_1203)
        assert cand != v
        with ops_block.variant_in_place(cand, cpu):
            ops_block._impl(v.op, (x,) * config_block.N_INPUTS[v.op], v.mode, offs, v.fake, v.stacked, v.cols_fp8,
                            v.forms)
        assert log[-1] == cand, f"{v}: the op launched {log[-1]}"
        ops_block._impl(v.op, (x,) * config_block.N_INPUTS[v.op], v.mode, offs, v.fake, v.stacked, v.cols_fp8,
                        v.forms)
        assert log[-1] == v


def test_ab_kernels_families_offer_the_same_candidates_in_every_kind():
    """``scripts/ab_kernels.py`` puts one candidate in place in every kind of a family at once (by name), so each
    kind of a family must name the same candidates; the block-dual family times ``dual`` with bf16 outputs only
    (with fp8 outputs its candidate spills), so its fp8 kind must not be in it."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("ab_kernels_under_test", root / "scripts" / "ab_kernels.py")
    ab = importlib.util.module_from_spec(spec)
    sys.path[:0] = [str(root), str(root / "tests")]
    try:
        spec.loader.exec_module(ab)
    finally:
        del sys.path[:2]
    for name, (make, _check, _cases, timed, _targets) in ab.FAMILIES.items():
        kinds = make()
        assert timed in kinds, name
        names = {k: list(v[0]) for k, v in kinds.items()}
        assert len({tuple(n) for n in names.values()}) == 1, (name, names)
        assert names[timed][0].startswith("default") and len(names[timed]) > 1, (name, names)
    assert set(ab.FAMILIES["block-dual"][0]()) == {("dual", "bfloat16")}
    # each block family puts in place the candidates of its own op only (dswiglu has candidates swiglu lacks)
    for op in ("swiglu", "dswiglu"):
        for fam in (f"block-{op}", f"block-{op}-fp8"):
            kinds = ab.FAMILIES[fam][0]()
            assert {k[0] for k in kinds} == {op} and set(kinds[(op, "bfloat16")][0]) == set(
                config_block.candidates(op, "bfloat16")) | set(config_block.candidates(op, "float8_e4m3fn")), fam


@pytest.mark.parametrize("name", ["pre-lean", "lean-unfused", "lean-c3", "registers"])
def test_block_candidate_in_place_reaches_the_ops_that_have_it(launches, name):
    """``ops.candidate_in_place`` (how the GPU tests and sanitize_block.py run a candidate) swaps exactly the ops
    whose config names the candidate (both outputs; the stacked dswiglu op where that candidate's stacked variant is
    compile-checked) and leaves every other op on its default."""
    import contextlib

    import torch

    from moe_quant.kernels.block import ops as ops_block

    log, cpu = launches
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    offs = torch.tensor([40, 64], dtype=torch.int32)
    checked = set(config_block.candidate_variants())
    with contextlib.ExitStack() as stack:
        served = ops_block.candidate_in_place(stack, name, cpu)
        assert served
        for v in config_block.all_variants():
            ops_block._impl(v.op, (x,) * config_block.N_INPUTS[v.op], v.mode, offs, v.fake, v.stacked, v.cols_fp8,
                            v.forms)
            fields = config_block.candidates(v.op, v.out_dtype).get(name)
            want = v
            if fields and (not (v.stacked or v.cols_fp8 or v.forms != "both")
                           or ops_block._compile_checked(v, fields, checked)):
                want = v.replace(**fields)
            assert log[-1] == want, (name, v, log[-1])
    # the default's fused dswiglu runs where no candidate is put in place: dual's candidate, the stacked op under
    # registers (whose stacked variant is not compile-checked), and the cols_fp8 ops under every candidate (none has one)
    own = [v for v in log if v.op == "dswiglu" and not v.cols_fp8]
    assert {v.fused_grads for v in own if not v.stacked} == {name == "lean-c3"}
    assert {v.fused_grads for v in own if v.stacked} == {name in ("lean-c3", "registers")}
    assert {v.fused_grads for v in log if v.cols_fp8 and v.op == "dswiglu"} == {True}
    # the one-form swiglu ops and dual's cols_fp8 ops: their defaults under every candidate (none has one)
    assert [v.forms for v in log if v.op == "swiglu" and v.forms != "both"] == ["rows", "cols"] * 4
    assert all(v == config_block.Variant(v.op, v.in_dtype, v.mode, v.out_dtype, cols_fp8=True)
               for v in log if v.op == "dual" and v.cols_fp8)


def test_block_stage_places_are_row_slots_coalesced_and_conflict_free():
    """``stage_order`` (the staged SwiGLU inputs' layout): each layout is a permutation of a row's slots; in "row" and
    "swizzled" the 8 lanes that copy one token's 128 bytes (same warp and token quad, column groups 0..7) fill one
    128-byte segment of shared memory (one L2 request per 4 sectors: NOTES.md 2026-12-03, evening); "swizzled" and
    "thread" read back without bank conflicts (each quarter warp's 8 slots in 8 distinct 16-byte bank groups)."""
    pytest.importorskip("cutlass")
    from moe_quant.kernels.block.config import STAGE_ORDERS
    from moe_quant.kernels.block.kernel import THREADS, stage_place

    for order in STAGE_ORDERS:
        places = [stage_place(t, order) for t in range(THREADS)]
        assert sorted(places) == list(range(THREADS)), order
        quarters = [{places[t] % 8 for t in range(w * 32 + 8 * k, w * 32 + 8 * k + 8)}
                    for w in range(THREADS // 32) for k in range(4)]
        assert all(len(q) == 8 for q in quarters) == (order != "row"), order
        if order != "thread":
            for w in range(THREADS // 32):
                for quad in range(4):
                    token = sorted(places[w * 32 + 4 * g + quad] for g in range(8))
                    assert token == list(range(token[0], token[0] + 8)) and token[0] % 8 == 0, (order, w, quad)


@pytest.mark.parametrize("esize", [1, 2])
def test_block_line_places_are_whole_column_rows_and_conflict_free(esize):
    """``colwise_smem`` (the colwise tile gathered in shared memory; ``esize`` 1: e4m3, 2: bf16): ``line_place`` maps
    the tile's 128 columns x 128 tokens one to one onto its ``16 esize`` KB, each column's tokens onto one row of ``128
    esize`` bytes (written out as whole lines); the thread's 8 columns share one permutation (the kernel steps a row a
    column from ``line_place(tile_col, t0)``); the stores of a column of the thread's 8 (the 32x1 geometry: lane
    ``4 g + q`` of warp ``w``, columns ``64 (w % 2) + 8 g + c``, tokens ``32 (w // 2) + 8 q``; 8 bytes a lane for
    e4m3, a half warp a wavefront; 16 for bf16, a quarter warp) cover the 32 banks once per wavefront, and so do a
    quarter warp's 16-byte read-backs (``write_lines``: ``128 esize / 16`` lanes a column, in token order)."""
    pytest.importorskip("cutlass")
    from moe_quant.kernels.block.kernel import THREADS, line_place

    cols = toks = 128
    row = toks * esize
    places = {(c, t): line_place(c, t, esize) for c in range(cols) for t in range(toks)}
    assert sorted(places.values()) == list(range(0, cols * row, esize))
    for c in range(cols):
        assert {places[c, t] for t in range(toks)} == set(range(c * row, (c + 1) * row, esize)), c
    per = 16 // esize  # tokens a 16-byte piece
    lanes = toks // per  # read-back lanes a column
    for s in range(cols * lanes // THREADS):
        for w in range(THREADS // 32):
            for k in range(4):
                group = range(w * 32 + 8 * k, w * 32 + 8 * k + 8)
                got = {places[s * (THREADS // lanes) + tid // lanes, per * (tid % lanes)] % 128 // 16 for tid in group}
                assert len(got) == 8, (s, w, k)
    width = 8 * esize  # bytes a lane stores (8 tokens)
    wave = 128 // width  # lanes a wavefront
    for w in range(THREADS // 32):
        for c in range(8):
            for k in range(32 // wave):
                lanes_ = range(wave * k, wave * k + wave)
                col = [64 * (w % 2) + 8 * (lane // 4) for lane in lanes_]
                tok = [32 * (w // 2) + 8 * (lane % 4) for lane in lanes_]
                assert all(line_place(co, t, esize) + row * c == places[co + c, t] for co, t in zip(col, tok))
                assert len({places[co + c, t] % 128 // width for co, t in zip(col, tok)}) == wave, (w, c, k)
