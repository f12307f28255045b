"""The serving engine without HTTP: continuous batching gives each request exactly the
tokens `djax.generate` gives it alone (fp32, CPU), whatever arrives beside it; cancel,
queue bounds, bad requests and failing calls touch only the requests they concern."""

import dataclasses
import re
import threading
import time

import jax
import numpy as np
import pytest
from conftest import needs_devices
from prometheus_client.parser import text_string_to_metric_families
from serving_fakes import Collector

import djax
from djax import demo
from djax.serving import layout, memory
from djax.serving.engine import ServeConfig, make_engine
from djax.serving.metrics import ServerMetrics
from djax.serving.requests import (
    BlockCommitted,
    EngineRequest,
    EngineStopped,
    Failed,
    Finished,
    OverBudget,
    QueueFull,
)
from djax.sharding import make_mesh

PROMPTS = ["347+2958=", "sort 5,3,9", "reverse abcdef", "12+34=", "sort 9,8,7,6,5,4"]


@pytest.fixture(scope="module")
def demo_model():
    return djax.load(demo.default_model_path())


@pytest.fixture(scope="module")
def generation(demo_model):
    return djax.GenerationConfig(**demo.generation_defaults(demo_model.path))


def _engine(model, generation, **options):
    options = {"max_batch": 2, "max_seq_len": 64} | options
    config = ServeConfig(generation=generation, **options)
    engine = make_engine(model, config, ServerMetrics())
    engine.start()
    assert engine.wait_ready(300)
    return engine


@pytest.fixture(scope="module")
def continuous(demo_model, generation):
    engine = _engine(demo_model, generation)
    yield engine
    engine.stop()


def _ids(model, prompt):
    return tuple(djax.engine.tokenize(model, [prompt], chat=True)[0])


def _serve_all(engine, prompts, max_tokens):
    """Submit every prompt at once (`ignore_eos`) and wait: each one's answer tokens."""
    got = Collector()
    for i, ids in enumerate(prompts):
        engine.submit(EngineRequest(f"r{i}", ids, max_tokens, ignore_eos=True), got.sink(f"r{i}"))
    got.wait(len(prompts))
    return [got.tokens(f"r{i}") for i in range(len(prompts))]


def _alone(model, generation, ids, max_tokens, **changes):
    config = dataclasses.replace(generation, gen_length=max_tokens, **changes)
    return djax.generate(model, [list(ids)], config).token_ids[0][:max_tokens]


def test_staggered_requests_equal_generate_alone(demo_model, generation, continuous):
    """Five requests, mixed max_tokens, arriving while others run on 2 rows: each gets the
    tokens generate gives it alone, and a Finished with the right reason and count (a stop
    token counted as one of the answer's tokens)."""
    got = Collector()
    max_tokens = [24, 16, 24, 16, 24]
    rows = [_ids(demo_model, prompt) for prompt in PROMPTS]
    for i, ids in enumerate(rows):
        continuous.submit(EngineRequest(f"r{i}", ids, max_tokens[i]), got.sink(f"r{i}"))
        time.sleep(0.02)
    got.wait(len(PROMPTS))
    # generate's rows of a ragged batch equal the rows alone (test_engine)
    alone = {
        n: djax.generate(
            demo_model, [list(r) for r in rows], dataclasses.replace(generation, gen_length=n)
        ).token_ids
        for n in set(max_tokens)
    }
    for i, prompt in enumerate(PROMPTS):
        expected = alone[max_tokens[i]][i]
        assert got.tokens(f"r{i}") == expected, prompt
        end = got.events[f"r{i}"][-1]
        stopped = len(expected) < max_tokens[i]  # the stop token counts (vLLM's usage)
        assert end == Finished("stop" if stopped else "length", len(expected) + stopped)
    assert demo_model.tokenizer.decode(got.tokens("r0")) == "3305"


def test_length_cut_and_ignore_eos(demo_model, generation, continuous):
    """max_tokens below a block cuts inside it (reason length); ignore_eos keeps every
    answer position, stop tokens included."""
    got = Collector()
    ids = _ids(demo_model, "347+2958=")
    continuous.submit(EngineRequest("short", ids, 3), got.sink("short"))
    continuous.submit(EngineRequest("all", ids, 16, ignore_eos=True), got.sink("all"))
    got.wait(2)
    assert got.tokens("short") == _alone(demo_model, generation, ids, 8)[:3]
    assert got.events["short"][-1] == Finished("length", 3)
    full = djax.generate(
        demo_model, [list(ids)], dataclasses.replace(generation, gen_length=16, early_stop=False)
    )
    assert got.tokens("all") == full.answer_ids[0].tolist()
    assert got.events["all"][-1] == Finished("length", 16)


def test_chunked_logits_serve_generates_tokens(demo_model, generation):
    """A server whose block calls make their logits 48 ids at a time (3 chunks of the
    demo's 128) gives the tokens generate gives from the whole vocabulary at once, greedy
    and sampled. One row a call (2 programs to compile, not 4): rows beside each other are
    `test_sampled_tokens_follow_the_seed_alone`'s case."""
    engine = _engine(demo_model, dataclasses.replace(generation, logits_chunk=48), max_batch=1)
    try:
        got = Collector()
        requests = [("347+2958=", 0.0, 0), ("sort 5,3,9", 1.5, 7)]
        for i, (prompt, temperature, seed) in enumerate(requests):
            ids = _ids(demo_model, prompt)
            request = EngineRequest(f"c{i}", ids, 16, temperature, seed=seed)
            engine.submit(request, got.sink(f"c{i}"))
        got.wait(len(requests))
    finally:
        engine.stop()
    for i, (prompt, temperature, seed) in enumerate(requests):
        whole = _alone(
            demo_model,
            generation,
            _ids(demo_model, prompt),
            16,
            temperature=temperature,
            seed=seed,
            logits_chunk=0,
        )
        assert got.tokens(f"c{i}") == whole, prompt


def test_sampled_tokens_follow_the_seed_alone(demo_model, generation, continuous):
    """At temperature > 0 a request's tokens are those generate draws for row 0 of the same
    seed, whether it runs alone or beside another request."""
    ids = _ids(demo_model, "sort 8,2,7,1")
    expected = _alone(demo_model, generation, ids, 16, temperature=1.5, seed=11)
    for mates in (0, 1):
        got = Collector()
        for j in range(mates):
            continuous.submit(
                EngineRequest(f"m{j}", _ids(demo_model, "999+1="), 24, 2.0, seed=j),
                got.sink(f"m{j}"),
            )
        continuous.submit(EngineRequest("s", ids, 16, 1.5, seed=11), got.sink("s"))
        got.wait(1 + mates)
        assert got.tokens("s") == expected


def test_filtered_samples_follow_generate(demo_model, generation, continuous):
    """Requests with top_k or top_p (beside an unfiltered one in the same calls) get the
    tokens generate draws with the same filters and seed (at temperature 5 the demo model's
    filtered and unfiltered draws differ); top_k 1 at any temperature is the greedy
    answer."""
    cases = [(3, 1.0), (0, 0.6), (0, 1.0)]
    ids = _ids(demo_model, "999+1=")
    got = Collector()
    for i, (top_k, top_p) in enumerate(cases):
        request = EngineRequest(f"f{i}", ids, 16, 5.0, seed=3, top_k=top_k, top_p=top_p)
        continuous.submit(request, got.sink(f"f{i}"))
    got.wait(len(cases))
    answers = [got.tokens(f"f{i}") for i in range(len(cases))]
    for answer, (top_k, top_p) in zip(answers, cases, strict=True):
        filters = {"top_k": top_k, "top_p": top_p}
        assert answer == _alone(demo_model, generation, ids, 16, temperature=5.0, seed=3, **filters)
    assert answers[0] != answers[2] and answers[1] != answers[2]
    continuous.submit(EngineRequest("g", ids, 16, 20.0, seed=5, top_k=1), got.sink("g"))
    got.wait(1)
    assert got.tokens("g") == _alone(demo_model, generation, ids, 16)


def test_a_server_with_chunked_logits_refuses_filters(demo_model, generation):
    engine = _engine(demo_model, dataclasses.replace(generation, logits_chunk=48), max_batch=1)
    try:
        ids = _ids(demo_model, "12+34=")
        with pytest.raises(ValueError, match="computes a step's logits in chunks of 48 ids"):
            engine.submit(EngineRequest("x", ids, 8, 1.0, top_p=0.5), lambda event: None)
        engine.submit(EngineRequest("y", ids, 8, 0.0, top_p=0.5), lambda event: None)  # greedy
    finally:
        engine.stop()


def test_device_memory_gauges_follow_the_calls(demo_model, continuous, monkeypatch):
    """After a block call is read the engine sets the device memory gauges from the
    device's figures (the CPU reports none, so they are faked here)."""
    from djax.serving import memory

    monkeypatch.setattr(memory, "memory_in_use", lambda model: (123, 456))
    got = Collector()
    continuous.submit(EngineRequest("m", _ids(demo_model, "12+34="), 8), got.sink("m"))
    got.wait(1)
    exposed = continuous.metrics.exposition().decode()
    assert "djax_device_bytes_in_use 123.0" in exposed
    assert "djax_device_peak_bytes_in_use 456.0" in exposed


def test_cancel_frees_the_row(demo_model, continuous):
    """A cancelled request gets no more events; a queued one is dropped from the queue."""
    got = Collector()
    ids = _ids(demo_model, "sort 9,8,7,6,5,4")
    for name in ("a", "b", "c"):
        continuous.submit(EngineRequest(name, ids, 24, ignore_eos=True), got.sink(name))
    continuous.cancel("c")  # still queued: 2 rows
    continuous.cancel("a")
    assert got.wait(1) == {"b"}
    time.sleep(0.2)
    assert "c" not in got.events
    assert not any(isinstance(e, (Finished, Failed)) for e in got.events.get("a", []))


def test_a_finished_row_stops_counting_before_its_client_hears(demo_model, continuous):
    """The running-rows gauge drops when a row finishes or is cancelled, not at the next
    round: a client (or a scrape) that has the last event never sees its row running."""
    seen = []

    def on_event(event):
        if isinstance(event, Finished):
            seen.append(continuous.metrics.running_rows._value.get())
        got.sink("r0")(event)

    got = Collector()
    continuous.submit(EngineRequest("r0", _ids(demo_model, PROMPTS[0]), 16), on_event)
    got.wait(1)
    assert seen == [0]
    # a cancelled row stops counting at once too
    left = []

    def cancel_after_a_block(event):
        if not left:
            continuous.cancel("r1")
            left.append(continuous.metrics.running_rows._value.get())

    ids = _ids(demo_model, PROMPTS[1])
    continuous.submit(EngineRequest("r1", ids, 24, ignore_eos=True), cancel_after_a_block)
    deadline = time.monotonic() + 60
    while not left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left == [0]


def test_bad_requests_are_refused_by_name(demo_model, continuous):
    ids = _ids(demo_model, "12+34=")
    cases = [
        (EngineRequest("x", (), 8), "prompt is empty"),
        (EngineRequest("x", ids, 0), "max_tokens=0"),
        (EngineRequest("x", ids, 40), "exceeds the maximum sequence 64"),
        (EngineRequest("x", (*ids, 500), 8), "token id 500 outside [0, 128)"),
        (EngineRequest("x", (*ids, 2), 8), "mask id 2"),
        (EngineRequest("x", ids, 8, temperature=float("nan")), "temperature=nan"),
        (EngineRequest("x", ids, 8, threshold=1.5), "threshold=1.5"),
        (EngineRequest("x", ids, 8, top_k=-1), "top_k=-1; expected an int ≥ 0"),
        (EngineRequest("x", ids, 8, top_k=2**31), "top_k=2147483648; expected an int ≥ 0 b"),
        (EngineRequest("x", ids, 8, top_p=0.0), "top_p=0.0; expected a number in (0, 1]"),
        (EngineRequest("x", ids, 8, priority=True), "priority=True; expected an int"),
        (EngineRequest("x", ids, 8, priority=1.5), "priority=1.5; expected an int"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            continuous.submit(request, lambda event: None)


def test_queue_bound_and_answer_length(demo_model, generation):
    """Past max_queue requests waiting beyond the free batch rows, submit raises QueueFull
    with a retry hint: rows about to start do not count (an idle server with free rows
    refused a burst larger than its queue)."""
    config = ServeConfig(generation=generation, max_batch=1, max_queue=2, max_seq_len=64)
    engine = make_engine(demo_model, config, ServerMetrics())  # not started: nothing runs
    ids = _ids(demo_model, "12+34=")
    for name in "abc":  # one for the free row, two for the queue
        engine.submit(EngineRequest(name, ids, 8), lambda e: None)
    with pytest.raises(QueueFull) as full:
        engine.submit(EngineRequest("d", ids, 8), lambda e: None)
    assert full.value.retry_after >= 1
    engine.cancel("a")
    engine.submit(EngineRequest("d", ids, 8), lambda e: None)
    assert engine.answer_length(9, 5) == 16 and engine.answer_length(8, 5) == 8
    wide = ServeConfig(generation=generation, max_batch=4, max_queue=1, max_seq_len=64)
    engine = make_engine(demo_model, wide, ServerMetrics())
    for i in range(5):  # four free rows and a queue of one: a burst of five is taken
        engine.submit(EngineRequest(f"w{i}", ids, 8), lambda e: None)
    with pytest.raises(QueueFull):
        engine.submit(EngineRequest("w5", ids, 8), lambda e: None)


def test_a_failing_call_fails_its_rows_only(demo_model, generation, monkeypatch):
    engine = _engine(demo_model, generation, max_batch=1)
    ids = _ids(demo_model, "12+34=")
    real = engine._block_program
    calls = iter([True])

    def flaky(rows):
        if next(calls, False):
            raise RuntimeError("injected device fault")
        return real(rows)

    monkeypatch.setattr(engine, "_block_program", flaky)
    got = Collector()
    engine.submit(EngineRequest("bad", ids, 8), got.sink("bad"))
    engine.submit(EngineRequest("good", ids, 8), got.sink("good"))
    got.wait(2)
    assert isinstance(got.events["bad"][-1], Failed)
    assert "injected device fault" in got.events["bad"][-1].message
    assert got.events["good"][-1] == Finished("stop", 3)  # "46" and the stop token
    compiled = engine.metrics.compiles._value.get()
    engine.stop()
    assert compiled == 2  # the warm-up's programs (batch 1, seq 64, with and without sampling)


def test_a_device_fault_reruns_the_calls_queued_behind_it(demo_model, generation, monkeypatch):
    """A call queued behind one that fails on the device took its carried table, so its
    outputs are errors too (the fake raises for them, as a GPU's would): only the failed
    call's rows fail (after the blocks read before it); a request whose block was queued
    behind it runs that block again, on a carried table started anew, and gets the tokens
    generate gives it alone. The first read waits for the second request, so its first
    block rides in the call behind the one that fails (bad's second)."""
    engine = _engine(demo_model, generation, sampling=False)
    real = engine._fetch
    reading, submitted = threading.Event(), threading.Event()
    poisoned: set[int] = set()
    faults = []

    def good_row():
        rows = [r for c in engine._queued for r in c.rows if r.request.request_id == "good"]
        return rows[0] if rows else None

    def flaky(out):
        if not reading.is_set():
            reading.set()
            assert submitted.wait(60)
        if id(out) in poisoned:
            raise RuntimeError("poisoned by the failed call")
        row = good_row()  # queued behind this call and not in it (one block in flight)
        if not faults and row is not None and row.in_flight == 1:
            faults.append(len(row.committed))
            poisoned.update(id(c.out) for c in engine._queued)
            raise RuntimeError("injected device fault")
        return real(out)

    monkeypatch.setattr(engine, "_fetch", flaky)
    ids = _ids(demo_model, "347+2958=")
    got = Collector()
    engine.submit(EngineRequest("bad", ids, 32, ignore_eos=True), got.sink("bad"))
    assert reading.wait(60)
    engine.submit(EngineRequest("good", ids, 24), got.sink("good"))
    submitted.set()
    assert got.wait(2) == {"bad", "good"}
    engine.stop()
    assert faults == [0]  # good's first block rode behind the failed call
    assert len(got.tokens("bad")) == 8  # its first block, read before the fault
    assert "injected device fault" in got.events["bad"][-1].message
    assert isinstance(got.events["good"][-1], Finished)
    assert got.tokens("good") == _alone(demo_model, generation, ids, 24)


def test_the_next_call_is_queued_before_the_last_ends(demo_model, generation):
    """The device never waits for the host between block calls: each call is queued while
    the one before runs (its rows' last blocks carried on the device), so the host time
    the device waits is 0 for most calls. Eight requests of 4 blocks on 2 rows: 16 calls,
    on the programs the `continuous` engine compiled (batch 1 and 2, sequence 64)."""
    engine = _engine(demo_model, generation, sampling=False)
    ids = _ids(demo_model, "347+2958=")
    got = Collector()
    for i in range(8):
        engine.submit(EngineRequest(f"r{i}", ids, 32, ignore_eos=True), got.sink(f"r{i}"))
    got.wait(8)
    engine.stop()
    assert {len(got.tokens(f"r{i}")) for i in range(8)} == {32}
    samples = {
        (s.name, s.labels.get("le")): s.value for s in engine.metrics.host_gap.collect()[0].samples
    }
    observed = samples[("djax_host_seconds_between_calls_count", None)]
    waited_none = samples[("djax_host_seconds_between_calls_bucket", "1e-05")]
    assert observed >= 10 and waited_none >= observed / 2


def test_a_memory_budget_runs_fewer_rows_and_refuses_what_never_fits(
    demo_model, generation, continuous, monkeypatch
):
    """A budget of 1.25 rows' bytes at sequence 64 (the `continuous` engine measured them):
    warm-up compiles no bucket a smaller one over the budget rules out, every call runs one
    row, each request still gets generate's tokens, a request whose call would not fit
    alone is refused naming the sizes, and the gauges say the budget and the call's bytes."""
    one, two = (continuous.memory.calls[b, 64, False] for b in (1, 2))
    limit = one + (two - one) // 4
    weights = memory.weight_bytes(demo_model.params)
    engine = _engine(
        demo_model, generation, max_seq_len=128, sampling=False, memory_bytes=weights + limit
    )
    try:
        assert engine.memory.limit == limit
        assert engine.memory.fits(1, 64) and not engine.memory.fits(2, 64)
        assert not engine.memory.fits(1, 128) and (2, 128, False) not in engine.memory.calls
        ids = _ids(demo_model, "347+2958=")
        with pytest.raises(OverBudget, match=r"\(batch 1, sequence 128\) takes 1\.\d MiB"):
            engine.submit(EngineRequest("long", ids, 40), lambda event: None)
        calls = []
        real = engine._dispatch
        monkeypatch.setattr(engine, "_dispatch", lambda rows: calls.append(len(rows)) or real(rows))
        got = Collector()
        max_tokens = [24, 16, 24, 16, 24]
        rows = [_ids(demo_model, prompt) for prompt in PROMPTS]
        for i, ids in enumerate(rows):
            engine.submit(EngineRequest(f"r{i}", ids, max_tokens[i]), got.sink(f"r{i}"))
        got.wait(len(rows))
        exported = engine.metrics.exposition().decode()
    finally:
        engine.stop()
    assert calls and set(calls) == {1}
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(exported)
        for sample in family.samples
    }
    assert samples["djax_memory_budget_bytes"] == limit
    assert samples["djax_memory_call_bytes"] == one
    alone = {  # as test_staggered_requests_equal_generate_alone (its compiled programs)
        n: djax.generate(
            demo_model, [list(r) for r in rows], dataclasses.replace(generation, gen_length=n)
        ).token_ids
        for n in set(max_tokens)
    }
    for i in range(len(rows)):
        assert got.tokens(f"r{i}") == alone[max_tokens[i]][i], PROMPTS[i]


def test_a_budget_runs_a_long_and_a_short_row_as_two_calls(demo_model, generation, monkeypatch):
    """A budget that holds a call of one row of sequence 128 or of two of 64, not of two of
    128: a long request and a short one still run side by side, as two calls a round, and
    each gets the tokens generate gives it alone."""
    config = ServeConfig(generation=generation, max_batch=2, max_seq_len=128, sampling=False)
    probe = make_engine(demo_model, config, ServerMetrics())  # measures, never started
    two_long = probe.call_bytes(2, 128)
    limit = (max(probe.call_bytes(1, 128), probe.call_bytes(2, 64)) + two_long) // 2
    weights = memory.weight_bytes(demo_model.params)
    engine = _engine(
        demo_model, generation, max_seq_len=128, sampling=False, memory_bytes=weights + limit
    )
    rounds = []
    real = engine._groups
    monkeypatch.setattr(engine, "_groups", lambda rows: rounds.append(real(rows)) or rounds[-1])
    got = Collector()
    requests = {
        "long": (_ids(demo_model, PROMPTS[0]), 64),
        "short": (_ids(demo_model, PROMPTS[1]), 8),
    }
    try:
        assert engine.memory.fits(2, 64) and not engine.memory.fits(2, 128)
        with engine._lock:  # both queued before the engine's loop next looks at the queue
            for name, (ids, max_tokens) in requests.items():
                engine.submit(EngineRequest(name, ids, max_tokens), got.sink(name))
        got.wait(2)
    finally:
        engine.stop()
    shapes = [[[r.request.request_id for r in group] for group in groups] for groups in rounds]
    assert [["short"], ["long"]] in shapes
    for name, (ids, max_tokens) in requests.items():  # as test_rounds_of_two_calls_give_...
        assert got.tokens(name) == _alone(demo_model, generation, ids, max_tokens), name


def test_a_call_s_bytes_come_from_its_program_or_an_estimate(demo_model, continuous):
    """Arguments + outputs + temporaries less the weights; where the backend gives no
    analysis, the K/V buffers and the logits: 6 layers × (keys, values) × [1, 64, 5, 32]
    fp32, plus [1, 8, 128] fp32 logits (or one chunk of 48 ids of them)."""

    class Stats:
        argument_size_in_bytes, output_size_in_bytes, temp_size_in_bytes = 1000, 10, 200

    class Program:
        def __init__(self, stats):
            self.stats = stats

        def memory_analysis(self):
            return self.stats

    assert memory.analysed_call_bytes(Program(Stats()), weights=900) == 310
    assert memory.analysed_call_bytes(Program(None), weights=900) is None
    kv, logits = 2 * 6 * 64 * 5 * 32 * 4, 8 * 128 * 4
    assert memory.estimate_call_bytes(demo_model, 1, 64, 8, None) == kv + logits
    assert memory.estimate_call_bytes(demo_model, 2, 64, 8, 48) == 2 * kv + 2 * 8 * 48 * 4
    assert continuous._call_bytes(Program(None), 1, 64) == kv + logits
    # the real analysis counts the K/V among the call's temporaries
    assert continuous.memory.calls[1, 64, False] > kv
    assert continuous.memory.limit is None  # the CPU reports no memory: no budget


def test_the_serve_process_freezes_its_warm_heap(continuous):
    """`djax serve` freezes the objects alive once the engine is warm out of the cyclic
    collector (`server.freeze_when_ready`): a full collection then scans only what serving
    created."""
    import gc

    from djax.serving.server import freeze_when_ready

    try:
        freeze_when_ready(continuous)
        assert gc.get_freeze_count() > 100_000
    finally:
        gc.unfreeze()  # this test process goes on to other tests
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_waiting_requests_are_admitted_in_the_policy_s_order(demo_model, generation, policy):
    """Requests queued before the engine starts, on one row, run one at a time in the
    order they are admitted: under `priority` by priority, lower first, ties by arrival;
    under `fcfs` by arrival (every priority 0 there, as the API refuses others)."""
    config = ServeConfig(
        generation=generation,
        scheduling_policy=policy,
        max_batch=1,
        max_seq_len=64,
        sampling=False,
    )
    engine = make_engine(demo_model, config, ServerMetrics())
    ids = _ids(demo_model, "12+34=")
    arrivals = {"a": 0, "b": 5, "c": -1, "d": 5, "e": 0}
    ended, lock = [], threading.Lock()

    def sink(name):
        def on_event(event):
            if isinstance(event, Finished | Failed):
                with lock:
                    ended.append(name)

        return on_event

    for name, priority in arrivals.items():
        priority = priority if policy == "priority" else 0
        engine.submit(EngineRequest(name, ids, 8, ignore_eos=True, priority=priority), sink(name))
    engine.start()
    try:
        deadline = time.monotonic() + 300
        while len(ended) < len(arrivals) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.stop()
    expected = ["c", "a", "e", "b", "d"] if policy == "priority" else list(arrivals)
    assert ended == expected
    # Each choice's wait for its row is recorded once, as it gets the row.
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(engine.metrics.exposition().decode())
        for sample in family.samples
    }
    assert samples["djax_queue_seconds_count"] == len(arrivals)
    assert samples["djax_queue_seconds_sum"] > 0


def test_static_scheduler_runs_whole_batches(demo_model, generation):
    """Batches of different prompt lengths within one sequence bucket share one program
    (the prompt is left-padded to the bucket) and give `generate`'s tokens."""
    engine = _engine(demo_model, generation, scheduler="static", max_batch=4, max_seq_len=128)
    got = Collector()
    batches = [PROMPTS[:3], PROMPTS[2:]]  # three rows each: one batch bucket
    for b, prompts in enumerate(batches):
        for i, prompt in enumerate(prompts):
            engine.submit(
                EngineRequest(f"r{b}{i}", _ids(demo_model, prompt), 16), got.sink(f"r{b}{i}")
            )
        got.wait(len(prompts))
    engine.stop()
    assert engine.metrics.running_rows._value.get() == 0  # idle again after its batches
    lengths = {len(_ids(demo_model, p)) for p in PROMPTS}
    assert (
        max(lengths) <= 64
        and len({max(map(len, (_ids(demo_model, p) for p in b))) for b in batches}) == 2
    )
    assert engine.metrics.compiles._value.get() == 1
    for b, prompts in enumerate(batches):
        for i, prompt in enumerate(prompts):
            ids = _ids(demo_model, prompt)
            assert got.tokens(f"r{b}{i}") == _alone(demo_model, generation, ids, 16)


def test_static_batches_apply_each_rows_filters(demo_model, generation):
    """A static batch of filtered and unfiltered sampled rows (and a greedy one) gives each
    the tokens generate draws alone with its filters and seed."""
    engine = _engine(demo_model, generation, scheduler="static", max_batch=4)
    cases = [(3, 1.0, 5.0), (0, 0.6, 5.0), (0, 1.0, 5.0), (2, 0.5, 0.0)]
    ids = _ids(demo_model, "999+1=")
    got = Collector()
    try:
        for i, (top_k, top_p, t) in enumerate(cases):
            request = EngineRequest(f"s{i}", ids, 16, t, seed=3, top_k=top_k, top_p=top_p)
            engine.submit(request, got.sink(f"s{i}"))
        got.wait(len(cases))
    finally:
        engine.stop()
    answers = [got.tokens(f"s{i}") for i in range(len(cases))]
    for answer, (top_k, top_p, t) in zip(answers, cases, strict=True):
        changes = {"temperature": t, "seed": 3, "top_k": top_k, "top_p": top_p}
        assert answer == _alone(demo_model, generation, ids, 16, **changes)
    assert answers[0] != answers[2] and answers[1] != answers[2]


def test_static_batches_only_rows_whose_longest_prompt_and_answer_fit(demo_model, generation):
    """A long prompt with a short answer and a short prompt with a long answer each fit the
    longest sequence alone but not together: they run as two batches, each answered as
    `generate` alone, instead of one batch that fails both."""
    engine = _engine(demo_model, generation, scheduler="static", max_batch=2, max_seq_len=128)
    got = Collector()
    long_prompt = tuple(range(10, 110))  # 100 tokens: + 32 would pass 128
    short = _ids(demo_model, "12+34=")
    engine.submit(EngineRequest("long", long_prompt, 8), got.sink("long"))
    engine.submit(EngineRequest("short", short, 32), got.sink("short"))
    assert got.wait(2) == {"long", "short"}
    engine.stop()
    for name in ("long", "short"):
        assert isinstance(got.events[name][-1], Finished), got.events[name][-1]
    assert got.tokens("short") == _alone(demo_model, generation, short, 32)
    assert engine.metrics.compiles._value.get() == 2  # two batches of one row


def test_static_batches_share_one_answer_length(dense_model):
    """A bidirectional row's tokens depend on its answer's length (its masks attend to each
    other): a static batch holds rows of one answer length, unrounded, so a 3-block answer
    (alone or arriving beside a 1-block one, which runs as a batch of its own) and the
    1-block one each get `generate`'s tokens alone (a random model, unlike the demo's,
    whose tokens move with the length)."""
    generation = djax.GenerationConfig(gen_length=16, block_length=8)
    engine = _engine(dense_model, generation, scheduler="static", max_batch=2)
    got = Collector()
    short, long = (0, 10, 20, 30, 40, 50), (0, 11, 12)
    with engine._lock:  # one admission sees all three
        engine.submit(EngineRequest("a", short, 8, ignore_eos=True), got.sink("a"))
        engine.submit(EngineRequest("b", long, 24, ignore_eos=True), got.sink("b"))
        engine.submit(EngineRequest("c", short, 8, ignore_eos=True), got.sink("c"))
    got.wait(3)
    engine.stop()
    alone = {
        n: djax.generate(dense_model, [list(ids)], dataclasses.replace(generation, gen_length=n))
        for ids, n in ((short, 8), (long, 24))
    }
    assert got.tokens("a") == got.tokens("c") == alone[8].answer_ids[0].tolist()
    assert got.tokens("b") == alone[24].answer_ids[0].tolist()
    assert engine.metrics.compiles._value.get() == 2  # "a" with "c", then "b"


def test_a_static_engine_whose_requests_all_left_waits_on(demo_model, generation, caplog):
    """Requests cancelled while a static batch gathers leave it empty: the engine waits for
    the next ones (no call, no error) and serves them."""
    engine = _engine(demo_model, generation, scheduler="static", max_batch=2)
    ids = _ids(demo_model, PROMPTS[0])
    got = Collector()
    engine.submit(EngineRequest("gone", ids, 8), got.sink("gone"))
    time.sleep(0.01)  # the engine woke, and gathers arrivals for a batch
    engine.cancel("gone")
    time.sleep(0.6)  # past the arrival window
    engine.submit(EngineRequest("next", ids, 8), got.sink("next"))
    assert got.wait(1) == {"next"}
    engine.stop()
    assert "gone" not in got.events and not any(r.levelname == "ERROR" for r in caplog.records)


def test_no_event_follows_a_row_s_last(demo_model, generation):
    """`stop(drain=False)` from another thread while a consumer is slow with a block: each
    row still gets its events in order and nothing after its `Failed` (events are sent
    under the engine's lock, so the stop lands between two)."""
    engine = _engine(demo_model, generation)
    log, slow = [], threading.Event()

    def sink(name):
        def on_event(event):
            log.append((name, type(event).__name__))
            if name == "a" and isinstance(event, BlockCommitted) and not slow.is_set():
                slow.set()
                time.sleep(0.3)

        return on_event

    ids = _ids(demo_model, PROMPTS[0])
    with engine._lock:  # one admission sees both
        for name in "ab":
            engine.submit(EngineRequest(name, ids, 32, ignore_eos=True), sink(name))
    assert slow.wait(60)
    engine.stop(drain=False)
    time.sleep(0.3)
    for name in "ab":
        kinds = [kind for n, kind in log if n == name]
        assert kinds[-1] == "Failed" and kinds.count("Failed") == 1, (name, kinds)


def test_a_budget_the_weights_fill_is_refused(demo_model, generation):
    config = ServeConfig(generation=generation, memory_bytes=1000)
    with pytest.raises(ValueError, match="the weights take 8159360 bytes a device"):
        make_engine(demo_model, config, ServerMetrics())


def test_a_budget_no_call_fits_stops_the_warm_up(demo_model, generation, caplog):
    weights = memory.weight_bytes(demo_model.params)
    config = ServeConfig(
        generation=generation,
        max_batch=1,
        max_seq_len=64,
        sampling=False,
        memory_bytes=weights + 1000,
    )
    engine = make_engine(demo_model, config, ServerMetrics())
    engine.start()
    assert not engine.wait_ready(120)
    assert "holds no block call: the smallest (batch 1, sequence 64) takes 0.8 MiB" in caplog.text


def test_max_seq_len_beyond_the_model_is_refused(demo_model, generation):
    config = ServeConfig(generation=generation, max_seq_len=4096)
    with pytest.raises(
        ValueError, match="max_seq_len=4096 exceeds the model's maximum sequence 128"
    ):
        make_engine(demo_model, config, ServerMetrics())


def test_stop_without_drain_fails_waiting_requests(demo_model, generation):
    config = ServeConfig(generation=generation, max_batch=1, max_seq_len=64)
    engine = make_engine(demo_model, config, ServerMetrics())
    got = Collector()
    engine.submit(EngineRequest("a", _ids(demo_model, "12+34="), 8), got.sink("a"))
    engine.stop(drain=False)
    assert isinstance(got.events["a"][-1], Failed)
    with pytest.raises(EngineStopped):
        engine.submit(EngineRequest("b", _ids(demo_model, "12+34="), 8), got.sink("b"))


def test_layout_puts_the_block_first():
    lay = layout.RowLayout(block_length=4, mask_id=9, pad_id=0)
    arrays = lay.arrays(2, 16)
    lay.fill(arrays, 0, np.array([5, 6, 7], np.int32), later=4)
    np.testing.assert_array_equal(arrays["tokens"][0], [9] * 4 + [5, 6, 7] + [9] * 4 + [0] * 5)
    np.testing.assert_array_equal(
        arrays["positions"][0], [3, 4, 5, 6, 0, 1, 2, 7, 8, 9, 10] + [0] * 5
    )
    assert arrays["key_valid"][0].tolist() == [True] * 11 + [False] * 5
    assert arrays["key_valid"][1].tolist() == [True] * 4 + [False] * 12  # an empty slot
    assert not (arrays["tokens"][1] == 9).any()
    assert layout.batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert layout.batch_buckets(6, multiple=4) == (4, 8)
    assert layout.seq_buckets(1000, 32) == (64, 128, 256, 384, 512, 768, 1000)
    assert layout.bucket(300, (256, 384)) == 384
    with pytest.raises(ValueError, match="exceeds the largest bucket 384"):
        layout.bucket(385, (256, 384))


def test_serve_config_refuses_what_it_cannot_serve(generation):
    cases = [
        ({"scheduler": "fifo"}, "scheduler='fifo'"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy='lifo'; expected one of"),
        ({"max_batch": 0}, "max_batch=0"),
        ({"max_seq_len": 8}, "max_seq_len=8"),
        ({"generation": dataclasses.replace(generation, cache="prefix")}, "cache='prefix'"),
        ({"generation": dataclasses.replace(generation, smoothing=True)}, "smoothing"),
        (
            {"generation": dataclasses.replace(generation, temperature=1.0), "sampling": False},
            "needs sampling=True",
        ),
        ({"memory_fraction": 0}, r"memory_fraction=0; expected a number in \(0, 1\]"),
        ({"memory_fraction": 1.5}, "memory_fraction=1.5"),
        ({"memory_fraction": float("nan")}, "memory_fraction=nan"),
        ({"memory_fraction": "0.5"}, "memory_fraction='0.5'"),
        ({"memory_bytes": 0}, "memory_bytes=0; expected a positive int or None"),
        (
            {"generation": dataclasses.replace(generation, top_p=0.9, logits_chunk=48)},
            r"top_k=0, top_p=0.9 \(the requests' defaults\) need a step's whole logits",
        ),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            ServeConfig(**({"generation": generation} | options))


def test_short_and_long_rows_split_when_padding_costs_more(demo_model, generation):
    """Two short and two long rows: one call pads the short ones to the long bucket; two
    calls pay the weights twice. The engine takes the cheaper, by its cost model."""
    config = ServeConfig(generation=generation, max_batch=4, sampling=False)
    engine = make_engine(demo_model, config, ServerMetrics())
    short, long = _ids(demo_model, "12+34="), _ids(demo_model, "sort 9,8,7,6,5,4")
    rows = [
        engine._row(EngineRequest(str(i), ids, n), lambda e: None)
        for i, (ids, n) in enumerate([(long, 80), (short, 8), (long, 80), (short, 8)])
    ]
    assert [r.sequence for r in rows] == [len(long) + 80, len(short) + 8] * 2
    engine.call_cost = 0  # weights free: padding decides
    assert [sorted(r.request.request_id for r in g) for g in engine._groups(rows)] == [
        ["1", "3"],
        ["0", "2"],
    ]
    engine.call_cost = 10_000  # weights dear: one call
    assert len(engine._groups(rows)) == 1


def test_rounds_of_two_calls_give_generate_s_tokens(demo_model, generation, monkeypatch):
    """Short and long rows split into two calls a round, each round queued before the last
    is read: every request still gets the tokens generate gives it alone. Two rows (a long
    and a short one already split a round) keep the compiles to the sequence-128 ones."""
    engine = _engine(demo_model, generation, max_seq_len=128, sampling=False)
    engine.call_cost = 0  # weights free: a round splits whenever padding costs
    rounds = []
    real = engine._groups
    monkeypatch.setattr(engine, "_groups", lambda rows: rounds.append(real(rows)) or rounds[-1])
    max_tokens = [64, 8, 64, 8, 40]
    rows = [_ids(demo_model, prompt) for prompt in PROMPTS]
    got = Collector()
    with engine._lock:  # all queued before the engine's loop next looks at the queue
        for i, ids in enumerate(rows):
            engine.submit(EngineRequest(f"r{i}", ids, max_tokens[i]), got.sink(f"r{i}"))
    got.wait(len(rows))
    engine.stop()
    assert any(len(groups) == 2 for groups in rounds)
    for i, ids in enumerate(rows):
        assert got.tokens(f"r{i}") == _alone(demo_model, generation, ids, max_tokens[i]), i


def test_a_forward_weighs_more_tokens_for_a_sparse_model(demo_model):
    from bench.common import TINY
    from djax.config import from_hf_dict
    from djax.models import init_params
    from djax.serving.engine import RIDGE_FLOP_PER_BYTE, weight_read_tokens

    moe = from_hf_dict(TINY["moe"])
    model = djax.Model(moe, init_params(moe, np.float32), None, np.float32)
    assert weight_read_tokens(demo_model) == RIDGE_FLOP_PER_BYTE  # dense: every weight works
    assert weight_read_tokens(model) > RIDGE_FLOP_PER_BYTE  # 2 of 8 experts work per token


def test_static_batch_gathers_requests_arriving_together(demo_model, generation):
    """Requests sent 10 ms apart to an idle static engine start as one batch."""
    engine = _engine(demo_model, generation, scheduler="static", max_batch=4)
    got = Collector()
    ids = _ids(demo_model, "12+34=")
    for i in range(4):
        engine.submit(EngineRequest(f"r{i}", ids, 8), got.sink(f"r{i}"))
        time.sleep(0.01)
    got.wait(4)
    calls = engine._calls
    engine.stop()
    assert calls == 1


@needs_devices
def test_a_mesh_serves_the_same_tokens(dense_folder, dense_model):
    """Tensor parallel 2 × data parallel 2: the block calls run under shard_map with rows
    split over `data` (batch buckets rounded up to 2) and give the single device's tokens."""
    mesh = make_mesh(tensor_parallel=2, data_parallel=2)
    sharded = djax.load(dense_folder[0], dtype=np.float32, mesh=mesh)
    generation = djax.GenerationConfig(gen_length=16, block_length=8, steps=8)
    prompts = [(0, 10, 20, 30, 40, 50), (0, 11, 12), (0, 7, 9, 11, 13)]
    answers = []
    for model in (dense_model, sharded):
        engine = _engine(model, generation, max_batch=2, sampling=False)
        answers.append(_serve_all(engine, prompts, 16))
        engine.stop()
        assert all(len(a) == 16 for a in answers[-1])
    assert answers[0] == answers[1]
    assert layout.batch_buckets(2, multiple=2) == (2,)


def test_sparse_attention_serves_the_dense_tokens_where_every_real_key_is_kept(dense_model):
    """keep 0.5 with a recent window of 4 gives the 32-position calls 28 slots per head,
    and each row (at most 22 real keys) keeps all its own keys: the block calls run the
    sparse path (each refresh gathers the kept rows once) and must give the dense tokens."""
    prompts = [(0, 10, 20, 30, 40, 50), (0, 11, 12), (0, 7, 9, 11, 13)]
    answers = []
    for keep in (1.0, 0.5):
        generation = djax.GenerationConfig(
            gen_length=16, block_length=8, attention_sparsity=keep, attention_window=4
        )
        engine = _engine(dense_model, generation, max_batch=2, max_seq_len=32, sampling=False)
        plan = engine._block_plan(2, 32, False)
        assert (plan.sparse is None) == (keep == 1.0)
        answers.append(_serve_all(engine, prompts, 16))
        engine.stop()
        assert all(len(a) == 16 for a in answers[-1])
    assert answers[0] == answers[1]


def test_sparse_attention_keeps_a_row_s_tokens_beside_a_long_batch_mate(dense_model):
    """keep 0.1 with no window: a 3-token request alone runs in 64-position calls (15 slots
    per head), beside a 100-token request in 128-position ones (21 slots); each row keeps
    its own count of keys (the short one 10 of its 19), so its tokens are the same."""
    generation = djax.GenerationConfig(
        gen_length=16,
        block_length=8,
        decoder="low_confidence",
        attention_sparsity=0.1,
        attention_window=0,
    )
    engine = _engine(dense_model, generation, max_batch=2, max_seq_len=128, sampling=False)
    assert [engine._block_plan(2, n, False).sparse.keys for n in (64, 128)] == [15, 21]
    short, long = (0, 11, 12), (0, *(20 + i % 50 for i in range(99)))
    answers = []
    for requests in ([("s", short)], [("s", short), ("l", long)]):
        got = Collector()
        for name, ids in requests:
            engine.submit(EngineRequest(name, ids, 16, ignore_eos=True), got.sink(name))
        got.wait(len(requests))
        answers.append(got.tokens("s"))
    engine.stop()
    assert len(answers[0]) == 16 and answers[0] == answers[1]


def test_rows_are_compared_by_identity():
    """Admission and dispatch ask `row in ...` of queues every call: a row is itself, not a
    field-by-field value (two requests with the same fields are two rows), and the
    comparison reads no field."""
    from djax.serving.engine import _Row

    request = EngineRequest("same", (1, 2, 3), 8)
    rows = [_Row(request, print, 8, np.zeros(2, np.uint32), 0.9) for _ in range(2)]
    assert rows[0] == rows[0] and rows[0] != rows[1]
    assert rows[1] not in [rows[0]] and rows[1] in [rows[0], rows[1]]
    assert len({rows[0], rows[1]}) == 2  # hashable, by identity


@pytest.mark.parametrize("scheduler", ["continuous", "phase"])
def test_a_stop_during_warm_up_ends_the_engine_promptly(demo_model, scheduler):
    """SIGTERM or Ctrl-C while the engine compiles (`serve` calls `stop(drain=True)`): with
    nothing in flight the engine compiles no more programs and ends, never ready, where it
    went on through every program first (and the process with it)."""
    generation = djax.GenerationConfig(**demo.generation_defaults())
    config = ServeConfig(generation, scheduler=scheduler, max_batch=32, max_seq_len=64)
    engine = make_engine(demo_model, config, ServerMetrics())
    engine.start()
    time.sleep(1.0)
    assert not engine.ready  # still compiling
    engine.stop(drain=True, timeout=8)
    alive = engine._thread.is_alive()
    engine.join()
    assert not alive and not engine.ready and engine.failure is None


def test_a_started_engine_keeps_its_programs_in_the_compile_cache(
    demo_model, generation, tmp_path, monkeypatch
):
    """An engine turns on the persistent compile cache (`$DJAX_COMPILE_CACHE`), as
    `djax.generate` does: the programs it compiles are saved there, for the next start to
    read back."""
    monkeypatch.setenv("DJAX_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr(djax.engine, "_EXECUTABLES", {})  # nothing compiled in this process
    engine = _engine(demo_model, generation, scheduler="static", max_batch=1)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    got = Collector()
    request = EngineRequest("r", _ids(demo_model, PROMPTS[0]), 8, ignore_eos=True)
    engine.submit(request, got.sink("r"))
    got.wait(1)
    engine.stop()
    assert len(got.tokens("r")) == 8
    assert list((tmp_path / "programs").iterdir())  # the block program, saved
