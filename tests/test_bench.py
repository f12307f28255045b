"""The profile summary the benchmark notes quote: categories, idle gaps, idle time bordering
collectives, per device."""

import pytest

from bench.profile import categorize, device_events, event_category, summarize


@pytest.mark.parametrize(
    "name, category",
    [
        ("psum_1454_0_fusion_1", "collectives"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collectives"),
        ("gemm_fusion_dot_1677", "matmul"),
        ("residual_product__1", "matmul"),
        ("expert_matmul_gated__1", "moe"),
        ("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
        ("loop_dynamic_update_slice_fusion_31", "copies"),
        ("loop_add_fusion_62", "norms/elementwise"),
    ],
)
def test_categories(name, category):
    assert categorize(name) == category


def test_event_category_prefers_the_kernel_name():
    """A product inside the attention module is a matmul; a nameless fusion takes its
    category from the scope in its args."""
    scope = {"long_name": "jit(generate)/while/body/attn_3/Attention/dot_general"}
    assert event_category({"name": "matmul_partials", "args": scope}) == "matmul"
    assert event_category({"name": "qkv_matmul_rope", "args": scope}) == "matmul"
    assert event_category({"name": "split_kv_attention", "args": scope}) == "attention"
    assert event_category({"name": "loop_select_fusion", "args": scope}) == "attention"
    decoder = {"long_name": "jit(generate)/while/body/decoder/reduce_max"}
    assert event_category({"name": "input_reduce_fusion_9", "args": decoder}) == "decoder"
    assert event_category({"name": "loop_add_fusion_2"}) == "norms/elementwise"


def _kernel(name, start, duration, tid=1, pid=7):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": start, "dur": duration}


def test_summary_counts_idle_gaps_and_those_bordering_collectives():
    events = [
        _kernel("gemm_fusion_dot_1", 0, 10),
        _kernel("psum_1_fusion", 30, 5, tid=2),  # 20 idle before it (bordering)
        _kernel("loop_add_fusion_1", 40, 2),  # 5 idle after it (bordering)
        _kernel("gemm_fusion_dot_2", 41, 9),  # overlaps: no gap
        _kernel("loop_add_fusion_2", 60, 2),  # 10 idle between compute kernels
    ]
    summary = summarize(events)
    assert summary["wall_us"] == 62
    assert summary["busy_us"]["idle gaps"] == 35
    assert summary["idle_next_to_collectives_us"] == 25
    assert summary["busy_us"]["collectives"] == 5
    assert summary["busy_us"]["matmul"] == 19
    assert summary["busy_us"]["norms/elementwise"] == 4
    assert summary["kernel_calls"]["gemm_fusion_dot_1"] == {
        "calls": 1,
        "median_us": 10.0,
        "mean_us": 10.0,
    }


def test_kernel_calls_count_each_name():
    events = [_kernel("add_rms_norm", 10 * i, d) for i, d in enumerate((2, 3, 9))]
    assert summarize(events)["kernel_calls"]["add_rms_norm"] == {
        "calls": 3,
        "median_us": 3.0,
        "mean_us": 14 / 3,
    }


def test_parse_options():
    from bench.common import parse_options

    assert parse_options("default") == {}
    assert parse_options("norm_impl=xla,rope_impl=pallas") == {
        "norm_impl": "xla",
        "rope_impl": "pallas",
    }
    with pytest.raises(SystemExit, match="options 'norm_impl'; expected 'default' or key=value"):
        parse_options("norm_impl")


def test_device_events_split_by_device_and_skip_the_host():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/host:CPU"}},
    ]
    kernels = [_kernel("a", 0, 1, pid=1), _kernel("b", 0, 1, pid=2), _kernel("c", 0, 1, pid=3)]
    kernels.append(_kernel("zero", 5, 0, pid=1))
    per_device = device_events({"traceEvents": meta + kernels})
    assert list(per_device) == ["/device:GPU:0", "/device:GPU:1"]
    assert [e["name"] for e in per_device["/device:GPU:0"]] == ["a"]


def test_kernel_time_rows():
    """rel_error is the relative L2 error; off GPUs time_row falls back to wall time per
    product and derives the weight read rate from it."""
    import jax.numpy as jnp

    from bench.kernel_time import rel_error, time_row

    x = jnp.arange(1.0, 5.0)
    assert rel_error(x, x) == 0.0
    assert abs(rel_error(2 * x, x) - 1.0) < 1e-6
    row = {}
    time_row(row, lambda a: a * 2, (x,), calls=3, weight_bytes=10**6, products=2)
    assert set(row["kernels_us"]) == {"wall"} and row["us"] == row["kernels_us"]["wall"] > 0
    assert row["weight_TB_per_s"] == 10**6 / row["us"] / 1e6


def test_weight_bytes_counts_the_experts_reached():
    """Stacked expert weights count by the share of experts reached; the embedding never,
    a dense MLP's and a shared expert's weights always."""
    import jax.numpy as jnp

    from bench.common import weight_bytes

    params = {
        "embed": jnp.zeros((100, 8)),
        "ff_0": {"gate_up": jnp.zeros((4, 8, 2, 16)), "down": jnp.zeros((4, 16, 8))},
        "ff_1": {"gate_up": jnp.zeros((8, 2, 16)), "down": jnp.zeros((16, 8))},
    }
    experts, dense = 4 * (8 * 2 * 16 + 16 * 8) * 4, (8 * 2 * 16 + 16 * 8) * 4
    assert weight_bytes(params) == experts + dense
    assert weight_bytes(params, experts_read=1.0) == experts // 4 + dense


def test_spread_routing_moves_each_token_by_its_row():
    """Tokens that all pick experts (0, 1) of 8 go to (2i, 2i + 1) mod 8: four tokens reach
    all eight; weights and each token's distinct experts are kept; counted experts follow."""
    import jax.numpy as jnp
    import numpy as np

    from bench.common import spread_routing

    def same_route(x, router, bias, top_k, normalise):
        n = x.shape[0]
        return jnp.full((n, top_k), 0.5), jnp.tile(jnp.arange(top_k, dtype=jnp.int32), (n, 1))

    weights, experts = spread_routing(same_route)(jnp.zeros((5, 3)), jnp.zeros((3, 8)), None, 2, 0)
    np.testing.assert_array_equal(experts, [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]])
    np.testing.assert_array_equal(weights, np.full((5, 2), 0.5))


def test_experts_hit_counts_a_generation(moe_model):
    """The tiny LLaDA-MoE (8 experts, top-2): a generation's whole-sequence forwards and
    block forwards reach between 2 and 8 experts per layer; spread routing reaches all 8
    in a refresh."""
    from unittest import mock

    import djax
    from bench.common import experts_hit, spread_routing
    from djax.models import llada_moe

    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    hit = experts_hit(moe_model, [0, 10, 20, 30, 40, 50], config)
    assert set(hit) == {"whole", "window"}
    assert all(2 <= v <= 8 for v in hit.values()), hit
    with mock.patch.object(llada_moe, "route", spread_routing(llada_moe.route)):
        spread = experts_hit(moe_model, [0, 10, 20, 30, 40, 50], config)
    assert spread["whole"] == 8.0
