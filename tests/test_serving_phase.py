"""The phase scheduler (`--scheduler phase`): a mixed forward equals the separate forwards
it replaces, the phase program decodes each block as a block call does, and the phase
engine gives every request the continuous engine's tokens (fp32, CPU); what it cannot
serve is refused by name."""

import dataclasses
import functools
import itertools
import re
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices
from serving_fakes import Collector

import djax
from djax import phase, programs
from djax.config import DENSE, LLADA2, MOE, ModelConfig
from djax.diffusion import run_block_call
from djax.engine import executable
from djax.kernel_options import KernelOptions
from djax.models.kernel_choice import Device, Shapes, resolve
from djax.models.layers import AttentionGroup, Window
from djax.serving import memory
from djax.serving import phase as phase_serving
from djax.serving.engine import ServeConfig, ServingEngine, make_engine
from djax.serving.metrics import ServerMetrics
from djax.serving.phase import PhaseEngine, _RowState
from djax.serving.requests import BlockCommitted, EngineRequest, Failed, Finished
from djax.sharding import make_mesh

# The tiny random dense model: its blocks take several steps (the demo model's take one).
GENERATION = djax.GenerationConfig(gen_length=16, block_length=8)
PROMPTS = [(0, 10, 20, 30, 40, 50), (0, 11, 12), (0, 7, 9, 11, 13), (0, 5), (0, 21, 22, 23)]


def _engine(model, scheduler, generation=GENERATION, **options):
    options = {"max_batch": 2, "max_seq_len": 32} | options
    config = ServeConfig(generation=generation, scheduler=scheduler, **options)
    engine = make_engine(model, config, ServerMetrics())
    engine.start()
    assert engine.wait_ready(300)
    return engine


@pytest.fixture(scope="module")
def phased(dense_model):
    # room for two refresh rows a call: a stream of 128 tokens (8 blocks a row)
    engine = _engine(dense_model, "phase", phase_tokens=2 * 8 + 128)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def continuous(dense_model):
    engine = _engine(dense_model, "continuous")
    yield engine
    engine.stop()


def _serve_all(engine, requests):
    """Submit every request at once (one admission sees them all, whatever the engine's
    thread is doing) and wait: each one's answer tokens and last event."""
    got = Collector()
    with engine._lock:
        for request in requests:
            engine.submit(request, got.sink(request.request_id))
    got.wait(len(requests))
    return [(got.tokens(r.request_id), got.events[r.request_id][-1]) for r in requests]


# ---------------------------------------------------------------- the mixed forward


@pytest.mark.parametrize("name", ["dense_model", "moe_model"])
def test_a_mixed_forward_equals_the_separate_forwards(name, request):
    """Two whole sequences (kv None) and two blocks stepping against their refreshed
    buffers, as one `forward_groups`: each group's hidden states and K/V are those of its
    own forward (`module.apply` as `djax.diffusion` calls it), experts included."""
    model = request.getfixturevalue(name)
    cfg = model.config
    seq, block = 12, 4
    kernels = model.kernel_choice(Shapes.whole_sequence(1, 2 * seq + 2 * block))
    module = programs.local_module(cfg, model.dtype, kernels, None)

    def apply(*args, **kwargs):
        return module.apply({"params": model.params}, *args, **kwargs)

    @jax.jit  # one program: op by op the forwards take seconds
    def forwards(tokens, positions, key_valid, step_tokens):
        whole, stepped = slice(0, 2), slice(2, 4)
        embedded, step_embedded = apply(tokens, method="embed"), apply(step_tokens, method="embed")
        _, buffers = apply(embedded[stepped], positions[stepped], key_valid[stepped])
        step_positions = positions[stepped, :block]
        alone = apply(embedded[whole], positions[whole], key_valid[whole])
        step = apply(
            step_embedded,
            step_positions,
            key_valid[stepped],
            buffers,
            Window(start=0),
            block_forward=True,
        )
        x = jnp.concatenate(
            [embedded[whole].reshape(1, 2 * seq, -1), step_embedded.reshape(1, 2 * block, -1)],
            axis=1,
        )
        groups = (
            AttentionGroup(positions[whole], key_valid[whole]),
            AttentionGroup(step_positions, key_valid[stepped], Window(start=0)),
        )
        kv = tuple((None, layer) for layer in buffers)
        return buffers, alone, step, apply(x, groups, kv, method="forward_groups")

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (4, seq)), jnp.int32)
    # the block first at its positions, then the rest (a phase slot's layout)
    order = np.concatenate([np.arange(seq - block, seq), np.arange(seq - block)])
    positions = jnp.asarray(np.stack([np.arange(seq)] * 2 + [order] * 2), jnp.int32)
    key_valid = np.ones((4, seq), bool)
    key_valid[1, -3:] = key_valid[3, -2:] = False
    step_tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, block)), jnp.int32)
    buffers, (hidden_a, kv_a), (hidden_b, kv_b), (hidden, mixed_kv) = forwards(
        tokens, positions, jnp.asarray(key_valid), step_tokens
    )

    close = dict(rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(hidden[0, : 2 * seq], hidden_a.reshape(2 * seq, -1), **close)
    np.testing.assert_allclose(hidden[0, 2 * seq :], hidden_b.reshape(2 * block, -1), **close)
    assert len(mixed_kv) == cfg.n_layers
    for layer, (a, b) in enumerate(zip(kv_a, kv_b, strict=True)):
        for got, want in zip(mixed_kv[layer], (a, b), strict=True):
            for got_part, want_part in zip(got, want, strict=True):  # keys, values
                np.testing.assert_allclose(got_part, want_part, **close)
    # the stepped rows' K/V moved at the block and stayed at the cached positions
    keys_b = mixed_kv[0][1][0]
    assert not np.allclose(keys_b[:, :block], buffers[0][0][:, :block])
    np.testing.assert_array_equal(keys_b[:, block:], buffers[0][0][:, block:])


def test_a_mixed_forward_refuses_rows_that_are_not_its_groups(dense_model):
    cfg = dense_model.config
    module = programs.local_module(
        cfg, dense_model.dtype, dense_model.kernel_choice(Shapes.whole_sequence(1, 8)), None
    )
    group = AttentionGroup(jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), bool))
    x = jnp.zeros((1, 9, cfg.d_model), jnp.float32)
    with pytest.raises(ValueError, match=re.escape("expected (1, 8, model)")):
        module.apply(
            {"params": dense_model.params},
            x,
            (group,),
            ((None,),) * cfg.n_layers,
            method="forward_groups",
        )


# ---------------------------------------------------------------- the phase program


def _row(engine, prompt, max_tokens, threshold=None, temperature=0.0, seed=0):
    """A host row of `engine` for `prompt`, as `submit` makes it."""
    request = EngineRequest(str(prompt), prompt, max_tokens, temperature, seed, threshold)
    row = engine._row(request, lambda event: None)
    if isinstance(engine, PhaseEngine):  # at its first block
        engine._states[id(row)] = _RowState()
    return row


def _block_call_blocks(model, continuous, rows, sampling):
    """Each row's next block from `continuous`'s block calls, two rows a call."""
    blocks = []
    plan = continuous._block_plan(2, 32, sampling)
    for pair in (rows[:2], rows[2:]):
        for slot, row in enumerate(pair):
            row.slot = slot
        args = continuous._block_args(pair, 2, 32)
        program, _ = executable(model, plan, args, run_block_call)
        blocks += list(np.asarray(program(*args)["block"]))
    return blocks


def test_block_calls_donate_no_tokens(dense_model, continuous, monkeypatch):
    """A block call's outputs hold no [batch, seq] buffer, so it donates nothing (a
    donated tokens buffer would go unused and XLA would warn at every compile, 42 times
    in a server's warm-up); a whole generation donates its tokens, which its output reuses."""
    from djax import engine as djax_engine
    from djax.diffusion import run_generation

    plan = continuous._block_plan(2, 32, False)
    args = continuous._block_args([], 2, 32)

    def donation_warnings():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            djax_engine.lower(dense_model, plan, args, run_block_call)
        return [w for w in caught if "donated buffers were not usable" in str(w.message)]

    assert programs.donated(run_block_call) == () and not donation_warnings()
    assert programs.donated(run_generation) == (1,)
    monkeypatch.setattr(programs, "donated", lambda run, mesh=None: (1,))  # as before: warned
    assert donation_warnings()


def _phase_blocks(model, engine, rows, sampling, streams, per_call=2):
    """Each row's next block from `engine`'s phase programs over a fresh pool of two
    slots: rows refresh as slots free, up to `per_call` a call (two: the first two
    together, in one stream), and every
    call's blocks are read before the next (no idle steps). A call steps the fewest leading
    slots that hold its stepping rows, as the engine does (slot 0 alone when only it steps).
    Returns the blocks, the first call's pool K/V and valid keys (two rows packed), how many
    refreshes ran beside a slot still stepping, and how many calls stepped fewer slots
    than the pool's."""
    mask_id = model.config.mask_token_id
    pool = engine._empty_pool()
    pending, owner, got, mixed, packed = list(range(len(rows))), {}, {}, 0, None
    fewer = 0
    while len(got) < len(rows):
        refresh = []
        for slot in [slot for slot in range(2) if slot not in owner][: len(pending)][:per_call]:
            i = pending.pop(0)
            rows[i].slot, owner[slot] = slot, i
            refresh.append(rows[i])
        mixed += bool(refresh) and len(owner) > len(refresh)
        tokens = sum(row.sequence for row in refresh)
        holds = [s for s in streams if s >= tokens and engine._refresh_rows(s) >= len(refresh)]
        stream = holds[0] if refresh else 0
        stepping = [slot for slot, i in owner.items() if rows[i] not in refresh]
        n = engine._stepping_slots(stepping)
        fewer += n < 2 and stepping == [0]  # slot 0 steps alone
        program = engine._programs[stream, n, sampling]
        plan = engine._plans[stream, n, sampling]
        arrays = engine._stream_arrays(plan, refresh, [row.slot for row in refresh])
        out = program(model.params, pool, arrays if stream else None)
        pool = out["pool"]
        if len(refresh) == 2:  # read before the next call takes the pool
            packed = [np.asarray(keys) for keys, _ in pool.kv], np.asarray(pool.key_valid)
        block = np.asarray(out["block"])
        for slot, i in list(owner.items()):
            if not (block[slot] == mask_id).any():
                got[i] = block[slot]
                del owner[slot]
    return [got[i] for i in range(len(rows))], packed, mixed, fewer


def test_the_phase_program_decodes_each_block_as_a_block_call(dense_model, phased, continuous):
    """Four rows through two slots: the first two refresh together (one stream), the
    others each into a slot as it frees while the other slot steps: every row's block is
    the one the continuous engine's block call decodes for it, and each packed row's K/V
    are those of its own refresh (it attended to itself alone)."""
    rows = [
        _row(phased, prompt, 16, threshold)
        for prompt, threshold in zip(PROMPTS[:4], (0.9, 0.5, 0.9, 0.7), strict=True)
    ]
    expected = _block_call_blocks(dense_model, continuous, rows, False)
    got, packed, mixed, fewer = _phase_blocks(dense_model, phased, rows, False, phased.streams)
    assert mixed >= 2 and fewer >= 1  # refreshes beside a slot still stepping; slot 0 alone
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")

    assert packed is not None  # two rows in one stream
    packed_kv, packed_valid = packed
    pool_len = phased.pool_len
    largest = phased._plans[phased.streams[-1], phased.steppings[-1], False]
    kernels = phase.phase_kernels(dense_model, largest)
    module = programs.local_module(dense_model.config, dense_model.dtype, kernels.products, None)
    refresh = jax.jit(
        lambda tokens, positions: module.apply(
            {"params": dense_model.params},
            module.apply({"params": dense_model.params}, tokens, method="embed"),
            positions,
            jnp.ones(tokens.shape, bool),
        )[1]
    )
    for slot, row in enumerate(rows[:2]):
        row.slot, laid = slot, phased._refresh(row, slot)
        alone = refresh(laid.tokens[None], laid.positions[None])
        length = len(laid.tokens)
        assert packed_valid[slot].tolist() == [True] * length + [False] * (pool_len - length)
        for keys, (want, _) in zip(packed_kv, alone, strict=True):
            np.testing.assert_allclose(keys[slot, :length], want[0], rtol=2e-5, atol=2e-5)
    for row in rows:  # the shared engine keeps no state of rows it never ran
        del phased._states[id(row)]


def test_slots_past_the_stepping_ones_keep_their_state(dense_model, phased):
    """Two rows refreshed into a two-slot pool, both mid-block: a steps-only call stepping
    one slot leaves slot 1 (masks left) as it was (block, keys, step count, K/V) and gives
    slot 0 what a call stepping both gives it."""
    rows = [_row(phased, prompt, 16, 0.9) for prompt in PROMPTS[:2]]
    for slot, row in enumerate(rows):
        row.slot = slot
    stream = phased.streams[-1]
    refresh = phased._programs[stream, 2, False]
    arrays = phased._stream_arrays(phased._plans[stream, 2, False], rows, [0, 1])
    pool = refresh(dense_model.params, phased._empty_pool(), arrays)["pool"]
    mask_id = dense_model.config.mask_token_id
    assert (np.asarray(pool.rows.block) == mask_id).any(axis=1).all()  # both mid-block
    before = jax.tree.map(np.asarray, pool)
    copy = lambda tree: jax.tree.map(jnp.array, tree)  # noqa: E731  (each call donates its pool)
    one = jax.tree.map(
        np.asarray, phased._programs[0, 1, False](dense_model.params, copy(pool), None)["pool"]
    )
    both = jax.tree.map(
        np.asarray, phased._programs[0, 2, False](dense_model.params, pool, None)["pool"]
    )
    for name, field in zip(phase.Decoding._fields, one.rows, strict=True):
        np.testing.assert_array_equal(field[1], getattr(before.rows, name)[1], err_msg=name)
        np.testing.assert_array_equal(field[0], getattr(both.rows, name)[0], err_msg=name)
    assert one.rows.step_in_block[0] == before.rows.step_in_block[0] + 1
    for (keys, values), (keys_before, values_before), (keys_both, _) in zip(
        one.kv, before.kv, both.kv, strict=True
    ):
        np.testing.assert_array_equal(keys[1], keys_before[1])
        np.testing.assert_array_equal(values[1], values_before[1])
        np.testing.assert_allclose(keys[0], keys_both[0], rtol=1e-5, atol=1e-6)
    for row in rows:  # the shared engine keeps no state of rows it never ran
        del phased._states[id(row)]


def test_new_rows_take_the_lowest_free_slots_and_calls_step_the_fewest_that_hold_them(
    dense_model,
):
    """Admission gives waiting rows the lowest free slots; a call steps the smallest of
    `max_batch`, its half and its quarter that holds every decoding row's slot (never
    started: nothing compiles)."""
    config = ServeConfig(generation=GENERATION, scheduler="phase", max_batch=8, max_seq_len=32)
    engine = make_engine(dense_model, config, ServerMetrics())
    assert engine.steppings == (2, 4, 8)
    engine._free_slots = [7, 3, 5]
    for prompt in PROMPTS[:2]:
        engine._waiting.append(_row(engine, prompt, 16))
    with engine._lock:
        engine._admit()
    assert [row.slot for row in engine._running] == [3, 5] and engine._free_slots == [7]
    cases = {(): 2, (0,): 2, (1,): 2, (2,): 4, (0, 3): 4, (5,): 8, (7, 1): 8}
    for slots, want in cases.items():
        assert engine._stepping_slots(list(slots)) == want, slots


def test_a_fixed_steps_decoder_samples_each_block_as_a_block_call(dense_model):
    """low_confidence (a fixed schedule: 3 steps a block commit 3, 3 and 2 of its 8
    masks) at temperature 1.5, one row refreshing a call: the phase program's blocks are
    the block call's, each row drawing from its own keys."""
    generation = dataclasses.replace(GENERATION, decoder="low_confidence", steps=6)
    config = dict(generation=generation, max_batch=2, max_seq_len=32)
    continuous = make_engine(dense_model, ServeConfig(**config), ServerMetrics())
    continuous._carried = continuous._empty_table()
    engine = make_engine(dense_model, ServeConfig(scheduler="phase", **config), ServerMetrics())
    for shape in itertools.product((0, 64), engine.steppings, (True,)):
        plan = engine._plan(*shape)
        engine._plans[shape] = plan
        engine._programs[shape] = phase.phase_program(
            dense_model, plan, phase.phase_kernels(dense_model, plan)
        )
    rows = [
        _row(engine, prompt, 16, temperature=1.5, seed=i) for i, prompt in enumerate(PROMPTS[:4])
    ]
    expected = _block_call_blocks(dense_model, continuous, rows, True)
    got, _, mixed, fewer = _phase_blocks(dense_model, engine, rows, True, (64,), per_call=1)
    assert mixed >= 1 and fewer >= 1
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")


# ---------------------------------------------------------------- the engine


def _requests(temperature):
    """Five requests (three wait for a slot), answers of two and three blocks, mixed
    thresholds, each its own seed."""
    return [
        EngineRequest(
            f"r{i}",
            prompt,
            24 if len(prompt) <= 8 and i % 2 == 0 else 16,
            temperature,
            seed=i,
            threshold=0.5 if i % 3 == 1 else None,
            ignore_eos=True,
        )
        for i, prompt in enumerate(PROMPTS)
    ]


def test_phase_gives_the_continuous_engine_s_tokens(phased, continuous):
    """Every request gets the continuous engine's tokens, greedy and sampled (a row's
    keys advance on its own steps alone, as in a block call)."""
    answers = {}
    for temperature in (0.0, 1.5):
        requests = _requests(temperature)
        want = _serve_all(continuous, requests)
        got = _serve_all(phased, requests)
        assert [t for t, _ in got] == [t for t, _ in want], temperature
        assert [e for _, e in got] == [Finished("length", r.max_tokens) for r in requests]
        answers[temperature] = [t for t, _ in got]
    assert answers[0.0] != answers[1.5]  # the sampled tokens are drawn


def test_a_fixed_steps_decoder_refreshes_from_the_slot_and_gives_the_continuous_tokens(
    dense_model,
):
    """Under low_confidence a block ends after a known number of calls, so a row's next
    block is refreshed in the very next call, its last block and keys carried from its
    slot before the host has read them: every request still gets the continuous engine's
    tokens (greedy and sampled, stop tokens honoured), no call steps a finished block
    idly, a call whose only decoding row is in slot 0 steps that slot alone, and a row
    entering a block moves down to a free slot below its own, carrying its last block from
    the slot it leaves."""
    generation = dataclasses.replace(GENERATION, decoder="low_confidence", steps=6)
    requests = [
        dataclasses.replace(
            r, ignore_eos=i % 2 == 0, temperature=t, request_id=f"{r.request_id}{t}"
        )
        for t in (0.0, 1.5)
        for i, r in enumerate(_requests(t))
    ]
    answers, stepped, moves = {}, [], []

    def spy(shape, program):
        def call(*args):
            stepped.append(shape[1])
            return program(*args)

        return call

    for scheduler in ("continuous", "phase"):
        budget = {"phase_tokens": 2 * 8 + 128} if scheduler == "phase" else {}
        engine = _engine(dense_model, scheduler, generation, **budget)
        if scheduler == "phase":  # ready and idle: its programs are all compiled
            assert engine.steppings == (1, 2)
            engine._programs = {shape: spy(shape, p) for shape, p in engine._programs.items()}
            move_down = engine._move_down

            def moving(row, move_down=move_down):
                source = move_down(row)
                moves.append((source, row.slot))
                return source

            engine._move_down = moving
        try:
            answers[scheduler] = _serve_all(engine, requests)
            calls = engine._calls
        finally:
            engine.stop()
    assert answers["phase"] == answers["continuous"]
    # Blocks of 3 steps on two slots: read before refreshed, a block would take 4 calls
    # (its 3, then one idle while the host reads it); carried, 3 and a few at the ends.
    blocks = sum(
        n // 8 + 1 if end.reason == "stop" else -(-n // 8)
        for _, end in answers["phase"]
        if (n := end.completion_tokens) is not None
    )
    assert calls < 4 * blocks / 2
    assert set(stepped) == {1, 2}, stepped
    assert (1, 0) in moves, moves


def test_sampled_tokens_do_not_depend_on_a_slower_batch_mate(phased, continuous):
    """A sampled request alone and beside a mate whose blocks take more steps gets the
    same tokens, in either scheduler: a row's keys stay while its block holds no mask."""
    fast = EngineRequest("s", (0, 11, 12), 24, 1.5, seed=3, threshold=0.3, ignore_eos=True)
    slow = EngineRequest("m", (0, 7, 9, 11, 13), 24, 1.5, seed=5, threshold=0.999, ignore_eos=True)
    answers = [
        _serve_all(engine, requests)[0][0]
        for engine in (continuous, phased)
        for requests in ([fast], [fast, slow])
    ]
    assert answers[1:] == answers[:1] * 3


def test_filtered_samples_match_the_continuous_engine(phased, continuous):
    """Requests with top_k or top_p get the same tokens under phase as under continuous
    (whose tokens are generate's, `test_serving_engine`); the pool keeps each slot's
    filters."""
    requests = [
        EngineRequest("k", (0, 11, 12), 24, 1.5, 3, 0.5, True, top_k=3),
        EngineRequest("p", (0, 7, 9, 11), 24, 2.0, 5, 0.5, True, top_p=0.7),
        EngineRequest("u", (0, 13, 8), 16, 1.5, seed=8, threshold=0.5, ignore_eos=True),
    ]
    assert _serve_all(phased, requests) == _serve_all(continuous, requests)


def test_cancel_mid_generation_frees_the_slot(phased, continuous):
    """A request cancelled after its first block gets nothing more; the request waiting
    for its slot refreshes into it and, like its running mate, gets the continuous
    engine's tokens."""
    requests = _requests(0.0)[:3]
    want = _serve_all(continuous, requests[1:])
    got = Collector()

    def cancel_after_a_block(event):
        got.sink("r0")(event)
        if isinstance(event, BlockCommitted):
            phased.cancel("r0")

    phased.submit(requests[0], cancel_after_a_block)
    for request in requests[1:]:
        phased.submit(request, got.sink(request.request_id))
    got.wait(2)
    assert [got.tokens(r.request_id) for r in requests[1:]] == [t for t, _ in want]
    assert [type(e) for e in got.events["r0"]] == [BlockCommitted]
    assert phased.metrics.running_rows._value.get() == 0  # both ended: neither counts
    deadline = time.monotonic() + 10  # their slots free at the engine's next admission
    while sorted(phased._free_slots) != [0, 1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(phased._free_slots) == [0, 1]
    deadline = time.monotonic() + 10  # the engine forgets rows at its next admission
    while phased._states and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not phased._states  # nothing kept of the finished and cancelled rows


def test_a_call_failing_on_the_device_resets_the_pool(phased, continuous, monkeypatch):
    """A call that fails when its outputs are read fails the running rows (their K/V went
    with the pool), the pool starts anew, and the next requests get the continuous
    engine's tokens."""
    real = phase_serving.jax.device_get
    bad = _requests(0.0)[:2]
    reads = []

    def flaky(arrays):
        # the third read of a call running both rows fails (a read of an earlier test's
        # last call, with its own rows, may come first)
        if threading.current_thread() is phased._thread and len(reads) < 3:
            running = {id(row.request) for row in phased._running}
            if running == {id(request) for request in bad}:
                reads.append(running)
                if len(reads) == 3:
                    raise RuntimeError("injected device fault")
        return real(arrays)

    monkeypatch.setattr(phase_serving.jax, "device_get", flaky)
    got = _serve_all(phased, bad)
    assert len(reads) == 3  # the fault was injected
    assert all(isinstance(event, Failed) for _, event in got)
    assert any("injected device fault" in event.message for _, event in got)
    monkeypatch.undo()
    requests = _requests(0.0)[2:]
    want = _serve_all(continuous, requests)
    assert _serve_all(phased, requests) == want


def test_a_row_first_refreshed_behind_a_failed_call_starts_again(phased, continuous, monkeypatch):
    """A row whose first refresh was queued behind a call that fails when read had nothing
    read and holds the host's keys: it starts again on the new pool and gets the
    continuous engine's tokens, sampled ones included, while the row refreshed before the
    fault fails with it. The first read waits for the second request, so its refresh is
    queued behind the call whose read then fails."""
    real, read = phase_serving.jax.device_get, phased._read_phase
    early, late = _requests(1.5)[0], _requests(1.5)[1]
    reading, submitted = threading.Event(), threading.Event()
    faults, reads = [], []

    def reading_call(call):
        reads.append(call.index)
        return read(call)

    def late_state():
        rows = [r for r in phased._running if r.request is late]
        return phased._states.get(id(rows[0])) if rows else None

    def flaky(arrays):
        if threading.current_thread() is phased._thread and not faults:
            if not reading.is_set():
                reading.set()
                assert submitted.wait(60)
            elif (state := late_state()) is not None and state.since is not None:
                faults.append((state.since, reads[-1]))  # its first refresh's call
                raise RuntimeError("injected device fault")
        return real(arrays)

    monkeypatch.setattr(phase_serving.jax, "device_get", flaky)
    monkeypatch.setattr(phased, "_read_phase", reading_call)
    got = Collector()
    phased.submit(early, got.sink(early.request_id))
    assert reading.wait(60)
    phased.submit(late, got.sink(late.request_id))
    submitted.set()
    assert got.wait(2) == {early.request_id, late.request_id}
    monkeypatch.undo()
    ((first, failed),) = faults
    assert failed < first  # the failed call was read before the late row's first call
    assert isinstance(got.events[early.request_id][-1], Failed)
    assert "injected device fault" in got.events[early.request_id][-1].message
    assert isinstance(got.events[late.request_id][-1], Finished)
    ((want, _),) = _serve_all(continuous, [late])
    assert got.tokens(late.request_id) == want and len(want) == late.max_tokens


def test_a_call_failing_when_queued_fails_the_rows_it_carries(phased, continuous, monkeypatch):
    """A call that raises when queued may take the pool it was given with it (every later
    call would raise too): it fails its refreshing and stepping rows, the pool starts
    anew, and the next requests get the continuous engine's tokens."""
    calls = itertools.count()

    def broken(program):
        def run(*args):
            if next(calls) >= 3:
                raise RuntimeError("injected fault")
            return program(*args)

        return run

    for key, program in list(phased._programs.items()):
        monkeypatch.setitem(phased._programs, key, broken(program))
    got = _serve_all(phased, _requests(0.0)[:2])
    assert [type(event) for _, event in got] == [Failed, Failed]
    assert all("injected fault" in event.message for _, event in got)
    monkeypatch.undo()
    requests = _requests(0.0)[2:]
    want = _serve_all(continuous, requests)
    assert _serve_all(phased, requests) == want


def test_what_the_phase_scheduler_cannot_serve_is_refused_by_name(dense_model):
    def refused(model=dense_model, scheduler="phase", generation=GENERATION, **options):
        options = {"max_batch": 2, "max_seq_len": 32} | options
        config = ServeConfig(generation=generation, scheduler=scheduler, **options)
        return make_engine(model, config, ServerMetrics())

    with_ = functools.partial(dataclasses.replace, GENERATION)
    cases = [
        ({"generation": with_(decoder="credit")}, "decoder='credit' is not available"),
        ({"generation": with_(cache="none")}, "cache='none'; the phase scheduler keeps"),
        ({"generation": with_(attention_sparsity=0.5)}, "attention_sparsity=0.5 is not"),
        ({"generation": with_(refresh_every=2)}, "refresh_every=2 is not available"),
        ({"phase_tokens": 47}, "phase_tokens=47: every call's steps take 16 tokens"),
        ({"phase_tokens": 47}, "expected at least 48"),
        (
            {"phase_tokens": 48, "scheduler": "continuous"},
            "phase_tokens=48 applies to scheduler='phase'; got scheduler='continuous'",
        ),
        ({"phase_tokens": -1}, "phase_tokens=-1; expected an int ≥ 0"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            refused(**options)
    assert refused(phase_tokens=48).streams == (16, 32)  # the least it takes

    # a stand-in: the refusal reads the family alone (a LLaDA2 model costs a build)
    llada2 = dataclasses.replace(
        dense_model, config=dataclasses.replace(dense_model.config, family=LLADA2)
    )
    with pytest.raises(ValueError, match="llada2 decodes by block diffusion"):
        refused(llada2)


def _pool_bytes(model, slots, pool_len, block, kv_shards=1):
    """A pool's bytes on a device, counted by hand: K/V of every layer (this device's kv
    heads), valid keys, then per slot its block's positions and tokens, keys and six
    scalars (threshold, temperature, step, masks, top_k, top_p)."""
    cfg = model.config
    kv = 2 * cfg.n_layers * slots * pool_len * cfg.n_kv_heads // kv_shards * cfg.head_dim * 4
    return kv + slots * pool_len + slots * (2 * block * 4 + 2 * 4 + 6 * 4)


def test_a_pool_over_the_memory_budget_stops_the_warm_up_before_compiling(dense_model, caplog):
    """A budget a byte short of the pool (counted by hand): the engine never gets ready,
    the log names the pool, and nothing was compiled."""
    weights = memory.weight_bytes(dense_model.params)
    pool = _pool_bytes(dense_model, 2, 32, 8)
    assert phase.pool_bytes(dense_model, _host_pool(dense_model, 2, 32)) == pool
    config = ServeConfig(
        generation=GENERATION,
        scheduler="phase",
        max_batch=2,
        max_seq_len=32,
        memory_bytes=weights + pool - 1,
    )
    engine = make_engine(dense_model, config, ServerMetrics())
    engine.start()
    assert not engine.wait_ready(60)
    assert "the phase scheduler's pool (2 slots of 32 positions) takes 0.0 MiB" in caplog.text
    assert engine.metrics.compiles._value.get() == 0


def test_a_phase_call_over_the_memory_budget_stops_the_warm_up(dense_model, caplog):
    """The pool fits but no call does (each holds the pool and its step's activations):
    every program is compiled and measured, then the engine refuses to start."""
    weights = memory.weight_bytes(dense_model.params)
    config = ServeConfig(
        generation=GENERATION,
        scheduler="phase",
        max_batch=1,
        max_seq_len=16,
        sampling=False,
        memory_bytes=weights + _pool_bytes(dense_model, 1, 16, 8),
    )
    engine = make_engine(dense_model, config, ServerMetrics())
    assert engine.streams == (16, 32)
    engine.start()
    assert not engine.wait_ready(120)
    assert "the phase scheduler's largest call (" in caplog.text
    assert "with its pool of 1 slots of 16 positions" in caplog.text
    assert "exceeds the memory budget" in caplog.text
    assert engine.metrics.compiles._value.get() == 3


def test_a_donated_buffer_is_counted_once_in_a_call_s_bytes():
    """The phase call returns its pool in the donated pool's buffers: the call's bytes
    hold it once (arguments + outputs + temporaries, less what aliases)."""
    pool = jnp.zeros((256, 1024), jnp.float32)
    program = jax.jit(lambda pool, x: (pool + x, x * 2), donate_argnums=(0,))
    compiled = program.lower(pool, jnp.zeros((1024,), jnp.float32)).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == pool.nbytes
    nbytes = memory.analysed_call_bytes(compiled, 0)
    assert pool.nbytes + 2 * 4096 <= nbytes < pool.nbytes + 4 * 4096 + stats.temp_size_in_bytes


def _host_pool(model, slots, pool_len):
    return phase.empty_pool(model.config, slots, pool_len, 8, model.dtype)


@needs_devices
def test_a_mesh_with_data_parallel_rows_is_refused(dense_folder):
    mesh = make_mesh(tensor_parallel=2, data_parallel=2)
    split = djax.load(dense_folder[0], dtype=jnp.float32, mesh=mesh)
    config = ServeConfig(generation=GENERATION, scheduler="phase", max_batch=2, max_seq_len=32)
    with pytest.raises(ValueError, match="data_parallel=2: the phase scheduler runs its pool"):
        make_engine(split, config, ServerMetrics())


@needs_devices
def test_a_tensor_parallel_engine_gives_the_single_device_tokens_and_drains(dense_folder, phased):
    """The phase programs under shard_map on a 2-way model axis (the pool's K/V split by
    kv head) give the single device's tokens, greedy and sampled; stop(drain=True) right
    after submitting still finishes every request, the waiting ones too."""
    sharded = djax.load(dense_folder[0], dtype=jnp.float32, mesh=make_mesh(tensor_parallel=2))
    by_hand = _pool_bytes(sharded, 2, 32, 8, kv_shards=2)
    assert phase.pool_bytes(sharded, _host_pool(sharded, 2, 32)) == by_hand
    engine = _engine(sharded, "phase", phase_tokens=48)  # streams of 16 and 32: one row each
    requests = _requests(0.0)[:3] + _requests(1.5)[3:]
    want = _serve_all(phased, requests)
    got = Collector()
    for request in requests:
        engine.submit(request, got.sink(request.request_id))
    engine.stop(drain=True, timeout=60)
    assert not engine._thread.is_alive()
    assert [got.tokens(r.request_id) for r in requests] == [t for t, _ in want]
    assert [got.events[r.request_id][-1] for r in requests] == [e for _, e in want]


@needs_devices
def test_k_major_fp8_values_serve_under_tensor_parallel(tmp_path):
    """fp8 weights held K-major (`fp8_impl="mosaic"`) on a 2-way model axis: the phase
    program's `shard_map` takes each device's K-major shares (whole-row forwards: XLA's
    `scaled` products on them) and serves the tokens of the same weights in their own
    layout. Fixed-steps requests only: the two layouts' products sum in other orders (logits
    1e-7 apart), which can flip a threshold decoder's near tie between two positions."""
    from torch_reference import make_llada_dense

    # widths the fp8 kernels take, a device's share too
    make_llada_dense(tmp_path, d_model=256, n_heads=4, n_kv_heads=2, mlp_hidden=256, seed=5)
    mesh = make_mesh(tensor_parallel=2)
    scaled = djax.load(tmp_path, jnp.float32, mesh=mesh, weights="fp8", fp8_impl="scaled")
    mosaic = scaled.with_options(fp8_impl="mosaic")
    plan = phase.PhasePlan(
        slots=2, stepping=2, pool_len=32, stream=16, refresh_rows=1, block_len=8,
        steps_per_block=8,
        decoder=GENERATION.decoder_spec(), mask_id=mosaic.config.mask_token_id, sampling=False,
    )  # fmt: skip
    assert phase.phase_kernels(mosaic, plan).products.k_major
    requests = [r for r in _requests(0.0) if r.threshold is None]
    answers = []
    for model in (scaled, mosaic):
        engine = _engine(model, "phase", phase_tokens=48, sampling=False)  # greedy programs
        answers.append(_serve_all(engine, requests))
        engine.stop()
    assert answers[1] == answers[0]
    assert all(len(tokens) > 0 for tokens, _ in answers[0])


def test_the_serve_command_takes_the_phase_options(monkeypatch, capsys):
    from djax.cli import build_parser
    from djax.serving import cli

    served = []
    monkeypatch.setattr(
        "djax.serving.server.serve", lambda model, config, **kw: served.append(config)
    )
    argv = ["serve", "--scheduler", "phase", "--phase-tokens", "300", "--port", "0"]
    assert cli.run(build_parser().parse_args(argv)) == 0
    assert [(c.scheduler, c.phase_tokens) for c in served] == [("phase", 300)]
    argv[2] = "continuous"
    assert cli.run(build_parser().parse_args(argv)) == 2
    assert "phase_tokens=300 applies to scheduler='phase'" in capsys.readouterr().err


# LLaDA-8B's shape and LLaDA-MoE's (7B-A1B), one layer each.
LLADA_8B = ModelConfig(DENSE, 126464, 4096, 1, 32, 32, 128, 12288, 5e5, 1e-5, 4096, 1, 2, 3)
LLADA_MOE = ModelConfig(
    MOE, 157184, 2048, 1, 16, 16, 128, 8192, 5e4, 1e-6, 8192, 1, 2, 3, qk_norm=True,
    n_experts=64, experts_per_token=8, expert_hidden=1024, moe_layers=(True,),
)  # fmt: skip


@pytest.mark.parametrize("config", [LLADA_8B, LLADA_MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("slots, stepping, stream", [(4, 4, 0), (4, 2, 256), (32, 8, 1024)])
def test_the_phase_program_lowers_for_hopper(monkeypatch, config, slots, stepping, stream):
    """The whole phase call (the mixed forward with `auto`'s Hopper kernels for its rows,
    the decode, the pool's writes) at real shapes in bf16 lowers for CUDA, its Mosaic GPU
    kernels compiled rather than interpreted (no GPU needed to lower), also where fewer
    slots step than the pool holds (the attention kernel reads the pool's leading rows)."""
    from djax.kernels import tma_ring

    monkeypatch.setattr(tma_ring, "interpret_params", lambda interpret: None)
    plan = phase.PhasePlan(
        slots=slots,
        stepping=stepping,
        pool_len=512,
        stream=stream,
        refresh_rows=2 if stream else 0,
        block_len=32,
        steps_per_block=8,
        decoder=GENERATION.decoder_spec(),
        mask_id=2,
        sampling=True,
    )
    hopper = Device("gpu", (9, 0), 227 * 1024)
    shapes = Shapes.whole_sequence(1, stream + stepping * 32)
    products = resolve(KernelOptions(), hopper, config, jnp.bfloat16, shapes)
    steps = resolve(KernelOptions(), hopper, config, jnp.bfloat16, Shapes(stepping, 32, 512, 32))
    assert steps.block.layers.attention == "split_kv"
    # the stream's cuDNN attention lowers only where cuDNN is: XLA's here
    kernels = phase.PhaseKernels(products, steps.block.layers.attention, "xla")
    module = programs.local_module(config, jnp.bfloat16, products, None)
    spec = jax.ShapeDtypeStruct
    shape_of = functools.partial(jax.tree.map, lambda a: spec(a.shape, a.dtype))
    pool = phase.pool_shapes(config, slots, plan.pool_len, 32, jnp.bfloat16)
    stream_arrays = shape_of(phase.pack_stream(plan, [], 1)) if stream else None
    window = (spec((1, 8, config.d_model), jnp.bfloat16), spec((1, 8), jnp.int32))
    params = jax.eval_shape(
        lambda *a: module.init(jax.random.key(0), *a)["params"], *window, spec((1, 8), bool)
    )
    call = jax.jit(
        lambda params, pool, s: phase.run_phase_call(module, params, plan, kernels, pool, s)
    )
    lowered = call.trace(params, pool, stream_arrays).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("config", [LLADA_8B, LLADA_MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("stepping", [8, 2])
def test_a_stream_is_scattered_into_the_pool_in_place_on_gpu(config, stepping):
    """A call with refresh rows writes their K/V into the donated pool in place: the
    program XLA compiles for the GPU (`auto`'s kernels, abstract weights) copies no layer's
    pool keys or values, as it did while the scatters were unordered with the steps' reads;
    nor when 2 of the 8 slots step (their attention reads the pool's leading rows in place)."""
    from djax.model import Model
    from djax.models import init_params

    params = jax.eval_shape(lambda: init_params(config, jnp.bfloat16, seed=0))
    model = Model(config, params, None, jnp.bfloat16)
    plan = phase.PhasePlan(
        slots=8,
        stepping=stepping,
        pool_len=512,
        stream=512,
        refresh_rows=2,
        block_len=32,
        steps_per_block=8,
        decoder=GENERATION.decoder_spec(),
        mask_id=2,
    )
    program = phase.phase_program(model, plan, phase.phase_kernels(model, plan))
    shape_of = functools.partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype))
    pool = phase.pool_shapes(config, plan.slots, plan.pool_len, 32, jnp.bfloat16)
    stream = shape_of(phase.pack_stream(plan, [], 1))
    text = program.lower(params, pool, stream).compile().as_text()
    rows = pool.kv[0][0].shape[1:]
    shapes = [f"bf16[{','.join(map(str, (n, *rows)))}]" for n in {plan.slots, stepping}]
    copies = [
        line
        for line in text.splitlines()
        if any(shape in line for shape in shapes) and (" copy(" in line or " pad(" in line)
    ]
    assert "scatter" in text and not copies, copies[:2]


def test_the_scheduler_is_the_one_named_and_continuous_by_default(dense_model, moe_model):
    """No scheduler is picked for the user: `continuous` unless another is named (it answers
    sooner below saturation on both models, `phase` serves more at saturation: the README's
    serve figures); `phase_tokens` is refused for any other scheduler."""
    assert ServeConfig().scheduler == "continuous"
    for model in (dense_model, moe_model):
        engine = make_engine(model, ServeConfig(generation=GENERATION), ServerMetrics())
        assert type(engine) is ServingEngine and engine.config.scheduler == "continuous"
        config = ServeConfig(generation=GENERATION, scheduler="phase")
        engine = make_engine(model, config, ServerMetrics())
        assert isinstance(engine, PhaseEngine) and engine.config.scheduler == "phase"
    for scheduler in ("continuous", "static"):
        with pytest.raises(ValueError, match=r"phase_tokens=64 applies to scheduler='phase'; "
                           rf"got scheduler='{scheduler}'"):  # fmt: skip
            ServeConfig(generation=GENERATION, scheduler=scheduler, phase_tokens=64)
    with pytest.raises(ValueError, match=r"scheduler='auto'; expected one of \('continuous'"):
        ServeConfig(generation=GENERATION, scheduler="auto")
