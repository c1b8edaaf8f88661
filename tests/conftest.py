import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci": the CPU suite on 2 cores; "gpu": more examples where the device is fast; "dev": default.
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "gpu", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_finish(session):
    """Selected test modules with a ``start_in_background()`` (``tests/test_kernel_compile.py``) start their
    background work now; their ``stop_background()`` runs when the session ends. Not for ``--collect-only``, nor in
    pytest-xdist's workers."""
    if session.config.option.collectonly or in_xdist_worker():  # every worker collects every test: under xdist the
        return  # worker that runs such a module does its work in the module's fixture, beside the other worker
    for module in {item.module for item in getattr(session, "items", ()) if getattr(item, "module", None) is not None}:
        if hasattr(module, "start_in_background"):
            module.start_in_background()


def pytest_sessionfinish(session):
    for module in {item.module for item in getattr(session, "items", ()) if getattr(item, "module", None) is not None}:
        if hasattr(module, "stop_background"):
            module.stop_background()


# Running the suite on two cores (README's command, ``.ci/run``): ``-n 2 --dist loadgroup --no-loadscope-reorder``
# (pytest-xdist). Each test file is one unit of work, as with ``--dist loadfile`` (its module fixtures run once),
# except the tests of SHARED_RUNS: the tests of those files that use that fixture are one unit of their own (one
# process: one run of the 2-rank torchtitan checks the two files share, ``titan_checks.all_checks``), beside the
# rest of their file. Units are handed out in SLOW_FIRST's order (each took over 30 s on 2 idle cores, 2026-12-02),
# then in the collection's order, so that no long unit starts last while the other worker idles.
SHARED_RUNS = {("test_titan_trainer.py", "checks"): "titan_checks", ("test_titan_trainer_faults.py", "checks"): "titan_checks"}
SLOW_FIRST = ("titan_checks", "test_titan_trainer.py", "test_torchtitan_ep.py", "test_torchtitan_model_ep.py",
              "test_compile_moe.py", "test_kernel_compile.py", "test_converted_is_plain.py", "test_ep_bench.py",
              "test_ep.py", "test_grouped_mm.py", "test_moe_training.py", "test_swiglu_block.py", "test_torchtitan.py",
              "test_reuse.py", "test_hf_block.py", "test_compile_unbacked.py", "test_docs.py", "test_hf_transformers.py",
              "test_compile_warnings.py", "test_checkpointing.py", "test_fsdp2.py")


def _unit_of(item) -> str:
    """The unit of work ``item`` belongs to under ``--dist loadgroup``: its file's name or a SHARED_RUNS group."""
    name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    for (file, fixture), group in SHARED_RUNS.items():
        if name == file and fixture in getattr(item, "fixturenames", ()):
            return group
    return name


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if getattr(config.option, "dist", "no") == "loadgroup":  # the units of work and their order (SHARED_RUNS)
        rank = {name: i for i, name in enumerate(SLOW_FIRST)}
        units = {item: _unit_of(item) for item in items}
        items.sort(key=lambda item: rank.get(units[item], len(rank)))  # stable: a unit's tests keep their order
        for item in items:
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(units[item]))


def in_xdist_worker() -> bool:
    """This process is one of pytest-xdist's workers (``-n``)."""
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.fixture(autouse=True)
def _clean_fallback_counts():
    """Every test starts and ends with no counted fallbacks (``moe_quant.fallback_counts()``)."""
    from moe_quant import reset_fallback_counts

    reset_fallback_counts()
    yield
    reset_fallback_counts()


def spy_on(monkeypatch, owner, name: str) -> list:
    """Record the positional arguments of every call of ``owner.<name>`` (calling through to it)."""
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


@pytest.fixture
def gloo_group():
    """A one-rank gloo default process group for the test (in this process), destroyed after it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.fixture
def block_calls(monkeypatch):
    """Calls of moe_quant's fused SwiGLU expert block (conversion looks ``moe_quant.autograd.mxfp8_swiglu_experts``
    up on each call), counted also while ``torch.compile`` traces."""
    import moe_quant.autograd

    return spy_on(monkeypatch, moe_quant.autograd, "mxfp8_swiglu_experts")


@pytest.fixture
def mxfp8_calls(monkeypatch, block_calls):
    """MXFP8 grouped GEMMs of converted modules, counted also while ``torch.compile`` traces: each call of
    ``moe_quant.autograd.mxfp8_grouped_mm`` as ``(A, B_t, offs)``, and three per fused block call (w1, w3,
    w2: ``(x, w1^T, offs)``, ``(x, w3^T, offs)``, ``(None, w2^T, offs)``; the block never exposes w2's A)."""
    import moe_quant.autograd

    calls = spy_on(monkeypatch, moe_quant.autograd, "mxfp8_grouped_mm")
    block = moe_quant.autograd.mxfp8_swiglu_experts  # block_calls' spy

    def spy(x, w1, w3, w2, offs, **kwargs):
        calls.extend([(x, w1.transpose(-2, -1), offs), (x, w3.transpose(-2, -1), offs), (None, w2.transpose(-2, -1), offs)])
        return block(x, w1, w3, w2, offs, **kwargs)

    monkeypatch.setattr(moe_quant.autograd, "mxfp8_swiglu_experts", spy)
    return calls
