"""The profile summary the benchmark notes quote: categories, idle gaps, idle time bordering
collectives, per device."""

import dataclasses
import re
from pathlib import Path

import numpy as np
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
    # Mosaic GPU kernels without a name: by their scope, else a bucket of their own
    mosaic = "anonymous_mosaic_gpu_kernel"
    assert event_category({"name": mosaic, "args": scope}) == "attention"
    experts = {"long_name": "jit(generate)/while/body/moe_2/experts/custom_call"}
    assert event_category({"name": mosaic, "args": experts}) == "moe"
    assert event_category({"name": mosaic}) == "mosaic (unnamed)"


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
    assert parse_options("norm_impl=xla,rope_impl=mosaic") == {
        "norm_impl": "xla",
        "rope_impl": "mosaic",
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

    from bench.kernels.timing import rel_error, time_row

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
    hit = experts_hit(moe_model, [[0, 10, 20, 30, 40, 50]], config)
    assert set(hit) == {"whole", "window"}
    assert all(2 <= v <= 8 for v in hit.values()), hit
    with mock.patch.object(llada_moe, "route", spread_routing(llada_moe.route)):
        spread = experts_hit(moe_model, [[0, 10, 20, 30, 40, 50]], config)
    assert spread["whole"] == 8.0


def test_spread_grouped_routing_keeps_each_token_group_limited():
    """LLaDA2's router on 8 identical tokens (a block of mask tokens) at the tiny shape (16
    experts in 4 groups of 4, 2 groups kept, top-4): all pick one token's 4 experts. Spread,
    row r keeps its weights and 4 distinct experts in 2 groups, its count per group rotated
    by r groups, and the 8 rows reach at least twice as many experts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.common import model_config, spread_grouped_routing
    from djax.models.llada2 import route_grouped

    cfg = model_config("llada2_mini", tiny=True)
    assert (cfg.n_experts, cfg.expert_groups, cfg.groups_per_token) == (16, 4, 2)
    token = jax.random.normal(jax.random.key(0), (1, cfg.d_model))
    router = jax.random.normal(jax.random.key(1), (cfg.d_model, cfg.n_experts))
    args = (jnp.tile(token, (8, 1)), router, jnp.zeros(16), 4, 4, 2, cfg.routed_scaling)
    weights, experts = route_grouped(*args)
    spread_weights, spread = spread_grouped_routing(route_grouped)(*args)
    spread = np.asarray(spread)
    assert len(np.unique(experts)) == 4
    np.testing.assert_array_equal(spread_weights, weights)
    per_group = np.bincount(np.asarray(experts[0]) // 4, minlength=4)
    for r, row in enumerate(spread):
        assert len(set(row)) == 4 and len(set(row // 4)) == 2, row
        np.testing.assert_array_equal(np.bincount(row // 4, minlength=4), np.roll(per_group, r))
    assert len(np.unique(spread)) >= 8


def test_spread_grouped_routing_reaches_more_experts_in_a_generation():
    """The tiny LLaDA2 bench model (random bf16 weights): a generation's block forwards reach
    more of the 16 experts per MoE layer with spread routing than with the random router."""
    from unittest import mock

    import djax
    from bench.common import bench_model, experts_hit, model_config, spread_grouped_routing
    from djax.models import llada2

    model, _ = bench_model(model_config("llada2_mini", tiny=True))
    config = djax.GenerationConfig(gen_length=32, block_length=8, steps=8, early_stop=False)
    prompts = [list(range(1, 17))]
    hit = experts_hit(model, prompts, config)
    with mock.patch.object(llada2, "route_grouped", spread_grouped_routing(llada2.route_grouped)):
        spread = experts_hit(model, prompts, config)
    assert set(hit) == set(spread) == {"prefill", "block", "block_and_previous"}
    assert all(4 <= v <= 16 for v in (*hit.values(), *spread.values())), (hit, spread)
    assert spread["block"] > hit["block"] and spread["block_and_previous"] > hit["block"]


def test_block_diffusion_limit_counts_each_kind_of_forward():
    """Against reading the weights alone: the prefill reads its experts and no head, each
    block's first step the experts of two blocks' tokens, the other steps the block's; without
    the cache every step is a whole-sequence forward. Against the FLOPs alone, a batch of 2
    takes twice as long."""
    import dataclasses
    import math
    from types import SimpleNamespace

    from bench.common import SETTING, bench_model, model_config, weight_bytes
    from bench.generate import block_diffusion_limit

    model, _ = bench_model(model_config("llada2_mini", tiny=True))
    params, config = model.params, dataclasses.replace(SETTING, steps=16)
    stats = SimpleNamespace(forwards=17, refreshes=1, blocks=8)
    hit = {"prefill": 4.0, "block_and_previous": 8.0, "block": 6.0}
    by_bytes = {"hbm_read_bytes_per_s": 1.0, "matmul_flops_per_s": math.inf}
    expected = weight_bytes(params, 4.0, head=False) + 8 * weight_bytes(params, 8.0)
    expected += 8 * weight_bytes(params, 6.0)
    assert block_diffusion_limit(model, stats, 128, 1, config, hit, by_bytes) == expected
    whole = SimpleNamespace(forwards=16, refreshes=16, blocks=8)
    none = dataclasses.replace(config, cache="none")
    seconds = block_diffusion_limit(model, whole, 128, 1, none, {"whole": 16.0}, by_bytes)
    assert seconds == 16 * weight_bytes(params, 16.0)
    by_flops = {"hbm_read_bytes_per_s": math.inf, "matmul_flops_per_s": 1.0}
    one, two = (block_diffusion_limit(model, stats, 128, b, config, hit, by_flops) for b in (1, 2))
    assert math.isclose(two, 2 * one)


def test_generate_runs_the_llada2_mini_shape_end_to_end(tmp_path):
    """`python -m bench.generate --models llada2_mini --tiny`: block diffusion chosen from the
    family (its block cache; the prefix cache skipped), one row per decoder with the family,
    the batch, tokens/s and a positive limit; the forwards are the prefill, each block's
    first step (with the block before it) and its other steps."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OUT": str(tmp_path)}
    command = [sys.executable, "-m", "bench.generate", "--models", "llada2_mini", "--tiny"]
    command += ["--prompts", "32", "--caches", "prefix", "dual", "--steps", "16"]
    command += ["--batch", "1", "--repeats", "1", "--routing", "spread"]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "has no cache ['prefix']: skipped" in done.stdout
    [path] = tmp_path.iterdir()
    assert path.name.startswith("generate_llada2_spread_cpu")  # _x<n> with fake devices
    rows = json.loads(path.read_text())["results"]
    assert [(r["decoder"], r["cache"]) for r in rows] == [
        ("low_confidence", "dual"),
        ("threshold", "dual"),
    ]
    for row in rows:
        assert (row["model"], row["family"], row["batch"], row["steps"]) == (
            "llada2_mini",
            "llada2",
            1,
            16,
        )
        assert row["tokens_per_s"] > 0 and row["limit_tokens_per_s"] > 0
        assert row["pct_of_limit"] > 0
        # 8 blocks of 2 steps: 1 prefill, 8 first steps, 8 others
        assert (row["forwards"], row["refreshes"], row["blocks"]) == (17, 1, 8)
        assert set(row["experts_hit"]) == {"prefill", "block", "block_and_previous"}


def test_readme_figures_name_result_files_that_exist():
    """Every result file the README names by its path under bench/results/ is in the
    repository: a figure never cites a file a later run or cleanup removed."""
    root = Path(__file__).resolve().parents[1]
    named = set(
        re.findall(r"bench/results/[\w./-]+\.(?:json|log)", (root / "README.md").read_text())
    )
    assert named, "the README names no result file"
    missing = sorted(path for path in named if not (root / path).is_file())
    assert not missing, f"README.md names result files that do not exist: {missing}"


def test_save_keeps_one_file_per_suite_and_device(tmp_path, monkeypatch):
    """`<name>_<device>.json` under $OUT, replaced by the next run of the same suite on the
    same device; the record names the device, commit, command and date; no staging file
    is left behind."""
    import json

    from bench import common

    info = {"device": "NVIDIA H200", "device_count": 1, "platform": "gpu", "jax": "0"}
    monkeypatch.setattr(common, "device_info", lambda: dict(info))
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("DJAX_COMMIT", "abc1234")
    first = common.save("generate", {"results": [1]})
    second = common.save("generate", {"results": [2]})
    assert first == second == tmp_path / "generate_NVIDIA_H200.json"
    record = json.loads(second.read_text())
    assert record["results"] == [2] and record["commit"] == "abc1234"
    assert {"benchmark", "device", "command", "date"} <= set(record)
    assert [p.name for p in tmp_path.iterdir()] == ["generate_NVIDIA_H200.json"]
    assert common.device_name({**info, "device_count": 2}) == "NVIDIA_H200_x2"
    assert "xla_options_env" not in record
    # XLA options a user set change every program of the run: the record says which
    monkeypatch.setenv("DJAX_XLA_OPTIONS", "xla_gpu_graph_min_graph_size=2")
    record = json.loads(common.save("generate", {"results": [3]}).read_text())
    assert record["xla_options_env"] == "xla_gpu_graph_min_graph_size=2"


def test_generate_rows_carry_the_batch_and_its_limit(dense_model):
    """A batch of 2 generates twice the tokens in the same forwards: against reading the
    weights (an unbounded matmul rate) its limit is twice batch 1's tokens/s, against the
    FLOPs (an unbounded bandwidth) the same."""
    import math

    import djax
    from bench.generate import positive, run_case

    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, early_stop=False)
    by_bytes = {"hbm_read_bytes_per_s": 1e9, "matmul_flops_per_s": math.inf}
    by_flops = {"hbm_read_bytes_per_s": math.inf, "matmul_flops_per_s": 1e9}
    rows = {
        (batch, name): run_case(dense_model, 8, batch, config, ceilings, repeats=1)
        for batch in (1, 2)
        for name, ceilings in (("bytes", by_bytes), ("flops", by_flops))
    }
    one, two = rows[1, "bytes"], rows[2, "bytes"]
    assert (one["batch"], two["batch"]) == (1, 2) and one["forwards"] == two["forwards"]
    assert two["tokens_per_s"] == 32 / two["seconds"]
    assert math.isclose(two["limit_tokens_per_s"], 2 * one["limit_tokens_per_s"])
    flops_one, flops_two = rows[1, "flops"]["limit_tokens_per_s"], rows[2, "flops"]
    assert math.isclose(flops_two["limit_tokens_per_s"], flops_one)
    # what the kernel options resolved to, as `djax generate --explain` prints it (CPU: XLA)
    assert one["kernels"].startswith("block forward: attention=xla")
    assert "\nrefresh: " in one["kernels"]
    assert positive("8") == 8
    with pytest.raises(Exception, match="batch '0'; expected a positive integer"):
        positive("0")


# bench.serve: the load generator's trace, its figures and plot (the server comes separately).


def _vocabulary():
    from bench.serve import prompt_vocabulary

    return prompt_vocabulary(512, (500, 501))


def test_serve_trace_is_seeded_clipped_and_poisson():
    """The same seed gives the same requests; every rate sends the same requests with the
    unit-rate gaps divided by the rate (inf: all at 0); lengths stay in their ranges, prompts
    hold no special id, and the gaps' mean is 1 / rate."""
    import math

    import numpy as np

    from bench.serve import LENGTHS, make_trace

    vocabulary = _vocabulary()
    trace = make_trace(2000, 4.0, vocabulary, seed=3)
    assert trace == make_trace(2000, 4.0, vocabulary, seed=3)
    assert trace != make_trace(2000, 4.0, vocabulary, seed=4)
    prompts = [len(r.prompt_ids) for r in trace]
    answers = [r.max_tokens for r in trace]
    assert LENGTHS.prompt[0] <= min(prompts) and max(prompts) <= LENGTHS.prompt[1]
    assert LENGTHS.answer[0] <= min(answers) and max(answers) <= LENGTHS.answer[1]
    assert 115 <= np.median(prompts) <= 141 and 115 <= np.median(answers) <= 141
    ids = np.concatenate([r.prompt_ids for r in trace])
    assert not np.isin(ids, [500, 501]).any() and ids.min() >= 0 and ids.max() < 512
    arrivals = np.array([r.arrival for r in trace])
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    assert abs(np.diff(arrivals).mean() - 1 / 4.0) < 0.1 / 4.0
    faster = make_trace(2000, 8.0, vocabulary, seed=3)
    assert [(r.prompt_ids, r.max_tokens) for r in faster] == [
        (r.prompt_ids, r.max_tokens) for r in trace
    ]
    np.testing.assert_allclose([r.arrival for r in faster], arrivals / 2)
    assert {r.arrival for r in make_trace(10, math.inf, vocabulary, seed=3)} == {0.0}
    with pytest.raises(ValueError, match="request rate 0.0; expected a positive number or inf"):
        make_trace(10, 0.0, vocabulary, seed=3)


def test_serve_urgent_share_marks_requests_of_the_same_trace():
    """`urgent_share` sends about that share of the requests with priority URGENT, the
    rest 0, without changing any request's arrival, prompt or answer; the same seed marks
    the same requests."""
    from bench.serve import URGENT, make_trace

    vocabulary = _vocabulary()
    plain = make_trace(2000, 4.0, vocabulary, seed=3)
    marked = make_trace(2000, 4.0, vocabulary, seed=3, urgent_share=0.1)
    assert {r.priority for r in plain} == {0} and {r.priority for r in marked} == {URGENT, 0}
    assert 150 <= sum(r.priority == URGENT for r in marked) <= 250
    assert [dataclasses.replace(r, priority=0) for r in marked] == plain
    assert marked == make_trace(2000, 4.0, vocabulary, seed=3, urgent_share=0.1)
    with pytest.raises(ValueError, match="urgent share 1.5; expected a number in"):
        make_trace(10, 4.0, vocabulary, seed=3, urgent_share=1.5)


def test_serve_lengths_clip_to_their_bounds():
    import numpy as np

    from bench.serve import LENGTHS, lognormal_lengths

    lengths = lognormal_lengths(np.random.default_rng(0), 1000, LENGTHS, (100, 150))
    assert lengths.min() == 100 and lengths.max() == 150
    assert ((lengths > 100) & (lengths < 150)).any()


def test_serve_equal_trace():
    from bench.serve import equal_trace

    trace = equal_trace(5, _vocabulary(), seed=0)
    assert [(r.arrival, len(r.prompt_ids), r.max_tokens) for r in trace] == [(0.0, 128, 256)] * 5
    assert len({r.prompt_ids for r in trace}) == 5


def test_serve_id_tokenizer_and_special_ids():
    """Answers decode to one word per id, special ids dropped when asked; the tiny dense
    model's special ids are its mask and EOS (= pad) ids."""
    from bench.common import model_config
    from bench.serve import IdTokenizer, special_ids

    assert set(special_ids(model_config("dense", tiny=True))) == {500, 501}
    tokenizer = IdTokenizer((500, 501))
    assert tokenizer.decode([3, 500, 42], skip_special_tokens=True) == " 3 42"
    assert tokenizer.decode([3, 500]) == " 3 500"


def test_serve_summary_of_hand_made_records():
    """Tokens/s and requests/s over the makespan, latency and TTFT percentiles (numpy's
    linear rule) over the requests that succeeded; failures counted."""
    from bench.serve import RequestRecord, summarize

    records = [
        RequestRecord(start=0.0, first_chunk=0.5, end=1.0, completion_tokens=100),
        RequestRecord(start=1.0, first_chunk=1.25, end=3.0, completion_tokens=50),
        RequestRecord(start=2.0, first_chunk=3.0, end=6.0, completion_tokens=10),
        RequestRecord(start=2.0, first_chunk=None, end=2.5, completion_tokens=0, error="boom"),
    ]
    summary = summarize(records, makespan=8.0)
    assert summary == pytest.approx(
        {
            "output_tokens_per_s": 160 / 8,
            "requests_per_s": 3 / 8,
            "p50_latency_s": 2.0,
            "p99_latency_s": 2.0 + 0.98 * 2.0,
            "p50_ttft_s": 0.5,
            "p99_ttft_s": 0.5 + 0.98 * 0.5,
            "failed": 1,
            "requests": 4,
            "makespan_s": 8.0,
        }
    )
    none_done = summarize(records[3:], makespan=1.0)
    assert none_done["p99_latency_s"] is None and none_done["output_tokens_per_s"] == 0
    assert "by_priority" not in summary  # every request at priority 0
    urgent = [dataclasses.replace(r, priority=-1) for r in records[:2]]
    by_priority = summarize([*urgent, *records[2:]], makespan=8.0)["by_priority"]
    assert by_priority["-1"] == pytest.approx(
        {
            "p50_latency_s": 1.5,
            "p99_latency_s": 1.0 + 0.99 * 1.0,
            "p50_ttft_s": 0.375,
            "p99_ttft_s": 0.25 + 0.99 * 0.25,
            "failed": 0,
            "requests": 2,
        }
    )
    assert by_priority["0"]["requests"] == 2 and by_priority["0"]["failed"] == 1
    assert by_priority["0"]["p50_latency_s"] == 4.0


def test_serve_server_figures_from_two_scrapes():
    """Compiles, host gaps and block calls between two scrapes of the server's metrics: the
    median interpolated inside its bucket, the idle fraction the gaps' sum over the wall;
    the device memory gauges as they stand (None where the backend reported none)."""
    from bench.serve import parse_metrics, server_figures
    from djax.serving.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.compiles.inc(7)
    metrics.host_gap.observe(0.5)  # before the run: not counted
    before = parse_metrics(metrics.exposition().decode())
    for gap in (2e-4, 3e-4, 4e-4, 0.003, 0.02):  # (1e-4, 2.5e-4] once, (2.5e-4, 5e-4] twice
        metrics.host_gap.observe(gap)
    for call in (0.02, 0.02):
        metrics.block_call.observe(call)
    metrics.compiles.inc()
    metrics.device_bytes.set(3e9)
    metrics.device_peak_bytes.set(5e9)
    figures = server_figures(before, parse_metrics(metrics.exposition().decode()), 2.0)
    assert figures == pytest.approx(
        {
            "compiles_during_run": 1,
            # half = 2.5 observations: the first bucket holds 1, the next 2 more
            "host_gap_median_s": 2.5e-4 + (5e-4 - 2.5e-4) * (2.5 - 1) / 2,
            "idle_fraction": (2e-4 + 3e-4 + 4e-4 + 0.003 + 0.02) / 2.0,
            "host_gaps_over_10ms": 1,
            "block_calls": 2,
            "block_call_median_s": 0.01 + (0.025 - 0.01) * 1 / 2,
            "busy_fraction": 0.04 / 2.0,
            "device_bytes_in_use": 3e9,
            "device_peak_bytes": 5e9,
        }
    )
    idle = server_figures(before, before, 1.0)
    assert idle["host_gap_median_s"] is None and idle["device_bytes_in_use"] is None


def _serve_rows():
    row = {
        "model": "dense",
        "output_tokens_per_s": 100.0,
        "requests_per_s": 1.0,
        "p50_latency_s": 1.0,
        "p99_latency_s": 2.0,
        "p50_ttft_s": 0.1,
        "p99_ttft_s": None,
        "failed": 0,
        "compiles_during_run": 0,
        "host_gap_median_s": 2e-4,
        "idle_fraction": 0.01,
    }
    return [
        {**row, "scheduler": s, "request_rate": rate}
        for s in ("continuous", "static")
        for rate in ("inf", 8.0, 2.0)
    ]


def test_serve_table():
    from bench.serve import table

    lines = table(_serve_rows()).splitlines()
    assert len(lines) == 7 and lines[0].split()[:3] == ["scheduler", "rate", "tok/s"]
    assert lines[1].split() == [
        "continuous", "inf", "100.0", "1.00", "1.00", "2.00", "0.10", "-", "0", "0", "0.200",
        "0.010",
    ]  # fmt: skip


def test_serve_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.serve import plot

    path = plot(_serve_rows(), tmp_path / "serve.png")
    assert path == tmp_path / "serve.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["serve.png"]


def test_serve_plot_skips_without_matplotlib(tmp_path, monkeypatch):
    import sys

    from bench.serve import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert plot(_serve_rows(), tmp_path / "serve.png") is None
    assert not list(tmp_path.iterdir())


def test_serve_command_lines():
    import math

    from bench.serve import parse

    client = parse(["--model", "moe", "--rates", "2", "inf"])
    assert (client.role, client.rates, client.schedulers) == (
        "client",
        [2.0, math.inf],
        ["continuous", "phase", "static"],
    )
    server = parse(["server", "--model", "dense", "--scheduler", "static", "--port", "9"])
    assert (server.role, server.scheduler, server.port, server.max_batch) == (
        "server",
        "static",
        9,
        32,
    )
    assert parse(["plot", "a.json", "b.json"]).results == ["a.json", "b.json"]
    with pytest.raises(SystemExit):
        parse(["--model", "dense", "--rates", "0"])
    with pytest.raises(SystemExit):
        parse(["--model", "dense", "--rates", "infx"])


def test_serve_rate_as_a_fraction_of_capacity():
    """`0.85x` is a fraction of the first scheduler's saturation rate: it needs the
    saturation run before it."""
    import math

    from bench.serve import OfCapacity, check_rates, parse

    client = parse(["--model", "dense", "--rates", "inf", "0.85x"])
    assert client.rates == [math.inf, OfCapacity(0.85)]
    check_rates(client.rates)
    with pytest.raises(SystemExit, match="0.85x needs inf"):
        check_rates([OfCapacity(0.85), math.inf])


def test_serve_end_to_end(tmp_path):
    """The client against a real tiny server on the CPU serving fp8 weights, sampled
    requests with top_p: one scheduler, one rate, a few requests, every one answered in
    full, no compile during the run, a clean exit."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "bench.serve", "--model", "dense", "--tiny"]
    command += ["--schedulers", "continuous", "--rates", "inf", "0.5x", "--requests", "3"]
    command += ["--max-batch", "2", "--ready-timeout", "120", "--sample-every", "0.2"]
    command += ["--weights", "fp8", "--temperature", "1.5", "--top-p", "0.8"]
    subprocess.run(command, cwd=repo, env=env, check=True, timeout=300)
    (result,) = tmp_path.glob("serve_*.json")
    assert result.name.startswith("serve_dense_fp8_")
    record = json.loads(result.read_text())
    assert record["weights"] == "fp8"
    assert record["sampling"] == {"temperature": 1.5, "top_k": 0, "top_p": 0.8}
    row, half = record["results"]
    assert (row["scheduler"], row["request_rate"], row["requests"]) == ("continuous", "inf", 3)
    assert half["request_rate"] == round(0.5 * row["requests_per_s"], 3)
    for r in (row, half):
        assert r["failed"] == 0 and r["compiles_during_run"] == 0, r
        assert r["output_tokens_per_s"] > 0 and r["p99_ttft_s"] <= r["p99_latency_s"]
        times = [sample["t"] for sample in r["samples"]]  # one at the start, one at the end
        assert len(times) >= 2 and times == sorted(times) and times[0] < 0.2, r["samples"]
        assert r["samples"][-1]["queue_depth"] == 0 and r["samples"][-1]["running_rows"] == 0
        assert r["queue_depth_max"] == max(sample["queue_depth"] for sample in r["samples"])
    assert record["servers"]["continuous"]["clean_exit"], record["servers"]
    server = record["servers"]["continuous"]
    assert server["memory_budget_bytes"] == 0  # a CPU has no budget
    # batches 1 and 2 (--max-batch 2) at each sequence bucket of the tiny trace
    from bench.common import SETTING
    from bench.serve import TINY_LENGTHS
    from djax.serving.layout import seq_buckets

    buckets = seq_buckets(TINY_LENGTHS.max_sequence, SETTING.block_length)
    # greedy and sampling programs of each
    assert server["programs_at_ready"] == 2 * 2 * len(buckets) == 8, server
    assert (tmp_path / "serve_dense_continuous.log").exists()


def test_memory_largest_batch_finds_the_boundary_in_few_compiles():
    """Against every batch tried in turn: the same largest batch, with the fitting batch
    and the one above it both asked for; a linear cost takes at most 4 asks."""
    from bench.memory import largest_batch

    costs = {
        "linear": lambda b: 100 + 37 * b,
        "steps": lambda b: 100 + 50 * (b // 4),
        "curved": lambda b: 100 + 3 * b * b,
    }
    for name, cost in costs.items():
        for limit in (50, 137, 500, 1000, 5000):
            for max_batch in (1, 2, 16, 64):
                batch, probes = largest_batch(cost, limit, max_batch)
                fitting = [b for b in range(1, max_batch + 1) if cost(b) <= limit]
                assert batch == max(fitting, default=0), (name, limit, max_batch)
                assert all(probes[b] == cost(b) for b in probes)
                if 0 < batch < max_batch:
                    assert {batch, batch + 1} <= set(probes), (name, limit, max_batch)
                if name == "linear":
                    assert len(probes) <= 4, (limit, max_batch, probes)


def test_memory_bench_writes_both_batches(tmp_path, monkeypatch):
    """`python -m bench.memory --tiny` (the engine's call bytes replaced by a line: 1000 +
    500 bytes a row with chunked logits, 1000 + 700 with whole ones): the largest batches
    within the budget, their ratio and bytes, one row per sequence."""
    import json

    from bench import memory as bench_memory
    from djax.serving.engine import ServingEngine

    def call_bytes(engine, batch, seq, sampling=False):
        whole = engine.config.generation.logits_chunk == 0
        return 1000 + (700 if whole else 500) * batch * seq // 64

    monkeypatch.setattr(ServingEngine, "call_bytes", call_bytes)
    monkeypatch.setenv("OUT", str(tmp_path))
    bench_memory.main(["--tiny", "--seqs", "64", "128", "--memory-bytes", "1100000"])
    (path,) = tmp_path.glob("memory_*.json")
    record = json.loads(path.read_text())
    assert record["benchmark"] == "memory" and record["memory_bytes"] == 1_100_000
    short, long = record["results"]
    weights = short["weight_bytes"]
    assert 500_000 < weights < 1_000_000  # the tiny dense model's bf16 weights
    budget = 1_100_000 - weights
    assert short["budget_bytes"] == long["budget_bytes"] == budget
    for row, rows_per_64 in ((short, 1), (long, 2)):
        chunked = (budget - 1000) // (500 * rows_per_64)
        whole = (budget - 1000) // (700 * rows_per_64)
        assert (row["batch_budgeted"], row["batch_unbudgeted"]) == (chunked, whole)
        assert row["ratio"] == round(chunked / whole, 3)
        assert row["call_bytes_budgeted"] == 1000 + 500 * rows_per_64 * chunked
        assert row["bytes_per_row_unbudgeted"] == 700 * rows_per_64
        assert row["logits_bytes_at_batch"] == {
            "batch": whole,
            "whole_less_chunked": 200 * rows_per_64 * whole,
        }
        assert row["logits_chunk"] == 128 and row["device_bytes"] is None


def test_run_device_detach_then_collect(tmp_path):
    """A stage detached by run_device.sh outlives the command that started it; collect
    waits for it and copies its log and exit status into $OUT."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "DJAX_DETACHED": str(tmp_path / "detached"), "PYTHONPATH": str(repo)}
    script = ["bash", "bench/run_device.sh"]
    first, second = tmp_path / "first", tmp_path / "second"
    for out in (first, second):
        out.mkdir()
    detach = [*script, "detach", "kernels.no_such_suite"]
    subprocess.run(detach, cwd=repo, env={**env, "OUT": str(first)}, check=True, timeout=60)
    assert (first / "detach.log").read_text().startswith("detached kernels.no_such_suite")
    collect = [*script, "collect", "60"]
    subprocess.run(collect, cwd=repo, env={**env, "OUT": str(second)}, check=True, timeout=90)
    assert (second / "detached.rc").read_text().strip() == "1"  # python: no such module
    assert "No module named" in (second / "kernels.no_such_suite.log").read_text()
    assert (second / "collect.log").read_text().startswith("ended: rc 1")
    # a folder that is not a detach folder is left as it was
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("a user's file")
    refused = subprocess.run(
        detach, cwd=repo, env={**env, "OUT": str(first), "DJAX_DETACHED": str(mine)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "not a detach folder" in refused.stderr
    assert [p.name for p in mine.iterdir()] == ["keep.txt"]


def test_mosaic_verdict_lines():
    """`bench.kernels.mosaic`'s verdict names the fastest right form of a `_norm` or
    `_tiled` product with how far the others trail, and says which forms failed, were
    wrong or did not run; products of other kinds get none."""
    from bench.kernels.mosaic import verdict

    def row(impl, us=None, rel_error=3e-3, product="out_norm"):
        timed = {} if us is None else {"us": us, "rel_error": rel_error}
        return {"product": product, "impl": impl, **timed}

    rows = [
        row("mosaic", 12.0),
        row("xla", 14.5),
        row("mosaic + xla norm", 13.0),
        row("mosaic", 99.0, product="down_norm"),
    ]
    assert verdict("out_norm", rows) == (
        "verdict out_norm: Mosaic 12.0 us | XLA 14.5 us | XLA on Mosaic partials "
        "13.0 us -> Mosaic fastest (XLA +2.5 us, XLA on Mosaic partials +1.0 us)"
    )
    rows = [
        row("mosaic", 9.0, rel_error=0.5, product="down_tiled"),
        row("xla", product="down_tiled"),
        row("mosaic + xla add", 16.0, product="down_tiled"),
    ]
    assert verdict("down_tiled", rows) == (
        "verdict down_tiled: Mosaic wrong (rel_error 5.0e-01) | XLA failed | "
        "XLA on Mosaic partials 16.0 us -> XLA on Mosaic partials fastest"
    )
    assert verdict("out_tiled", rows).endswith("XLA on Mosaic partials not run -> none ran")
    assert verdict("out", rows) is None


def test_fp8_matmul_bench_layouts_and_sweep():
    """bench.kernels.fp8_matmul: every weight layout holds the same e4m3 values and scales
    (as its form reads them), and the sweep keeps the tilings that fit."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.kernels import fp8_matmul
    from djax.kernels import fp8_matmul_mosaic

    w = jax.random.normal(jax.random.key(0), (256, 128)).astype(jnp.bfloat16)
    plain = fp8_matmul.weight_forms(w, "fp8 [k,n]")
    dense = np.asarray(plain.values.astype(jnp.float32) * plain.scale)  # [k, n]
    w_t, scale = fp8_matmul.weight_forms(w, "fp8 [n,k]")
    np.testing.assert_array_equal(np.asarray(w_t.astype(jnp.float32) * scale[:, None]).T, dense)
    gated = fp8_matmul.weight_forms(w, "fp8 [k,2,n]")
    assert gated.shape == (256, 2, 64) and gated.scale.shape == (2, 64)
    np.testing.assert_array_equal(gated.values.reshape(256, 128), plain.values)
    g_t, g_scale = fp8_matmul.weight_forms(w, "fp8 [2,n,k]")
    halves = np.asarray(g_t.astype(jnp.float32) * g_scale[..., None])  # [2, 64, 256]
    np.testing.assert_array_equal(np.concatenate(list(halves), axis=0).T, dense)
    assert fp8_matmul.weight_forms(w, "bf16 [k,2,n]").shape == (256, 2, 64)
    kept = fp8_matmul.sweep_tiles(4096, 4096)
    assert len(kept) == 21  # of 36: 128 x 256 never fits, nor 8 stages but of 64 x 128
    assert {(t.block_n, t.block_k) for t in kept} == {(64, 128), (64, 256), (128, 128)}
    for t in kept:
        fp8_matmul_mosaic.check_tiles(t, 4096, 4096)


def test_fp8_limit_runs_the_products_at_the_fp8_rate():
    """Under fp8 weights a forward's products (the weights' FLOPs) run at the fp8 matmul
    rate, its attention and head at the bf16 rate; bf16 weights run everything at the bf16
    rate, and the fp8 rate is not read."""
    import math

    from bench.common import bench_model, model_config
    from bench.forward import active_matmul_params, forward_flops
    from bench.generate import forward_seconds

    config = model_config("dense", tiny=True)
    ceilings = {"hbm_read_bytes_per_s": math.inf, "matmul_flops_per_s": 1.0}
    for weights in ("dtype", "fp8"):
        model, _ = bench_model(config, weights=weights)
        flops = forward_flops(config, model.params, 32, 96, 32)
        products = 2 * 32 * active_matmul_params(config, model.params)
        assert 0 < products < flops
        if weights == "dtype":
            assert forward_seconds(model, 2, ceilings, 32, 96, None, 32) == 2 * flops
        else:
            fp8 = {**ceilings, "fp8_matmul_flops_per_s": 2.0}
            seconds = forward_seconds(model, 2, fp8, 32, 96, None, 32)
            assert math.isclose(seconds, 2 * (products / 2 + flops - products))


def test_generate_cases_leave_the_threshold_row_out_when_asked():
    from bench.common import SETTING, model_config
    from bench.generate import cases

    config = model_config("dense", tiny=True)
    runs = cases(config, SETTING, ["dual", "none"], [64])
    assert [(r.decoder, r.cache) for r in runs] == [
        ("low_confidence", "dual"), ("low_confidence", "none"), ("threshold", "dual"),
    ]  # fmt: skip
    assert cases(config, SETTING, ["dual", "none"], [64], threshold=False) == runs[:2]


@pytest.mark.parametrize("donate", [False, True])
def test_time_in_program_threads_a_donated_state(donate):
    """With `donate` each call takes the last call's state (the caller's is consumed);
    without it every call starts from the caller's state, which stays usable."""
    import jax.numpy as jnp

    from bench.common import time_in_program

    state = jnp.zeros(4)
    seconds = time_in_program(lambda s, one: s + one, state, 3, jnp.float32(1), donate=donate)
    assert seconds > 0
    assert state.is_deleted() == donate
    if not donate:
        np.testing.assert_array_equal(state, 0)


def test_profile_in_program_gives_each_step_its_share(monkeypatch):
    """The trace of one call of `iters` steps, divided per step: each kernel's and each
    category's busy time, the idle gaps too. Off GPUs the trace holds no device events:
    `summarize`'s error."""
    import jax.numpy as jnp

    from bench import profile

    def add(state, one):
        return state + one

    assert "error" in profile.profile_in_program(add, jnp.zeros(2), 10, jnp.float32(1))
    events = [
        {"name": "loop_add_fusion", "ts": 0, "dur": 30, "args": {}},
        {"name": "nvjet_gemm", "ts": 40, "dur": 60, "args": {}},
    ]
    monkeypatch.setattr(profile, "newest_trace_events", lambda folder: {"/device:GPU:0": events})
    summary = profile.profile_in_program(add, jnp.zeros(2), 10, jnp.float32(1))
    assert summary["kernels_us_per_step"] == {"nvjet_gemm": 6.0, "loop_add_fusion": 3.0}
    assert summary["busy_us_per_step"]["matmul"] == 6.0
    assert summary["busy_us_per_step"]["idle gaps"] == 1.0
    # two steps of two kernels, listed out of order: the last step's kernels in time order
    steps = [
        {"name": "gemm_b", "ts": 130, "dur": 20, "args": {}},
        {"name": "rope_a", "ts": 0, "dur": 10, "args": {}},
        {"name": "rope_b", "ts": 100, "dur": 11, "args": {}},
        {"name": "gemm_a", "ts": 30, "dur": 21, "args": {}},
    ]
    monkeypatch.setattr(profile, "newest_trace_events", lambda folder: {"/device:GPU:0": steps})
    summary = profile.profile_in_program(add, jnp.zeros(2), 2, jnp.float32(1))
    assert summary["last_step_kernels"] == [["rope_b", 11], ["gemm_b", 20]]


def test_compile_rows_name_where_the_lowering_went():
    """`bench.compile --profile`: a tiny dense model's row holds the functions its lowering
    spent the most time in, by cumulative seconds (none more than the lowering itself), the
    lowering of the jitted program among them; without it the row has none."""
    from bench import compile as compile_bench
    from bench.common import bench_model, model_config

    model, _ = bench_model(model_config("dense", True))
    row = compile_bench.phases(model, 8, profile=True)
    hot = row["lowering_profile"]
    seconds = [entry["cumulative_s"] for entry in hot]
    assert len(hot) == 30 and seconds == sorted(seconds, reverse=True)
    assert seconds[0] <= row["lower_s"] + 1e-3
    assert any("lower" in entry["function"] for entry in hot), hot
    assert all(entry["calls"] >= 1 and entry["own_s"] <= entry["cumulative_s"] for entry in hot)
    assert "lowering_profile" not in compile_bench.phases(model, 8)


def test_generate_sampling_entries_parse_and_refuse_what_cannot_sample():
    import argparse

    from bench.generate import parse_sampling

    assert parse_sampling("greedy") == {}
    spec = parse_sampling("temperature=0.7,top_k=50,top_p=0.9")
    assert spec == {"temperature": 0.7, "top_k": 50, "top_p": 0.9}
    assert isinstance(spec["top_k"], int)
    bad_ones = ("top_p=0.9", "temperature=0", "temperature=x", "temp=1", "temperature")
    bad_ones += ("temperature=inf", "temperature=1,top_p=1.5", "temperature=1,top_p=0")
    for bad in (*bad_ones, "temperature=1,top_k=-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="sampling"):
            parse_sampling(bad)


def test_generate_runs_each_case_under_each_sampling_entry(tmp_path, monkeypatch):
    """`--sampling greedy temperature=0.7,top_p=0.9`: each case twice, its rows labelled,
    saved as `generate_sampling_…` (the greedy baseline file untouched); the sampled run's
    GenerationConfig carries the fields."""
    import json
    import sys

    from bench import generate as bench_generate

    seen = []
    real_run_case = bench_generate.run_case

    def run_case(model, prompt_len, batch, config, ceilings, repeats):
        seen.append((config.temperature, config.top_p))
        return real_run_case(model, prompt_len, batch, config, ceilings, repeats)

    monkeypatch.setattr(bench_generate, "run_case", run_case)
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["bench.generate", "--models", "dense", "--tiny", "--prompts", "16"]
    argv += ["--caches", "dual", "--steps", "16", "--no-threshold", "--repeats", "1"]
    argv += ["--sampling", "greedy", "temperature=0.7,top_p=0.9"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_generate.main()
    assert seen == [(0.0, 1.0), (0.7, 0.9)]
    [path] = tmp_path.iterdir()
    assert path.name.startswith("generate_sampling_cpu")
    rows = json.loads(path.read_text())["results"]
    assert [r["sampling"] for r in rows] == ["greedy", {"temperature": 0.7, "top_p": 0.9}]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_filter_sums_probe_times_each_form_and_restores_the_search(tmp_path, monkeypatch):
    """Each form is traced on its own (not the first form's trace of `filtered`), so a wrong
    form shows as a different kept set; the engine's search is put back afterwards."""
    import json
    import sys

    from bench.probes import filter_sums

    keeps_all = lambda order, weight, target, lo, hi, axis_name: lo  # noqa: E731
    forms = {"column 16x8": filter_sums.search(filter_sums.column, 16, 8), "all": keeps_all}
    monkeypatch.setattr(filter_sums, "FORMS", forms)
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["filter_sums", "--batches", "1", "--repeats", "1", "--vocab", "1024"]
    monkeypatch.setattr(sys, "argv", argv)
    own = filter_sums.decoders._highest_reaching
    filter_sums.main()
    assert filter_sums.decoders._highest_reaching is own
    [path] = tmp_path.iterdir()
    rows = json.loads(path.read_text())["results"]
    assert [r["same_kept_set"] for r in rows] == [True, False]


def test_sparse_call_probe_finds_large_copies():
    """`bench.probes.sparse_call.large_copies` names every copy of at least 1 MB in an HLO
    text, with its bytes, and nothing smaller."""
    from bench.probes.sparse_call import large_copies

    hlo = "\n".join(
        [
            "  %copy.3 = bf16[16,1184,32,128]{3,2,1,0} copy(bf16[16,1184,32,128]{3,2,1,0} %p)",
            "  %copy-start.1 = f32[512,1024]{1,0} copy-start(%q)",
            "  %copy.4 = f32[8,8]{1,0} copy(%r)",
            "  %add.1 = bf16[1024,1024]{1,0} add(%a, %b)",
        ]
    )
    assert large_copies(hlo) == [
        {"op": "copy", "shape": "bf16[16,1184,32,128]", "mb": 148.0},
        {"op": "copy-start", "shape": "f32[512,1024]", "mb": 2.0},
    ]


def test_sparse_speed_runs_the_llada_moe_shape(tmp_path):
    """`python -m bench.sparse --parts speed --shape moe --tiny`: the tiny LLaDA-MoE's block
    forward dense and sparse, its tokens spread over the experts, saved under the shape's own
    name (not over the LLaDA-8B rows) with the model and routing in the file and every row."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OUT": str(tmp_path)}
    command = [sys.executable, "-m", "bench.sparse", "--parts", "speed", "--shape", "moe"]
    command += ["--tiny", "--prompt-lens", "64", "--batches", "2", "--iters", "2"]
    command += ["--refresh-iters", "0"]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    [path] = tmp_path.iterdir()
    assert path.name.startswith("sparse_speed_moe_cpu")
    result = json.loads(path.read_text())
    assert (result["model"], result["routing"]) == ("moe", "spread")
    [row] = result["results"]
    assert (row["model"], row["batch"], row["prompt_len"], row["keys"]) == ("moe", 2, 64, 320)
    assert row["sparse"] == {"keep": 0.25, "recent": 64, "keys": 176}
    assert row["dense_ms"] > 0 and row["sparse_ms"] > 0
    assert row["speedup"] == row["dense_ms"] / row["sparse_ms"]


def test_load_phases_groups_whole_layers_and_keeps_every_param():
    """`bench.probes.load_phases.groups_of`: every param in exactly one group, a layer's
    params never split, the params of no layer in the first group, at most `count` groups."""
    from bench.probes.load_phases import groups_of

    names = sorted(
        ["embed", "lm_head", "norm"] + [f"{p}_{i}" for p in ("attn", "mlp") for i in range(10)]
    )
    for count in (1, 3, 4, 10, 20):
        groups = groups_of(names, count)
        assert len(groups) <= count and sorted(sum(groups, [])) == names
        assert {"embed", "lm_head", "norm"} <= set(groups[0])
        for i in range(10):
            (holder,) = [g for g in groups if f"attn_{i}" in g]
            assert f"mlp_{i}" in holder
    assert len(groups_of(names, 4)) == 4


def test_load_phases_steps_time_a_fresh_process_s_load(tmp_path, monkeypatch):
    """`load_phases --phases steps` loads the tiny fp8 folder in a fresh process and names
    the load's steps in order, each inside the load (the restore inside `restore_orbax`,
    the scans after the restore), with the whole load's seconds."""
    import json

    import jax
    import jax.numpy as jnp

    from bench.common import model_config
    from bench.probes import load_phases
    from djax.models import abstract_params

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")  # main sets it: restored after
    monkeypatch.setattr(load_phases, "CHILD_ENV", {})
    args = ["--tiny", "--weights", "fp8", "--phases", "steps", "--scratch", str(tmp_path)]
    load_phases.main(args)
    (path,) = (tmp_path / "out").glob("load_phases_*.json")
    [row] = json.loads(path.read_text())["results"]
    steps, load = row["steps"], row["seconds"]["steps"]
    assert {"check_orbax", "orbax restore", "scans", "restore_orbax"} <= set(steps)
    for span in steps.values():
        assert 0 <= span["first"] <= span["last"] <= load and span["calls"] >= 1
    whole, restore, scans = steps["restore_orbax"], steps["orbax restore"], steps["scans"]
    assert whole["first"] <= restore["first"] and restore["last"] <= scans["first"]
    assert scans["last"] <= whole["last"]
    leaves = jax.tree.leaves(abstract_params(model_config("dense", True), jnp.bfloat16, "fp8"))
    assert steps["wait for a scan program"]["calls"] == len(leaves)  # a program for every param
