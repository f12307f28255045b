"""Shared fixtures: tiny LLaDA-layout models written to disk from torch references.

Eight fake CPU devices are configured before jax is imported, so the tensor- and
expert-parallel tests can build meshes in this process; single-device tests use device 0.
"""

import importlib.util
import os
import subprocess
import sys

# Without an accelerator plugin the suite runs on the CPU, compiling a few hundred small
# programs that each run for milliseconds: XLA's quick CPU compile (no LLVM optimisation,
# the loop emitters instead of the fusion emitters) builds them in far less time, and one
# LLVM module a program (no parallel codegen: `pytest -n auto` already keeps every core
# busy, and splitting a small program's module costs more CPU than it saves).
QUICK_CPU_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)


def suite_xla_flags() -> str:
    """Eight fake CPU devices, and the quick CPU compile where it applies: no accelerator
    plugin, and flags this jaxlib knows (XLA aborts the process that reads an unknown flag,
    so a throwaway process reads them first)."""
    devices = "--xla_force_host_platform_device_count=8"
    if importlib.util.find_spec("jax_plugins") is not None:
        return devices
    quick = f"{devices} {QUICK_CPU_COMPILE}"
    probe = "import jaxlib._jax as xla; xla.CompileOptions()"
    env = os.environ | {"XLA_FLAGS": quick}
    known = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return quick if known.returncode == 0 else devices


if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = suite_xla_flags()
os.environ.setdefault("DJAX_COMPILE_CACHE", "")  # tests must not depend on a warm cache
# One OpenMP / BLAS thread a process (torch's references, numpy's, and the processes the
# tests start inherit it): `pytest -n auto` already runs a process on every core, and more
# threads a process make every parallel region wait for a core another process holds.
# Set before torch or numpy is imported: here, in the process xdist's workers start from.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import djax  # noqa: E402

from torch_reference import make_llada_dense  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Meshes of several devices: the CPU run fakes eight; a one-GPU machine skips these tests.
needs_devices = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (the CPU run fakes them)"
)


def pytest_collection_finish(session):
    """Tracing the suite's programs allocates Python objects by the million. With CPython's
    default thresholds the cyclic collector runs hundreds of times a module, now and then a
    full collection over the whole heap (torch, transformers, jax and the test modules:
    some 300k objects, 0.1-0.3 s each): about 5% of the suite's time. The modules imported
    by now live as long as the process, so they are frozen out of the collector's scans
    (nothing compiled is alive yet: the programs each module compiles stay collectable),
    and it runs a tenth as often. Full collections still run, and each module ends with one
    (`_compiled_programs_freed`)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_freed():
    """Free the programs a test module compiled when it ends. One process runs the whole
    suite, and every compiled XLA CPU program holds memory mappings; kept for the whole
    run, they exceed the kernel's per-process mapping limit and XLA fails to allocate."""
    yield
    import gc

    from djax import engine, programs

    engine._EXECUTABLES.clear()
    programs.forward_program.cache_clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_compile_cache_left_behind():
    """A test that turns JAX's persistent compilation cache on (an in-process
    `bench.generate` run does) turns it off again when it ends, so the tests after it in
    the worker neither write executables to a folder nor read them back (the suite must not
    depend on a warm cache, and writing one costs compile time)."""
    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def dense_folder(tmp_path_factory):
    """LLaDA dense, GQA (4 heads, 2 kv heads), weights in two safetensors shards."""
    folder = tmp_path_factory.mktemp("llada_dense")
    torch_model = make_llada_dense(folder, n_kv_heads=2, shards=2, head_scale=6.0, seed=1)
    return folder, torch_model


@pytest.fixture(scope="session")
def dense_model(dense_folder):
    return djax.load(dense_folder[0], dtype=jnp.float32)


@pytest.fixture(scope="session")
def moe_folder(tmp_path_factory):
    """LLaDA-MoE: 8 heads, 8 experts top-2, layer 0 dense; mask id from the tokenizer."""
    from torch_reference import make_llada_moe

    folder = tmp_path_factory.mktemp("llada_moe")
    torch_model = make_llada_moe(folder, dense_layers=(0,), n_layers=3, head_scale=6.0, seed=2)
    return folder, torch_model


@pytest.fixture(scope="session")
def moe_model(moe_folder):
    return djax.load(moe_folder[0], dtype=jnp.float32)
