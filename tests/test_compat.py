"""kernels_pallas.compat: the one place that knows JAX's API differences across the range."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, make_single_device_sharding

from kernels_pallas import compat

ROOT = Path(__file__).resolve().parents[1]


def test_jax_version_parses_release_and_dev_strings():
    assert compat.jax_version("0.10.2") == (0, 10, 2)
    assert compat.jax_version("0.12.0.1") == (0, 12, 0)
    assert compat.jax_version("0.11.2.dev20260101+abc") == (0, 11, 2)
    assert compat.jax_version("1.0") == (1, 0, 0)


def test_installed_jax_is_in_the_supported_range_of_pyproject():
    assert compat.MIN_JAX <= compat.JAX_VERSION
    assert compat.JAX_VERSION[:2] <= compat.NEWEST_TESTED_JAX[:2]
    text = (ROOT / "pyproject.toml").read_text()
    lo = ".".join(map(str, compat.MIN_JAX))
    hi = f"0.{compat.NEWEST_TESTED_JAX[1] + 1}"
    assert f'"jax>={lo},<{hi}"' in text and f'"jaxlib>={lo},<{hi}"' in text


def test_no_module_but_compat_compares_jax_versions():
    """Version checks spread through the code are what compat exists to prevent."""
    pattern = re.compile(r"jax\.__version__\s*[<>=!]|JAX_VERSION|jax_version\(|version_info")
    offenders = []
    for path in [*ROOT.glob("paxcache/**/*.py"), *ROOT.glob("kernels_pallas/**/*.py")]:
        if path.name == "compat.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_is_single_device_sharding_tells_single_device_from_named_shardings():
    dev = jax.devices()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # 0.12.1 deprecates the old class
        assert compat.is_single_device_sharding(make_single_device_sharding(dev))
        pinned = make_single_device_sharding(dev, memory_kind="pinned_host")
        assert compat.is_single_device_sharding(pinned)
        assert compat.is_single_device_sharding(jax.device_put(np.zeros(2), dev).sharding)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        assert not compat.is_single_device_sharding(NamedSharding(mesh, PartitionSpec()))


@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("full_range", [False, True])
def test_tpu_reciprocal_gives_one_over_x_in_an_interpreted_tpu_kernel(approx, full_range):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(x_ref, o_ref):
        o_ref[...] = compat.tpu_reciprocal(x_ref[...], approx=approx, full_range=full_range)

    x = jnp.asarray(np.linspace(1.0, 1000.0, 8 * 128, dtype=np.float32).reshape(8, 128))
    fn = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=pltpu.InterpretParams()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # 0.12 deprecates pl.reciprocal
        out = np.asarray(jax.jit(fn)(x))
    # approx: the TPU's unrefined estimate on a chip, a bfloat16 reciprocal when interpreted
    np.testing.assert_allclose(out, 1.0 / np.asarray(x), rtol=2**-7 if approx else 1e-6)


def test_compute_on_host_runs_on_host_memory_and_returns_host_arrays():
    dev = jax.devices()[0]
    host = make_single_device_sharding(dev, memory_kind="pinned_host")
    x = jax.device_put(np.arange(8, dtype=np.float32), host)

    @jax.jit
    def f(a):
        return compat.compute_on_host(lambda y: y * 2 + 1)(a)

    out = f(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8) * 2 + 1)
    assert out.sharding.memory_kind == "pinned_host"


def test_mosaic_gpu_helpers_build_lane_params_and_interpret_params():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = compat.mosaic_gpu_compiler_params(approx_math=True)
    assert params.lowering_semantics == plgpu.LoweringSemantics.Lane
    assert params.approx_math
    interp = compat.mosaic_gpu_interpret_params(detect_races=True)
    assert interp.detect_races
    assert compat.mosaic_gpu_races_found() in (True, False)


@pytest.mark.parametrize("shape", [(64, 64), (64, 128)])
def test_mosaic_gpu_load_and_transpose_lower_for_cuda(shape):
    """The two Mosaic GPU calls whose signatures changed, in a kernel exported for CUDA."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(x_ref, o_ref):
        def scoped(smem, acc_smem, bar):
            plgpu.copy_gmem_to_smem(x_ref, smem, bar.at[0])
            plgpu.barrier_wait(bar.at[0])

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, smem, compat.mosaic_gpu_transpose(smem, (1, 0)))
                return acc_ref[...]

            acc = pl.run_scoped(mma, plgpu.ACC((shape[0], shape[0]), jnp.float32))
            acc_smem[...] = acc + compat.mosaic_gpu_load(acc_smem, plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc_smem, o_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM(shape, jnp.bfloat16, transforms=transforms),
            plgpu.SMEM((shape[0], shape[0]), jnp.float32,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
            plgpu.Barrier(num_barriers=1),
        )  # fmt: skip

    fn = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((shape[0], shape[0]), jnp.float32),
        compiler_params=compat.mosaic_gpu_compiler_params(),
    )
    arg = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(arg).mlir_module()
    assert "custom_call @mosaic_gpu" in text
