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
    """Selected test modules with a ``start_in_background(selected)`` (``tests/test_kernel_compile.py``) start their
    background work now (their tests run last: ``pytest_collection_modifyitems``), given the names of their
    selected tests (functions' names, without parameters); their ``stop_background()`` runs when the session ends.
    Not for ``--collect-only``."""
    if session.config.option.collectonly:
        return
    selected: dict = {}
    for item in getattr(session, "items", ()):
        if getattr(item, "module", None) is not None and not _skipped(item):
            selected.setdefault(item.module, set()).add(getattr(item, "originalname", None) or item.name)
    for module, names in selected.items():
        if hasattr(module, "start_in_background"):
            module.start_in_background(frozenset(names))


def _skipped(item) -> bool:
    """The item carries a skip mark, or a skipif mark whose condition is a true bool (string conditions: not)."""
    marks = getattr(item, "iter_markers", lambda name=None: ())
    return any(True for _ in marks(name="skip")) or any(
        m.args and isinstance(m.args[0], bool) and m.args[0] for m in marks(name="skipif"))


def pytest_sessionfinish(session):
    for module in {item.module for item in getattr(session, "items", ()) if getattr(item, "module", None) is not None}:
        if hasattr(module, "stop_background"):
            module.stop_background()


def pytest_collection_modifyitems(config, items):
    # the tests of modules with background work (tests/test_kernel_compile.py) last: the work then fills the idle
    # core of the whole session instead of being waited for at the module's place in the order
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "start_in_background"))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def warm_torchrun():
    """From here to the session's end, torchrun started by any test (``python -m torch.distributed.run``, in
    this process's environment) runs each rank as a fork of a server that imported torch and torchtitan once
    (``repo_subprocess.warm_ranks``, ``tests/warm_ranks.py``): waits for that server (about 12 s, once)."""
    from repo_subprocess import warm_ranks, warm_ranks_ready

    env = warm_ranks()
    warm_ranks_ready(120)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        yield


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


def pytest_terminal_summary(terminalreporter):
    """Where a session ran kernels (the GPU suite): how many it compiled and loaded from the disk cache, and the
    seconds each took (``compile_cache.STATS``), so a slow GPU run says whether compiling was its time."""
    import sys

    cache = sys.modules.get("moe_quant.kernels.compile_cache")
    if cache is not None and (cache.STATS["compiled"] or cache.STATS["disk_hits"]):
        s = cache.STATS
        terminalreporter.write_line(f"moe_quant kernels: {s['compiled']} compiled in {s['compile_s']:.1f} s, "
                                    f"{s['disk_hits']} loaded from {cache.cache_dir()} in {s['load_s']:.1f} s")
