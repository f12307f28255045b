"""The compiled engine against the numpy reference of the spec, token for token, plus the
invariants of batching, early stop and stats, and the input errors."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax import GenerationConfig
from djax.engine import stalled_rows

from numpy_reference import RefLLaDA, reference_generate
from torch_reference import EOS_ID, EOT_ID, MASK_ID

PROMPTS = [[0, 10, 20, 30, 40, 50], [0, 11, 12], [0, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
BASE = GenerationConfig(
    gen_length=24,
    block_length=8,
    steps=12,
    threshold=0.5,
    factor=2.0,
    vicinity_before=3,
    vicinity_after=2,
    vicinity_warmup=2,
)


@pytest.fixture(scope="module")
def reference(dense_folder):
    return RefLLaDA(dense_folder[0])


def run_reference(reference, config, prompts=PROMPTS):
    return reference_generate(
        reference,
        prompts,
        gen_length=config.gen_length,
        block=config.block_length,
        decoder=config.decoder,
        cache=config.cache,
        mask_id=MASK_ID,
        eos_id=EOS_ID,
        stop_ids=(EOS_ID, EOT_ID),
        steps=config.steps,
        tau=config.threshold,
        low=config.low_threshold,
        factor=config.factor,
        refresh_every=config.refresh_every,
        before=config.vicinity_before,
        after=config.vicinity_after,
        warmup=config.vicinity_warmup,
        alpha=config.credit_alpha,
        gamma=config.credit_gamma,
        beta=config.credit_beta,
        smoothing=config.smoothing,
        early_stop=config.early_stop,
    )


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "vicinity"])
@pytest.mark.parametrize(
    "decoder", ["low_confidence", "threshold", "factor", "credit", "hierarchy"]
)
def test_matches_numpy_reference(dense_model, reference, cache, decoder):
    config = dataclasses.replace(BASE, cache=cache, decoder=decoder)
    out = djax.generate(dense_model, PROMPTS, config)
    answers, forwards, refreshes = run_reference(reference, config)
    np.testing.assert_array_equal(out.answer_ids, answers)
    assert (out.stats.forwards, out.stats.refreshes) == (forwards, refreshes)


@pytest.mark.parametrize(
    "changes",
    [
        {"smoothing": True, "cache": "dual"},
        {"smoothing": True, "cache": "none", "decoder": "credit"},
        {"refresh_every": 2, "cache": "prefix", "decoder": "low_confidence"},
        {"refresh_every": 3, "cache": "vicinity", "vicinity_warmup": 5},
        {"early_stop": False, "cache": "dual"},
    ],
)
def test_options_match_numpy_reference(dense_model, reference, changes):
    config = dataclasses.replace(BASE, **changes)
    out = djax.generate(dense_model, PROMPTS, config)
    answers, forwards, refreshes = run_reference(reference, config)
    np.testing.assert_array_equal(out.answer_ids, answers)
    assert (out.stats.forwards, out.stats.refreshes) == (forwards, refreshes)


@pytest.mark.parametrize("decoder", ["threshold", "low_confidence"])
def test_dual_refreshing_every_step_is_no_cache(dense_model, decoder):
    none = djax.generate(
        dense_model, PROMPTS, dataclasses.replace(BASE, decoder=decoder, cache="none")
    )
    dual = djax.generate(
        dense_model,
        PROMPTS,
        dataclasses.replace(BASE, decoder=decoder, cache="dual", refresh_every=1),
    )
    np.testing.assert_array_equal(dual.answer_ids, none.answer_ids)
    assert dual.stats.forwards == dual.stats.refreshes == none.stats.forwards


@pytest.mark.parametrize("cache", ["none", "dual", "vicinity"])
def test_ragged_batch_rows_match_rows_alone(dense_model, cache):
    config = dataclasses.replace(BASE, cache=cache, vicinity_warmup=0)
    batch = djax.generate(dense_model, PROMPTS, config)
    for i, prompt in enumerate(PROMPTS):
        alone = djax.generate(dense_model, [prompt], config)
        np.testing.assert_array_equal(batch.answer_ids[i], alone.answer_ids[0])


@pytest.mark.parametrize("decoder", ["threshold", "factor"])
def test_smoothed_batch_rows_match_rows_alone(dense_model, decoder):
    """Iteration smoothing's weight and annealed threshold follow each row's own steps: a
    row whose batch-mates take more steps in a block gets the tokens it gets alone."""
    config = dataclasses.replace(BASE, smoothing=True, decoder=decoder, cache="dual")
    batch = djax.generate(dense_model, PROMPTS, config)
    for i, prompt in enumerate(PROMPTS):
        alone = djax.generate(dense_model, [prompt], config)
        np.testing.assert_array_equal(batch.answer_ids[i], alone.answer_ids[0])


def test_top_k_and_top_p_limit_the_samples(dense_model):
    """top_k 1 and a tiny top_p sample the greedy answer at any temperature; looser ones
    sample otherwise than the unfiltered draw of the same seed, and deterministically."""
    greedy = djax.generate(dense_model, PROMPTS, BASE).answer_ids
    hot = dataclasses.replace(BASE, temperature=20.0, seed=3)
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}):
        out = djax.generate(dense_model, PROMPTS, dataclasses.replace(hot, **narrow))
        np.testing.assert_array_equal(out.answer_ids, greedy)
    free = djax.generate(dense_model, PROMPTS, hot).answer_ids
    assert not (free == greedy).all()
    for loose in ({"top_k": 3}, {"top_p": 0.5}):
        config = dataclasses.replace(hot, **loose)
        first = djax.generate(dense_model, PROMPTS, config).answer_ids
        np.testing.assert_array_equal(djax.generate(dense_model, PROMPTS, config).answer_ids, first)
        assert not (first == free).all() and not (first == greedy).all()


def test_early_stop_fills_eos_and_skips_blocks(dense_model):
    # Stopping on a token the model emits in its first block shows the mechanism without a
    # trained model: the row ends there, the rest is EOS, no later block runs.
    free = djax.generate(dense_model, PROMPTS[:1], dataclasses.replace(BASE, early_stop=False))
    first_block = free.answer_ids[0, : BASE.block_length]
    stop = int(first_block[0])
    config = dataclasses.replace(BASE, stop_ids=(stop,))
    out = djax.generate(dense_model, PROMPTS[:1], config)
    np.testing.assert_array_equal(out.answer_ids[0, : BASE.block_length], first_block)
    assert np.all(out.answer_ids[0, BASE.block_length :] == EOS_ID)
    assert out.stats.blocks == 1 < free.stats.blocks == 3
    assert out.stats.forwards < free.stats.forwards
    assert out.token_ids[0] == [] and out.stats.generated_tokens == 0


def test_stats_add_up(dense_model):
    out = djax.generate(dense_model, PROMPTS, dataclasses.replace(BASE, early_stop=False))
    stats = out.stats
    assert stats.blocks == 3 and stats.refreshes == 3  # one refresh per block (dual)
    assert stats.generated_tokens == sum(len(t) for t in out.token_ids)
    assert stats.tokens_per_forward == pytest.approx(stats.generated_tokens / stats.forwards)
    assert stats.tokens_per_second == pytest.approx(stats.generated_tokens / stats.seconds)
    for row, ids in zip(out.answer_ids, out.token_ids, strict=True):
        assert list(row[: len(ids)]) == ids and not set(ids) & {EOS_ID, EOT_ID}
        assert len(ids) == len(row) or row[len(ids)] in (EOS_ID, EOT_ID)
    fixed = djax.generate(
        dense_model, PROMPTS, dataclasses.replace(BASE, decoder="low_confidence", early_stop=False)
    )
    assert fixed.stats.forwards == BASE.steps  # 4 steps per block, 2 tokens each


def test_random_decoder_is_seeded(dense_model):
    config = dataclasses.replace(BASE, decoder="random", early_stop=False)
    a = djax.generate(dense_model, PROMPTS, config)
    b = djax.generate(dense_model, PROMPTS, config)
    c = djax.generate(dense_model, PROMPTS, dataclasses.replace(config, seed=1))
    np.testing.assert_array_equal(a.answer_ids, b.answer_ids)
    assert a.stats.forwards == BASE.steps
    assert not np.array_equal(a.answer_ids, c.answer_ids)
    assert not np.any(a.answer_ids == MASK_ID)


def test_temperature_sampling(dense_model):
    config = dataclasses.replace(BASE, temperature=1.0, early_stop=False)
    a = djax.generate(dense_model, PROMPTS, config)
    b = djax.generate(dense_model, PROMPTS, dataclasses.replace(config, seed=3))
    greedy = djax.generate(dense_model, PROMPTS, dataclasses.replace(config, temperature=0.0))
    assert not np.array_equal(a.answer_ids, b.answer_ids)
    assert not np.array_equal(a.answer_ids, greedy.answer_ids)
    assert not np.any(a.answer_ids == MASK_ID)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize(
    "decoder, cache",
    [
        ("low_confidence", "none"),
        ("threshold", "dual"),
        ("factor", "prefix"),
        ("hierarchy", "vicinity"),
        ("random", "dual"),
    ],
)
def test_chunked_logits_give_the_same_tokens(dense_model, decoder, cache, temperature):
    """Logits made 24 ids at a time (6 chunks of the 128, the last overlapping) give every
    decoder's tokens of the whole vocabulary at once, greedy and sampled."""
    config = dataclasses.replace(
        BASE, decoder=decoder, cache=cache, temperature=temperature, early_stop=False
    )
    whole = djax.generate(dense_model, PROMPTS, dataclasses.replace(config, logits_chunk=0))
    chunked = djax.generate(dense_model, PROMPTS, dataclasses.replace(config, logits_chunk=24))
    np.testing.assert_array_equal(chunked.answer_ids, whole.answer_ids)
    assert chunked.stats.forwards == whole.stats.forwards


def test_chunked_logits_take_less_memory(dense_model):
    """A 32k vocabulary: the compiled generation's temporaries shrink by more than a whole
    block's logits with chunks of 1,024 ids, as no [batch, block, vocab] array is made."""
    from djax import engine
    from djax.models import init_params

    config = dataclasses.replace(dense_model.config, vocab_size=32_768)
    model = djax.Model(config, init_params(config, jnp.float32), None, jnp.float32)
    temp = {}
    for chunk in (0, 1024):
        options = dataclasses.replace(BASE, temperature=1.0, logits_chunk=chunk)
        plan, _ = engine.make_plan(model, options, len(PROMPTS), max(map(len, PROMPTS)))
        args = engine.program_args(model, plan, PROMPTS, options)
        compiled = engine.lower(model, plan, args).compile()
        temp[chunk] = compiled.memory_analysis().temp_size_in_bytes
    block_logits = len(PROMPTS) * BASE.block_length * config.vocab_size * 4
    assert temp[0] - temp[1024] > block_logits, temp


def test_string_prompts_and_chat(dense_model):
    plain = djax.generate(dense_model, ["12+34="], BASE)
    chat = djax.generate(dense_model, ["12+34="], BASE, chat=True)
    assert isinstance(plain.texts[0], str) and isinstance(chat.texts[0], str)
    ids = dense_model.tokenizer("12+34=")["input_ids"]
    np.testing.assert_array_equal(
        djax.generate(dense_model, [ids], BASE).answer_ids, plain.answer_ids
    )


def test_gen_length_rounded_up_and_reported(dense_model):
    out = djax.generate(dense_model, PROMPTS[:1], dataclasses.replace(BASE, gen_length=20))
    assert out.answer_ids.shape == (1, 24)
    assert out.notes == ["gen_length 20 is not a multiple of block_length 8; rounded up to 24"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"decoder": "greedy"}, "decoder='greedy'; expected one of"),
        ({"cache": "paged"}, "cache='paged'; expected one of"),
        ({"threshold": 0.0}, "threshold=0.0; expected a value in \\(0, 1\\]"),
        ({"threshold": 1.5}, "threshold=1.5; expected a value in \\(0, 1\\]"),
        ({"gen_length": 0}, "gen_length=0; expected a positive int"),
        ({"temperature": -1.0}, "temperature=-1.0; expected a finite number ≥ 0"),
        ({"refresh_every": -2}, "refresh_every=-2; expected an int ≥ 0"),
        ({"logits_chunk": -1}, "logits_chunk=-1; expected an int ≥ 0"),
    ],
)
def test_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **changes)


def test_request_errors(dense_model):
    with pytest.raises(ValueError, match="prompts is empty"):
        djax.generate(dense_model, [], BASE)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        djax.generate(dense_model, [[4, 5], []], BASE)
    with pytest.raises(ValueError, match=f"prompt 0 contains the mask id {MASK_ID} at position 1"):
        djax.generate(dense_model, [[4, MASK_ID]], BASE)
    with pytest.raises(ValueError, match="exceeds the model's maximum sequence length 512"):
        djax.generate(dense_model, [[4] * 500], BASE)
    with pytest.raises(ValueError, match="steps=10 must be a multiple of the number of blocks 3"):
        djax.generate(
            dense_model, PROMPTS, dataclasses.replace(BASE, decoder="low_confidence", steps=10)
        )
    with pytest.raises(TypeError, match="prompts must be a list"):
        djax.generate(dense_model, "just a string", BASE)
    with pytest.raises(ValueError, match="outside \\[0, 128\\)"):
        djax.generate(dense_model, [[4, 999]], BASE)


@pytest.mark.parametrize("decoder", ["threshold", "low_confidence"])
def test_non_finite_logits_stop_with_an_error(dense_model, decoder):
    # NaN logits give NaN confidences, which the threshold rules never commit, and the mask
    # id as the token, which a fixed-steps rule commits back: without the step bound the
    # denoising loop would never end.
    params = dict(dense_model.params, lm_head=jnp.full_like(dense_model.params["lm_head"], jnp.nan))
    broken = dataclasses.replace(dense_model, params=params)
    config = dataclasses.replace(BASE, decoder=decoder)
    with pytest.raises(RuntimeError, match="generation stalled: rows \\{0: 24, 1: 24\\}"):
        djax.generate(broken, PROMPTS[:2], config)


def test_stalled_rows():
    answers = np.array([[5, 6, 7], [5, MASK_ID, 200], [-1, 6, MASK_ID]])
    assert stalled_rows(answers, MASK_ID, vocab_size=128) == {1: 2, 2: 2}
    assert stalled_rows(answers[:1], MASK_ID, vocab_size=128) == {}
