"""The demo: its task (problems, splits, checking), the trainer's data layout, and the shipped
model end to end — it answers held-out problems, parallel decoding keeps that accuracy,
early stop ends generation after the answer's block, and batching changes no answer."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.demo import default_model_path, describe, generation_defaults, task
from djax.demo.evaluate import demo_config, score
from djax.demo.tokenizer import build_char_tokenizer

PROBLEMS = task.make_problems(64, "test", seed=2024)
SINGLE = 16  # problems also decoded one by one
# The reference path: whole-sequence forwards, one token per step.
LOW_CONFIDENCE = demo_config(decoder="low_confidence", steps=task.GEN_LENGTH, cache="none")
THRESHOLD = demo_config(decoder="threshold", threshold=0.9, cache="dual")


def test_problems_are_solved_and_split_disjointly():
    for split in task.SPLITS:
        problems = task.make_problems(500, split, seed=3)
        assert all(task.check(p, a) for p, a in problems)
        assert {task.split_of(p) for p, _ in problems} == {split}
        kinds = {p.split(" ")[0] if " " in p else "add" for p, _ in problems}
        assert kinds == set(task.TASKS)
        assert max(len(p) for p, _ in problems) <= task.MAX_PROMPT_CHARS
        assert max(len(a) for _, a in problems) <= task.MAX_ANSWER_CHARS < task.GEN_LENGTH
    assert task.make_problems(20, "test", seed=5) == task.make_problems(20, "test", seed=5)
    assert task.make_problems(20, "test", seed=5) != task.make_problems(20, "test", seed=6)


def test_solve_and_check():
    assert task.solve("347+2958=") == "3305"
    assert task.solve("sort 3,9,1,4") == "1,3,4,9"
    assert task.solve("sort q,b,x") == "b,q,x"
    assert task.solve("reverse abcde") == "edcba"
    assert task.check("9999+1=", "10000")
    assert not task.check("9999+1=", "10000 ")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: task.solve("what is 2+2?"), "not a demo problem"),
        (lambda: task.make_problems(4, "valid"), "split='valid'"),
        (lambda: task.make_problems(4, "test", tasks=("multiply",)), "tasks="),
    ],
)
def test_bad_requests_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_training_rows_match_the_chat_prompt():
    """The trainer's fixed-shape rows hold exactly the ids `generate(chat=True)` feeds."""
    pytest.importorskip("optax")
    from djax.demo import train

    tokenizer = build_char_tokenizer()
    layout = train.make_layout(tokenizer)
    train.check_layout(layout, tokenizer)
    rows = layout.encode(task.sample(np.random.default_rng(1), 32, "train"))
    answer = rows["tokens"][:, layout.prompt_len :]
    assert (np.sum(answer == tokenizer.convert_tokens_to_ids("<|eot_id|>"), axis=1) == 1).all()
    assert answer[:, -1].tolist() == [tokenizer.eos_token_id] * 32
    short = layout.encode(task.sample(np.random.default_rng(2), 4, "train", tasks=("add",)))
    assert short["tokens"].shape == (4, layout.prompt_len + task.GEN_LENGTH)


def test_trainer_writes_a_loadable_model(tmp_path):
    pytest.importorskip("optax")
    from djax.demo import train

    args = "--steps 2 --batch 8 --d-model 32 --layers 1 --heads 1 --mlp-hidden 64 --eval 0"
    train.main(["--out", str(tmp_path), *args.split()])
    model = djax.load(tmp_path, dtype=jnp.float32)
    tokenizer = build_char_tokenizer()
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert model.config.stop_token_ids == (tokenizer.eos_token_id, eot)
    assert model.config.mask_token_id == tokenizer.mask_token_id
    assert describe(tmp_path).startswith("djax demo model: tiny LLaDA")
    assert generation_defaults(tmp_path) == {
        "gen_length": task.GEN_LENGTH,
        "block_length": task.BLOCK_LENGTH,
    }


@pytest.fixture(scope="session")
def demo_model():
    """The packaged model: a missing one fails here (it ships with djax)."""
    return djax.load(default_model_path(), dtype=jnp.float32)


@pytest.fixture(scope="session")
def low_confidence(demo_model):
    return score(demo_model, PROBLEMS, LOW_CONFIDENCE, batch_size=len(PROBLEMS))


@pytest.fixture(scope="session")
def threshold(demo_model):
    return score(demo_model, PROBLEMS, THRESHOLD, batch_size=len(PROBLEMS))


@pytest.fixture(scope="session")
def threshold_single(demo_model):
    """Row by row: forwards per answer without a slower row's forwards charged."""
    return score(demo_model, PROBLEMS[:SINGLE], THRESHOLD, batch_size=1)


def test_low_confidence_answers_held_out_problems(low_confidence):
    result, _ = low_confidence
    assert result.accuracy >= 0.99


def test_threshold_decoding_is_as_accurate_with_parallel_commits(
    low_confidence, threshold, threshold_single
):
    assert threshold[0].accuracy >= low_confidence[0].accuracy - 0.01
    single, _ = threshold_single
    assert single.tokens_per_forward >= 2.0
    assert single.forwards_per_answer < low_confidence[0].forwards_per_answer


def test_early_stop_ends_after_the_answer_block(demo_model, threshold):
    result, texts = threshold
    no_stop = dataclasses.replace(THRESHOLD, early_stop=False)
    full, full_texts = score(demo_model, PROBLEMS, no_stop, batch_size=len(PROBLEMS))
    longest = max(len(answer) for _, answer in PROBLEMS)  # its end-of-turn is at this index
    assert result.blocks == longest // task.BLOCK_LENGTH + 1 < full.blocks
    assert full.blocks == task.GEN_LENGTH // task.BLOCK_LENGTH
    assert result.forwards < full.forwards
    assert texts == full_texts
    # A short answer ends in the first block: one block of one-token steps in all.
    out = djax.generate(demo_model, ["12+5="], LOW_CONFIDENCE, chat=True)
    assert out.texts == ["17"]
    assert (out.stats.blocks, out.stats.forwards) == (1, task.BLOCK_LENGTH)


def test_batch_and_single_agree(threshold, threshold_single):
    assert threshold_single[1] == threshold[1][:SINGLE]


# Every decoder, greedy and sampled, is test_engine's `test_chunked_logits_give_the_same_tokens`
# (tiny random model); here the trained model's confident logits, once greedy, once sampled.
@pytest.mark.parametrize("decoder, temperature", [("threshold", 0.0), ("low_confidence", 0.7)])
def test_chunked_logits_answer_as_the_whole_vocabulary(demo_model, decoder, temperature):
    """Logits made 48 ids at a time (3 chunks of the demo's 128) change no answer token, on
    8 held-out prompts. Low confidence commits 2 tokens a step here (half the reference
    path's whole-sequence forwards): chunking is per forward, so more steps add no case."""
    reference = dataclasses.replace(LOW_CONFIDENCE, steps=task.GEN_LENGTH // 2)
    config = dataclasses.replace(
        THRESHOLD if decoder == "threshold" else reference,
        temperature=temperature,
        early_stop=False,
    )
    prompts = [p for p, _ in PROBLEMS[:8]]
    whole, chunked = (
        djax.generate(demo_model, prompts, dataclasses.replace(config, logits_chunk=c), chat=True)
        for c in (0, 48)
    )
    np.testing.assert_array_equal(chunked.answer_ids, whole.answer_ids)


def test_the_package_requires_what_the_chat_path_imports():
    """`pip install -e .` alone runs the chat template (the demo's `djax generate`): jinja2,
    which transformers imports lazily and requires of no one, is a requirement of djax's own
    (the test extras' torch brought it along, hiding its absence)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    core = [Requirement(r) for r in requires("djax") or []]
    assert "jinja2" in {r.name.lower() for r in core if r.marker is None}  # not an extra's
