"""`djax serve` end to end: the real engine serving the demo model, through the `openai`
client: right answers, the answers `djax.generate` gives each request alone."""

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import djax
from djax import demo
from djax.engine import GenerationConfig
from djax.serving import engine

PROBLEMS = {
    "347+2958=": "3305",
    "sort 3,9,1,4,1,7": "1,1,3,4,7,9",
    "reverse diffusion": "noisuffid",
}


@pytest.fixture(scope="module")
def client():
    from djax.serving.server import running_server

    model = djax.load(demo.default_model_path())
    config = engine.ServeConfig(  # few programs: 2 rows, sequences of 64 and 72, greedy
        generation=GenerationConfig(**demo.generation_defaults()),
        max_batch=2,
        max_seq_len=72,
        sampling=False,
    )
    with running_server(model, config, model_name="djax-demo") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, prompt, **kwargs):
    messages = [{"role": "user", "content": prompt}]
    return client.chat.completions.create(model="djax-demo", messages=messages, **kwargs)


def test_concurrent_chats_get_their_own_answers(client):
    with ThreadPoolExecutor(len(PROBLEMS)) as pool:
        outs = list(pool.map(lambda prompt: ask(client, prompt), PROBLEMS))
    for out, answer in zip(outs, PROBLEMS.values(), strict=True):
        assert (out.choices[0].message.content, out.choices[0].finish_reason) == (answer, "stop")
        assert out.usage.completion_tokens >= len(answer)


def test_stream_equals_whole_answer(client):
    chunks = list(ask(client, "347+2958=", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "3305"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_each_answer(client):
    """n=3 of one prompt run as three rows (2 at a time here): greedy, each is the answer."""
    out = ask(client, "sort 3,9,1,4,1,7", n=3)
    assert [(c.index, c.message.content, c.finish_reason) for c in out.choices] == [
        (i, "1,1,3,4,7,9", "stop") for i in range(3)
    ]
    assert out.usage.completion_tokens >= 3 * len("1,1,3,4,7,9")


def test_stop_string_and_length(client):
    assert ask(client, "347+2958=", stop=["0"]).choices[0].message.content == "33"
    out = ask(client, "reverse diffusion", max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == "noi"


def test_staggered_requests_equal_generate_alone(client):
    """Requests arriving while others run, with mixed max_tokens, on 2 rows: each answer is
    the one `djax.generate` gives that prompt alone (fp32, CPU)."""
    model = djax.load(demo.default_model_path())
    generation = GenerationConfig(**demo.generation_defaults())
    asks = [(prompt, n) for n in (8, 16, 24) for prompt in PROBLEMS]

    def staggered(i):
        time.sleep(0.03 * i)
        prompt, n = asks[i]
        return ask(client, prompt, max_tokens=n).choices[0].message.content

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(staggered, range(len(asks))))
    # generate's rows of a ragged batch equal the rows alone (test_engine): one call a length
    prompts = list(PROBLEMS)
    alone = {}
    for n in (8, 16, 24):
        config = dataclasses.replace(generation, gen_length=n)
        alone[n] = djax.generate(model, prompts, config, chat=True).texts
    for (prompt, n), text in zip(asks, got, strict=True):
        assert text == alone[n][prompts.index(prompt)], (prompt, n)
