"""Test profiles.

``ci`` (chosen when no CUDA device is visible): Triton's CPU interpreter (``TRITON_INTERPRET=1`` is set
here, before any kernel module is imported), float32/float16 only (the interpreter computes bf16 wrongly,
triton#11584), tiny shapes, few examples. ``gpu`` (CUDA visible): bf16 (and fp16) at realistic shapes,
more examples (``GQLA_TEST_EXAMPLES``, default 12). ``GQLA_TEST_PROFILE=ci|gpu`` overrides the choice.
"""

import os

import pytest


def _choose_profile() -> str:
    forced = os.environ.get("GQLA_TEST_PROFILE")
    if forced:
        return forced
    try:
        import torch

        return "gpu" if torch.cuda.is_available() else "ci"
    except Exception:
        return "ci"


PROFILE = _choose_profile()
if PROFILE == "ci":
    os.environ["TRITON_INTERPRET"] = "1"
    from interp import reuse_patches

    reuse_patches()  # the interpreter's repatching on every helper call skipped: same results, about 30 % faster
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # xdist workers share the CPUs: torch's default (one intra-op thread per core in every worker) oversubscribes
    # them many times over on the float64 references
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
# extends hypothesis's own "ci" profile (derandomized, database off)
settings.register_profile("ci", parent=settings.get_profile("ci"), max_examples=6, **_common)
settings.register_profile("gpu", max_examples=int(os.environ.get("GQLA_TEST_EXAMPLES", "12")), derandomize=True,
                          **_common)
settings.load_profile(PROFILE)


def pytest_report_header(config):
    return f"gqla_triton test profile: {PROFILE} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_only: needs a CUDA device (skipped under the ci profile)")


@pytest.fixture(autouse=True)
def _skip_gpu_only(request):
    if request.node.get_closest_marker("gpu_only") and PROFILE != "gpu":
        pytest.skip("needs CUDA: runs in the gpu profile")


def pytest_collection_modifyitems(config, items):
    # GQLA_TEST_SHARD=i/n (0 <= i < n): part i of the collected tests, every n-th in node-id order, so n runs, each
    # under its own time limit, cover the suite once (e.g. a GPU suite longer than one command may run)
    spec = os.environ.get("GQLA_TEST_SHARD")
    if not spec:
        return
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise pytest.UsageError(f"GQLA_TEST_SHARD: expected i/n with 0 <= i < n, got {spec!r}")
    rank = {node: k for k, node in enumerate(sorted(item.nodeid for item in items))}
    keep = [item for item in items if rank[item.nodeid] % n == i]
    config.hook.pytest_deselected(items=[item for item in items if rank[item.nodeid] % n != i])
    items[:] = keep


def pytest_runtest_logreport(report):
    # GQLA_FAIL_LOG=path: append each test's outcome and time, and each failure's traceback, as they
    # happen (the log survives a run killed by a time limit)
    path = None if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.get("GQLA_FAIL_LOG")  # controller only
    if path and report.when == "call":
        with open(path, "a") as f:
            f.write(f"{report.outcome:<8}{report.duration:8.1f}s {report.nodeid}\n")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


@pytest.fixture
def config_override():
    """``with config_override({"<op>": {"<field>": value}}):`` runs the block under those launch-config fields
    (``gqla_triton.dispatch.config_override``: names and types checked against the op's schema)."""
    from gqla_triton.dispatch import config_override as override

    return override


@pytest.fixture
def poison_buffers():
    """Every buffer a launcher allocates during the test starts NaN-filled (integers: a large negative), so an
    element a kernel fails to write fails the comparison (``gqla_triton.ops._common.alloc.poisoned``)."""
    from gqla_triton.ops._common.alloc import poisoned

    with poisoned():
        yield
