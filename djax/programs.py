"""The programs a loaded model runs, built with its kernel choice resolved once: the
whole-sequence forward of `forward_logits` and the row programs of `djax.diffusion`
(`run_generation`, `run_block_call`), on one device or as one `shard_map` over the model's
mesh (`djax.sharding`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from djax import sharding
from djax.config import ModelConfig
from djax.diffusion import Plan, chained
from djax.kernel_options import KernelOptions
from djax.models import build_module
from djax.models import kernel_choice as choice
from djax.models.kernel_choice import Device, KernelChoice, Shapes, describe, resolve
from djax.models.layers import TransformerLM


def device_of(mesh: Any) -> Device:
    """The device a model's programs run on (the mesh's first, or JAX's default)."""
    return describe(mesh.devices.flat[0] if mesh is not None else jax.devices()[0])


def plan_shapes(plan: Plan, mesh: Any = None) -> Shapes:
    """The forwards of a generation program of `plan` (`diffusion.Plan` or
    `block_diffusion.BlockPlan`), per device: its rows split over the mesh's `data` axis;
    block forwards over `plan.forward_window` positions."""
    batch = plan.batch // (mesh.shape[sharding.DATA] if mesh is not None else 1)
    return Shapes(batch, plan.forward_window, plan.seq_len, plan.block_len)


def kernel_choice(
    options: KernelOptions,
    config: ModelConfig,
    dtype: Any,
    shapes: Shapes,
    mesh: Any = None,
    device: Device | None = None,
    weights: str = "dtype",
    k_major: bool | None = None,
) -> KernelChoice:
    """`kernel_choice.resolve` for a model of `config` in `dtype` with weights of the format
    `weights` (fp8 values K-major where `k_major`; None: as the options place them) on
    `mesh` (or one device): the device read from the mesh unless given."""
    split = _split(mesh)
    return resolve(
        options,
        device or device_of(mesh),
        config,
        dtype,
        shapes,
        weights=weights,
        k_major=k_major,
        sharded=mesh is not None,
        **split,
    )


def holds_k_major(
    options: KernelOptions, config: ModelConfig, dtype: Any, mesh: Any, weights: str
) -> bool:
    """`kernel_choice.holds_k_major` for a model of `config` in `dtype` with weights of the
    format `weights` on `mesh` (or JAX's default device): the layout its params take."""
    return choice.holds_k_major(options, device_of(mesh), config, dtype, weights, **_split(mesh))


def _split(mesh: Any) -> dict:
    """How a mesh splits a model's weights: `shards` ways over its model axis, experts by
    expert under expert parallelism."""
    if mesh is None:
        return {"shards": 1, "split_experts": False}
    axis = sharding.model_axis(mesh)
    return {"shards": mesh.shape[axis], "split_experts": axis == sharding.EXPERT}


def local_module(config: ModelConfig, dtype: Any, kernels: KernelChoice, mesh: Any) -> Any:
    """The module as one device runs it: the whole model without a mesh, else its weight
    shards, summed (`psum`) over the mesh's model axis."""
    axis = None if mesh is None else sharding.model_axis(mesh)
    return build_module(config, dtype, axis, kernels, **_split(mesh))


def block_causal(key_valid: jax.Array, positions: jax.Array, block_length: int) -> jax.Array:
    """Each query's visible keys [batch, seq, seq] under block-causal attention: the valid
    keys of its own block and earlier ones, blocks of `block_length` positions from
    position 0 (`positions` [batch, seq])."""
    block = positions // block_length
    return key_valid[:, None, :] & (block[:, None, :] <= block[:, :, None])


def sequence_logits(
    module: TransformerLM,
    params: dict,
    token_ids: jax.Array,
    key_valid: jax.Array,
    block_length: int | None = None,
) -> jax.Array:
    """Whole-sequence logits of `module` ([batch, seq, vocab_local] fp32); positions count
    from each row's first valid token. Attention is bidirectional, or block-causal in blocks
    of `block_length` (`block_causal`)."""
    positions = jnp.maximum(jnp.cumsum(key_valid, axis=1) - 1, 0)
    mask = key_valid if block_length is None else block_causal(key_valid, positions, block_length)
    x = module.apply({"params": params}, token_ids, method="embed")
    hidden, _ = module.apply({"params": params}, x, positions, mask)
    return module.apply({"params": params}, hidden, method="logits")


@functools.lru_cache(maxsize=16)
def forward_program(
    config: ModelConfig,
    dtype: Any,
    kernels: KernelChoice,
    mesh: Any,
    block_length: int | None = None,
) -> Any:
    """The jitted `sequence_logits` (`forward_logits`); on a mesh the sharded forward under
    `shard_map`, its logits gathered over the vocabulary at the end."""
    module = local_module(config, dtype, kernels, mesh)
    logits = functools.partial(sequence_logits, module, block_length=block_length)
    if mesh is None:
        return jax.jit(logits)
    specs = sharding.param_specs(config, dtype, mesh, kernels.weights, kernels.k_major)
    program = jax.shard_map(
        logits,
        mesh=mesh,
        in_specs=(specs, P(), P()),
        out_specs=P(None, None, sharding.model_axis(mesh)),
        check_vma=False,
    )
    # gathered onto every device, so each process (of a multi-host mesh) can read them
    return jax.jit(program, out_shardings=NamedSharding(mesh, P()))


def donated(run: Any, mesh: Mesh | None = None) -> tuple[int, ...]:
    """The arguments a row program `run` on `mesh` donates: the tokens (argument 1) where
    its outputs hold a buffer of their shape to reuse (a whole generation's tokens), none
    for a block call (its outputs are the block, the keys and the table) or where the rows
    are split over a data axis (the outputs are replicated, so the split tokens buffer
    fits none of them): a donated buffer that goes unused makes XLA warn at every compile."""
    if getattr(run, "is_block_call", False):
        return ()
    if mesh is not None and mesh.shape.get(sharding.DATA, 1) > 1:
        return ()
    return (1,)


def row_program(model: Any, plan: Plan, run: Any, kernels: KernelChoice) -> Any:
    """A row program (`run_generation`, a block call, block diffusion's) for `model`
    (config, dtype, mesh) and `plan`, following `kernels`, jitted, donating `donated`'s. On a
    mesh it is one `shard_map` that takes host-shaped arrays like the single-device program
    and returns its row outputs replicated on every device and its counters as one value
    per data shard. Block calls (marked `diffusion.block_call`) are `diffusion.chained`:
    they also take the rows' `Slots` and the `Carried` table, and return the table
    updated."""
    module = local_module(model.config, model.dtype, kernels, model.mesh)
    jit_options: dict[str, Any] = {"donate_argnums": donated(run, model.mesh)}
    if model.mesh is None:

        def program(params, tokens, key_valid, positions, rows):
            return run(module, params, plan, tokens, key_valid, positions, rows)

    else:
        mesh = model.mesh
        axis = sharding.model_axis(mesh)
        specs = sharding.param_specs(
            model.config, model.dtype, mesh, kernels.weights, kernels.k_major
        )

        def local(params, tokens, key_valid, positions, rows):
            out = run(module, params, plan, tokens, key_valid, positions, rows, axis)
            return {k: jnp.reshape(v, (1,)) if v.ndim == 0 else v for k, v in out.items()}

        row = P(sharding.DATA)
        program = jax.shard_map(
            local, mesh=mesh, in_specs=(specs, row, row, row, row), out_specs=row, check_vma=False
        )
        jit_options["out_shardings"] = NamedSharding(mesh, P())
    if getattr(run, "is_block_call", False):
        program = chained(program)
    return jax.jit(program, **jit_options)
