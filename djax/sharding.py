"""Tensor and expert parallelism: the device mesh, the param -> `PartitionSpec` table, and
the placement of row arrays (`djax.programs` wraps the programs in `shard_map`).

Mesh axes are `("data", "model")`, or `("data", "expert")` when experts split by expert.
Everything model-parallel shares that second axis, of size
`n = max(tensor_parallel, expert_parallel)`: attention heads (by kv head; output projection
by input, then `psum`), dense MLP hidden units, the vocabulary of the output head (the
decoder combines per-device maxima and sums instead of gathering logits), and the K/V
buffers (by kv head). Experts are split by expert when `expert_parallel > 1` (each device
owns `experts / n` whole experts and runs them on the replicated block tokens, then `psum`),
otherwise by their hidden units. Rows of the batch split over `data`.

Multi-host runs call `init_distributed()` first; the same mesh code then spans every host's
devices, with no transport of our own.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from djax.config import ModelConfig
from djax.models import abstract_params, fp8

DATA, MODEL, EXPERT = "data", "model", "expert"


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    **kwargs: Any,
) -> None:
    """Join a multi-host run: a documented wrapper over `jax.distributed.initialize`.

    Arguments default to $DJAX_COORDINATOR (host:port of process 0), $DJAX_NUM_PROCESSES and
    $DJAX_PROCESS_ID; when those are unset too, JAX detects the cluster itself (SLURM,
    Open MPI, Kubernetes...). Call it once per process, before any other JAX call.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("DJAX_COORDINATOR")
    if num_processes is None and "DJAX_NUM_PROCESSES" in env:
        num_processes = int(env["DJAX_NUM_PROCESSES"])
    if process_id is None and "DJAX_PROCESS_ID" in env:
        process_id = int(env["DJAX_PROCESS_ID"])
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)


def make_mesh(
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    data_parallel: int = 1,
    devices: list | None = None,
) -> Mesh:
    """A mesh over the first `data_parallel * n` devices, where
    `n = max(tensor_parallel, expert_parallel)` (when both exceed 1 they must be equal).
    Axes `("data", "model")`; the second is named `"expert"` when `expert_parallel > 1`, so
    the mesh itself says how experts split."""
    for name, value in (
        ("tensor_parallel", tensor_parallel),
        ("expert_parallel", expert_parallel),
        ("data_parallel", data_parallel),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; expected a positive int")
    if tensor_parallel > 1 and expert_parallel > 1 and tensor_parallel != expert_parallel:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} and expert_parallel="
            f"{expert_parallel} share one model axis; give equal sizes or set "
            "one of them to 1"
        )
    n = max(tensor_parallel, expert_parallel)
    devices = list(devices if devices is not None else jax.devices())
    if n * data_parallel > len(devices):
        raise ValueError(
            f"a mesh of data_parallel={data_parallel} x model={n} needs "
            f"{n * data_parallel} devices; {len(devices)} are available"
        )
    grid = np.array(devices[: n * data_parallel]).reshape(data_parallel, n)
    left_out = sorted({d.process_index for d in devices} - {d.process_index for d in grid.flat})
    if left_out:
        raise ValueError(
            f"a mesh of data_parallel={data_parallel} x model={n} takes {n * data_parallel} of "
            f"the {len(devices)} devices and none of process(es) {left_out}, which could not "
            "run it; expected sizes whose product covers every process's devices (raise "
            "data_parallel)"
        )
    return Mesh(grid, (DATA, EXPERT if expert_parallel > 1 else MODEL))


MESH_AXES = ((DATA, MODEL), (DATA, EXPERT))


def model_axis(mesh: Mesh) -> str:
    """The name of the model-parallel axis (`"model"` or `"expert"`); a ValueError for a
    mesh whose axes are not `MESH_AXES`' (a hand-built mesh's axes in another order or
    under other names would be read wrongly)."""
    if tuple(mesh.axis_names) not in MESH_AXES:
        raise ValueError(
            f"mesh axes {tuple(mesh.axis_names)}; expected one of {MESH_AXES} (data first): "
            "build the mesh with djax.make_mesh"
        )
    return mesh.axis_names[1]


def experts_by_expert(mesh: Mesh) -> bool:
    return model_axis(mesh) == EXPERT


def check_divisible(config: ModelConfig, mesh: Mesh) -> None:
    """Every split size must divide what it splits; the error names the value."""
    n = mesh.shape[model_axis(mesh)]
    checks = [("n_kv_heads", config.n_kv_heads), ("vocab_size", config.vocab_size)]
    if not config.is_moe or not all(config.moe_layers):
        checks.append(("mlp hidden size", config.mlp_hidden))
    if config.is_moe:
        if experts_by_expert(mesh):
            checks.append(("num_experts", config.n_experts))
        else:
            checks.append(("expert hidden size", config.expert_hidden))
        if config.shared_expert_hidden:
            checks.append(("shared expert hidden size", config.shared_expert_hidden))
    for name, value in checks:
        if value % n:
            raise ValueError(f"{name}={value} is not divisible by the model-parallel size {n}")


def param_spec(path: tuple[str, ...], ndim: int, axis: str) -> P:
    """The `PartitionSpec` of the param at `path` (keys of the params dict) on a mesh whose
    model-parallel axis is `axis`."""
    name, leaf = path[0], path[-1]
    by_expert = axis == EXPERT
    if name == "lm_head":
        return P(None, axis)
    if name.startswith("attn_") and leaf == "qkv":
        return P(None, axis, None, None)
    if name.startswith("attn_") and leaf == "attn_out":
        return P(axis, None, None, None)
    if name.startswith("ff_") and leaf == "gate_up":
        if ndim == 4:  # stacked experts [experts, model, 2, ffn]
            return P(axis, None, None, None) if by_expert else P(None, None, None, axis)
        return P(None, None, axis)
    if name.startswith("ff_") and leaf == "down":
        if ndim == 3:  # stacked experts [experts, ffn, model]
            return P(axis, None, None) if by_expert else P(None, axis, None)
        return P(axis, None)
    return P()  # embedding, norms, router, expert bias: replicated


def param_specs(
    config: ModelConfig, dtype: Any, mesh: Mesh, weights: str = "dtype", k_major: bool = False
) -> dict:
    """The `PartitionSpec` of every param of weights of the format `weights`: an fp8
    weight's values as the weight (with `k_major`, the values `fp8.k_major_order` moves
    take its spec in their order), its scales as the values' output axes
    (`fp8.scale_spec`)."""
    check_divisible(config, mesh)
    axis = model_axis(mesh)
    abstract = abstract_params(config, dtype, weights)
    moved = k_major and weights == "fp8"

    def spec(path: tuple, leaf: Any) -> P:
        keys = tuple(k.key for k in path)
        values = fp8.values_name(keys[-1])
        if values is None:
            spec = param_spec(keys, leaf.ndim, axis)
            order = fp8.k_major_order(keys[-1], leaf.ndim) if moved else None
            if order is None:
                return spec
            full = tuple(spec) + (None,) * (leaf.ndim - len(spec))
            return P(*(full[i] for i in order))
        parent = abstract
        for key in keys[:-1]:
            parent = parent[key]
        ndim = parent[values].ndim
        axes = fp8.contraction_axes(values, ndim)
        return fp8.scale_spec(param_spec((*keys[:-1], values), ndim, axis), axes, ndim)

    return jax.tree_util.tree_map_with_path(spec, abstract)


def param_shardings(
    config: ModelConfig, dtype: Any, mesh: Mesh, weights: str = "dtype", k_major: bool = False
) -> dict:
    """`NamedSharding`s for loading params straight into their shards (`param_specs`)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(config, dtype, mesh, weights, k_major),
        is_leaf=lambda x: isinstance(x, P),
    )


def place_rows(mesh: Mesh, array: np.ndarray) -> jax.Array:
    """A host array of rows as a global array split over `data` (every process passes the
    same host array; each places its own devices' rows)."""
    if array.shape[0] % mesh.shape[DATA]:
        raise ValueError(
            f"batch={array.shape[0]} is not divisible by data_parallel={mesh.shape[DATA]}"
        )
    sharding = NamedSharding(mesh, P(DATA))
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def place_whole(mesh: Mesh, array: np.ndarray) -> jax.Array:
    """A host array replicated on every device of the mesh (every process passes the same
    host array)."""
    sharding = NamedSharding(mesh, P())
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
