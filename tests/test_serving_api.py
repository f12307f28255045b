"""The HTTP half of `djax serve` against a scripted FakeEngine: a real uvicorn server on
127.0.0.1, the official `openai` client, and httpx for the raw cases."""

import dataclasses
import json
import math
import time

import httpx
import openai
import pytest
from serving_fakes import FakeEngine, scripted

import djax
from djax import demo
from djax.engine import GenerationConfig, tokenize
from djax.serving import protocol as p
from djax.serving.api import create_app
from djax.serving.engine import ServeConfig
from djax.serving.metrics import ServerMetrics
from djax.serving.requests import BlockCommitted, Failed, Finished, OverBudget
from djax.serving.server import running_app

ANSWER = "The sum is 3305. Done!"  # 22 characters: blocks of 8, 8, 6
NAME = "djax-demo"


@pytest.fixture(scope="module")
def model():
    return djax.load(demo.default_model_path())


@pytest.fixture(scope="module")
def server(model):
    config = ServeConfig(GenerationConfig(gen_length=32, block_length=8, temperature=0.25))
    engine = FakeEngine(config, scripted(model.tokenizer, ANSWER))
    metrics = ServerMetrics()
    app = create_app(engine, model, model_name=NAME, metrics=metrics)
    with running_app(app, engine) as url:
        yield url, engine, app, metrics


@pytest.fixture
def engine(server, model):
    """The server's engine, reset to answer ANSWER at once."""
    engine = server[1]
    engine.script = scripted(model.tokenizer, ANSWER)
    engine.interval = 0.0
    engine.full = False
    engine.ready = True
    engine.release.set()
    engine.submitted.clear()
    engine.cancelled.clear()
    return engine


@pytest.fixture
def url(server, engine):
    return server[0]


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=10, **kwargs)


def sse_events(response):
    """The `data:` payloads of an event stream: JSON objects, then the string [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return events


def assert_error(response, status, param=None, code=None, mentions=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    kinds = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_error"}
    kinds[500] = "server_error"
    kinds[413] = "invalid_request_error"
    assert error["type"] == kinds[status]
    assert error["param"] == param
    assert error["code"] == code
    if mentions:
        assert mentions in error["message"]
    return error


# --- model list, health, metrics ------------------------------------------------------------


def test_models_lists_the_one_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].object == "model" and models[0].owned_by == "djax"


def test_tokenize_and_detokenize_as_the_endpoints_do(url, engine, model):
    """`/tokenize` gives the ids the completions endpoint makes of a prompt, or the chat
    endpoint of messages, with their count and the server's longest sequence;
    `/detokenize` gives the text back; bad bodies are 400s naming the field."""
    response = post(url, "/tokenize", {"prompt": "347+2958="})
    want = tokenize(model, ["347+2958="], chat=False)[0]
    assert response.json() == {"tokens": want, "count": len(want), "max_model_len": 128}
    chat = post(url, "/tokenize", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["tokens"] == tokenize(model, ["hi"], chat=True)[0]
    back = post(url, "/detokenize", {"tokens": want}).json()["prompt"]
    assert back == model.tokenizer.decode(want) and "347+2958=" in back
    assert_error(post(url, "/tokenize", {}), 400, mentions="exactly one of prompt and messages")
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    assert_error(post(url, "/tokenize", body), 400, mentions="exactly one")
    assert_error(post(url, "/detokenize", {"tokens": [1, 10**6]}), 400, param="tokens")
    assert_error(post(url, "/detokenize", {"tokens": "abc"}), 400, param="tokens")
    response = post(url, "/tokenize", {"model": "other", "prompt": "x"})
    assert_error(response, 404, param="model", code="model_not_found")
    empty = post(url, "/tokenize", {"prompt": ""})
    assert empty.status_code == 200 and empty.json()["tokens"] == []
    # ids past the tokenizer's but within the model's vocabulary: as a prompt may hold them
    assert len(model.tokenizer) < 120 < model.config.vocab_size
    assert post(url, "/detokenize", {"tokens": [120]}).status_code == 200
    response = post(url, "/detokenize", {"tokens": [128]})
    assert_error(response, 400, param="tokens", mentions="[0, 128)")


def test_one_model_card(url, client):
    assert client.models.retrieve(NAME).id == NAME
    response = httpx.get(url + f"/v1/models/{NAME}")
    assert response.json()["max_model_len"] == 128
    assert_error(httpx.get(url + "/v1/models/other"), 404, "model", "model_not_found")


def test_bodies_past_the_limit_are_413_unread(url, engine):
    """A body past `body_limit` (1 MiB for this 128-token server) is refused by its declared
    length, or once that much arrived when it declares none (chunked), before parsing."""
    limit = p.body_limit(128)
    assert limit == 2**20
    big = json.dumps({"prompt": "a" * limit}).encode()
    response = httpx.post(url + "/v1/completions", content=big, timeout=30)
    assert_error(response, 413, code="request_too_large", mentions=f"{len(big)} bytes")

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    response = httpx.post(url + "/v1/completions", content=chunks(), timeout=30)
    assert_error(response, 413, code="request_too_large", mentions=f"over {limit} bytes")
    assert engine.submitted == []
    assert post(url, "/v1/completions", {"prompt": "x", "stream": None}).status_code == 200


def test_a_default_answer_with_no_room_for_a_prompt_is_refused(model):
    """Every request without max_tokens would be refused: the server is, at start."""
    config = ServeConfig(GenerationConfig(gen_length=128, block_length=8))
    with pytest.raises(ValueError, match="gen_length=128 .* of 128 tokens; expected at most 120"):
        create_app(FakeEngine(config, None), model, model_name=NAME, metrics=ServerMetrics())


def test_a_greedy_server_names_temperature(url, engine):
    config = engine.config
    greedy = dataclasses.replace(config.generation, temperature=0.0)
    engine.config = dataclasses.replace(config, generation=greedy, sampling=False)
    try:
        response = post(url, "/v1/completions", {"prompt": "x", "temperature": 0.5})
    finally:
        engine.config = config
    assert_error(response, 400, param="temperature", mentions="greedily")


def test_a_threshold_is_refused_where_the_server_s_decoder_takes_none(url, engine):
    """A request's `threshold` steers the decoders that commit by τ; on a server of another
    decoder it was taken and did nothing: a 400 naming it."""
    config = engine.config
    fixed = dataclasses.replace(config.generation, decoder="low_confidence")
    engine.config = dataclasses.replace(config, generation=fixed)
    try:
        response = post(url, "/v1/completions", {"prompt": "x", "threshold": 0.01})
    finally:
        engine.config = config
    assert_error(response, 400, param="threshold", mentions="with 'low_confidence', which takes")
    assert engine.submitted == []


def test_health_follows_readiness_and_draining(url, engine, server):
    app = server[2]
    engine.ready = False
    try:
        assert httpx.get(url + "/health").status_code == 503
        warming = post(url, "/v1/completions", {"model": NAME, "prompt": "1+1="})
        assert_error(warming, 503)
        assert "warming up" in warming.json()["error"]["message"]
    finally:
        engine.ready = True
    assert httpx.get(url + "/health").status_code == 200
    app.state.draining = True
    try:
        assert httpx.get(url + "/health").status_code == 503
        response = post(url, "/v1/completions", {"model": NAME, "prompt": "1+1="})
        assert_error(response, 503)
    finally:
        app.state.draining = False


def test_metrics_exposition(url, client, server):
    registry = server[3].registry
    names = (
        "djax_time_to_first_chunk_seconds_count",
        "djax_request_latency_seconds_count",
        "djax_generated_tokens_total",
    )
    before = [registry.get_sample_value(n) or 0 for n in names]
    stops = registry.get_sample_value("djax_requests_total", {"reason": "stop"}) or 0
    list(client.completions.create(model=NAME, prompt="347+2958=", stream=True))
    client.completions.create(model=NAME, prompt="347+2958=")
    after = [registry.get_sample_value(n) for n in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2, 2 * len(ANSWER)]
    assert registry.get_sample_value("djax_requests_total", {"reason": "stop"}) == stops + 2
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    for name in (*names, "djax_aborted_requests_total", "djax_queue_depth", "djax_compiles"):
        assert name in response.text, name


def test_unknown_routes_get_openai_errors(url):
    response = httpx.get(url + "/v1/engines")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"
    response = httpx.get(url + "/v1/completions")
    assert response.status_code == 405 and "error" in response.json()


# --- whole answers --------------------------------------------------------------------------


def test_completion(client, engine, model):
    out = client.completions.create(model=NAME, prompt="347+2958=", seed=7)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == NAME and abs(out.created - time.time()) < 60
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, ANSWER, "stop")]
    prompt = tokenize(model, ["347+2958="], chat=False)[0]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(ANSWER))
    assert out.usage.total_tokens == len(prompt) + len(ANSWER)
    (request,) = engine.submitted
    assert request.request_id == out.id and list(request.prompt_ids) == prompt
    assert (request.max_tokens, request.temperature, request.seed) == (32, 0.25, 7)
    assert (request.threshold, request.ignore_eos) == (None, False)


def test_the_readme_completion_prompt_is_the_chat_templates_text(client, engine, model):
    """A completion takes its prompt as it is; the README's completions example for the
    demo model (which answers in its chat format) sends the text the chat template writes,
    so the engine gets the chat request's token ids."""
    from pathlib import Path

    turn = [{"role": "user", "content": "347+2958="}]
    text = model.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f'"prompt": {json.dumps(text)}' in readme
    client.completions.create(model=NAME, prompt=text, max_tokens=16)
    (request,) = engine.submitted
    assert list(request.prompt_ids) == tokenize(model, ["347+2958="], chat=True)[0]


def test_chat_completion_uses_the_chat_template(client, engine, model):
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "347+2958="}], max_tokens=16
    )
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert (choice.message.content, choice.finish_reason) == (ANSWER[:16], "length")
    (request,) = engine.submitted
    assert list(request.prompt_ids) == tokenize(model, ["347+2958="], chat=True)[0]
    assert out.usage.completion_tokens == 16 and request.max_tokens == 16


def test_chat_turns_text_parts_and_max_completion_tokens(url, engine, model):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}],
        },
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "again"},
    ]
    body = {"messages": messages, "max_tokens": 30, "max_completion_tokens": 9}
    response = post(url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "again"},
    ]
    text = model.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    (request,) = engine.submitted
    assert list(request.prompt_ids) == ids and request.max_tokens == 9


def test_prompt_token_ids_and_djax_extensions(url, engine):
    body = {"prompt": [[0, 62, 63]], "threshold": 0.5, "ignore_eos": True, "temperature": 0}
    body |= {"user": "someone", "top_p": 1.0, "presence_penalty": 0, "unknown_field": [1]}
    response = post(url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    (request,) = engine.submitted
    assert request.prompt_ids == (0, 62, 63)
    assert (request.threshold, request.ignore_eos, request.temperature) == (0.5, True, 0.0)
    assert 0 <= request.seed < 2**32
    assert response.json()["usage"]["prompt_tokens"] == 3


def test_n_choices_run_as_rows_of_their_own(client, engine, model):
    """n=3: three engine requests of one prompt, seeds seed, seed + 1, seed + 2 (wrapping at
    SEED_LIMIT), three choices by index; usage counts the prompt once and every answer."""
    out = client.completions.create(model=NAME, prompt="347+2958=", n=3, seed=2**32 - 2)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (i, ANSWER, "stop") for i in range(3)
    ]
    assert [r.request_id for r in engine.submitted] == [f"{out.id}-{i}" for i in range(3)]
    assert [r.seed for r in engine.submitted] == [2**32 - 2, 2**32 - 1, 0]
    assert len({r.prompt_ids for r in engine.submitted}) == 1
    prompt = len(engine.submitted[0].prompt_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt, 3 * len(ANSWER))
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8
    )
    assert [(c.index, c.message.content, c.finish_reason) for c in chat.choices] == [
        (0, ANSWER[:8], "length"),
        (1, ANSWER[:8], "length"),
    ]


def test_a_batch_of_prompts_gets_n_choices_each(url, engine, model):
    """Two prompts (text and ids), n=2: choices 0-1 answer the first, 2-3 the second, with
    seeds seed .. seed + 3; usage counts each prompt once."""
    body = {"prompt": ["347+2958=", [0, 62, 63]], "n": 2, "seed": 10, "max_tokens": 8}
    response = post(url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(i, ANSWER[:8]) for i in range(4)]
    first, second = tokenize(model, ["347+2958="], chat=False)[0], [0, 62, 63]
    want = [first, first, second, second]
    assert [list(r.prompt_ids) for r in engine.submitted] == want
    assert [r.seed for r in engine.submitted] == [10, 11, 12, 13]
    assert out["usage"] == {"prompt_tokens": len(first) + 3, "completion_tokens": 32,
                            "total_tokens": len(first) + 3 + 32}  # fmt: skip
    # a prompt of the batch too long for the server: 400 naming it
    response = post(url, "/v1/completions", {"prompt": ["x", [5] * 125], "max_tokens": 8})
    assert_error(response, 400, param="prompt.1", code="context_length_exceeded")


def test_more_choices_than_the_rows_and_queue_hold_are_400(url, engine, monkeypatch):
    config = dataclasses.replace(engine.config, max_batch=2, max_queue=2)
    monkeypatch.setattr(engine, "config", config)
    response = post(url, "/v1/completions", {"prompt": "x", "n": 5})
    mentions = "n=5 = 5 choices exceed this server's 2 rows and queue of 2"
    assert_error(response, 400, param="n", mentions=mentions)
    assert engine.submitted == []
    assert post(url, "/v1/completions", {"prompt": "x", "n": 4}).status_code == 200


def test_a_full_queue_takes_back_the_choices_it_admitted(url, engine, monkeypatch):
    """The queue refuses the third of 3 choices: 429, and the two admitted are cancelled."""
    submit = engine.submit

    def third_refused(request, on_event):
        if len(engine.submitted) == 2:
            engine.full = True
        submit(request, on_event)

    engine.release.clear()  # the admitted choices wait, so nothing answers before the 429
    monkeypatch.setattr(engine, "submit", third_refused)
    response = post(url, "/v1/completions", {"prompt": "x", "n": 3})
    assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
    assert engine.cancelled == [r.request_id for r in engine.submitted] and engine.cancelled


# --- streaming ------------------------------------------------------------------------------


def test_stream_sends_a_chunk_per_block_then_done(url, engine):
    body = {"model": NAME, "prompt": "347+2958=", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == [ANSWER[0:8], ANSWER[8:16], ANSWER[16:], ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c or c["usage"] is None for c in chunks)


def test_stream_include_usage_and_chat_chunks(client, engine):
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ANSWER
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ANSWER)
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(ANSWER)


def test_stream_of_n_choices_sends_each_by_index(client, engine, model):
    """n=2 streamed: every chunk names its choice; each choice's first chunk carries the
    role, its pieces make its answer, it ends with its own finish_reason; then the usage."""
    engine.interval = 0.01
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(ANSWER)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert all(choice.delta.role is None for choice in mine[1:])
        assert "".join(choice.delta.content or "" for choice in mine) == ANSWER
        assert [choice.finish_reason for choice in mine][-1] == "stop"
        assert all(choice.finish_reason is None for choice in mine[:-1])
    assert all(len(c.choices) == 1 for c in chunks[:-1])


@pytest.mark.parametrize("max_tokens", [5, 32])
def test_stream_equals_whole_answer(client, engine, max_tokens):
    whole = client.completions.create(model=NAME, prompt="x", max_tokens=max_tokens)
    stream = client.completions.create(model=NAME, prompt="x", max_tokens=max_tokens, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_block_that_makes_no_text_sends_no_chunk(url, engine, model):
    ids = model.tokenizer("ab", add_special_tokens=False)["input_ids"]
    events = [BlockCommitted(tuple(ids)), BlockCommitted(()), Finished("stop", 2)]
    engine.script = lambda request, block: events
    body = {"prompt": "x", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        chunks = sse_events(response)[:-1]
    assert [c["choices"][0]["text"] for c in chunks] == ["ab", ""]


# --- stop strings ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_answer_and_cancels(client, engine, stream):
    # "3305" spans blocks 1 and 2 ("The sum " | "is 3305." | ...): "is 33" is held back.
    out = client.completions.create(model=NAME, prompt="x", stop=["05.", "Z"], stream=stream)
    if stream:
        chunks = list(out)
        text = "".join(c.choices[0].text for c in chunks)
        assert [c.choices[0].text for c in chunks] == ["The sum ", "is 33", ""]
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert out.usage.completion_tokens == 16  # "The sum is 3305." ends the stop string
    assert (text, finish) == ("The sum is 33", "stop")
    assert engine.cancelled == [engine.submitted[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_the_answer_up_to_the_stop_string(client, engine, server, stream):
    """A stop string completed inside a block: usage and the tokens counter hold the tokens
    up to the one that completed it ("The sum": 7 of the block's 8), not the whole block."""
    registry = server[3].registry
    before = registry.get_sample_value("djax_generated_tokens_total") or 0
    usage_chunk = {"include_usage": True} if stream else None
    out = client.completions.create(
        model=NAME, prompt="x", stop="sum", stream=stream, stream_options=usage_chunk
    )
    if stream:
        chunks = list(out)
        text, usage = "".join(c.choices[0].text for c in chunks[:-1]), chunks[-1].usage
    else:
        text, usage = out.choices[0].text, out.usage
    assert (text, usage.completion_tokens) == ("The ", 7)
    assert registry.get_sample_value("djax_generated_tokens_total") - before == 7


def test_stop_string_held_back_then_released(client, engine):
    chunks = list(client.completions.create(model=NAME, prompt="x", stop="sum X", stream=True))
    # Block 1 ends "The sum ": the tail "sum " could start "sum X", so it waits for block 2.
    assert [c.choices[0].text for c in chunks] == ["The ", "sum is 3305.", " Done!", ""]
    assert chunks[-1].choices[0].finish_reason == "stop" and engine.cancelled == []


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param, mentions",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "greater"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
        ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature", "greater"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", "boolean"),
        ("/v1/completions", {"prompt": "x", "seed": 2**40}, "seed", "less"),
        ("/v1/completions", {"prompt": "x", "threshold": 1.5}, "threshold", "less"),
        ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
        ("/v1/completions", {"prompt": []}, "prompt", "empty"),
        ("/v1/completions", {"prompt": ["a"] * 65}, "prompt", "65 prompts; expected at most 64"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt", "empty"),
        ("/v1/completions", {"prompt": ["a", [5, 128]]}, "prompt.1", "token id 128"),
        ("/v1/completions", {"prompt": 5}, "prompt", "a list of those"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "expected"),
        ("/v1/completions", {}, "prompt", "required"),
        ("/v1/completions", {"prompt": "x", "stop": ["a"] * 5}, "stop", "at most 4"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "empty"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n=0; expected an integer from 1 to 16"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n", "n=17"),
        ("/v1/completions", {"prompt": "x", "n": 2.0}, "n", "n=2.0"),
        ("/v1/completions", {"prompt": "x", "n": True}, "n", "n=true"),
        ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs", "not supported"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "not supported"),
        (
            "/v1/completions",
            {"prompt": "x", "best_of": 1, "n": 2},
            "best_of",
            "best_of=1 is less than n=2",
        ),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo", "not supported"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ("/v1/completions", {"prompt": "x", "top_p": True}, "top_p", "valid number"),
        ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k", "greater than or equal to -1"),
        ("/v1/completions", {"prompt": "x", "top_k": 4.5}, "top_k", "valid integer"),
        ("/v1/completions", {"prompt": "x", "top_k": 2**31}, "top_k", "less than 2147483648"),
        ("/v1/completions", {"prompt": "x", "min_p": 0.1}, "min_p", "not supported"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 1}, "presence_penalty", "=1;"),
        (
            "/v1/completions",
            {"prompt": "x", "frequency_penalty": -0.5},
            "frequency_penalty",
            "-0.5",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "repetition_penalty": 1.2},
            "repetition_penalty",
            "1.2",
        ),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias", "no bias"),
        ("/v1/completions", {"prompt": [5, 128]}, "prompt", "token id 128"),
        ("/v1/completions", {"prompt": [5, -1]}, "prompt", "token id -1"),
        ("/v1/completions", {"prompt": [5, 2]}, "prompt", "mask id 2"),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages", "array"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages.0.role",
            "'user'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "text parts",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
            "not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
            "tool_choice",
            "not supported",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "free text",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
            "max_completion_tokens",
            "greater",
        ),
    ],
)
def test_bad_requests_are_400_naming_the_field(url, engine, path, body, param, mentions):
    assert_error(post(url, path, body), 400, param=param, mentions=mentions)
    assert engine.submitted == []


@pytest.mark.parametrize(
    "raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x", "temperature": NaN}']
)
def test_malformed_bodies_are_400(url, engine, raw):
    response = httpx.post(url + "/v1/completions", content=raw, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert engine.submitted == []


def test_the_openai_client_sees_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="logprobs is not supported"):
        client.completions.create(model=NAME, prompt="x", logprobs=2)
    with pytest.raises(openai.BadRequestError, match="min_p is not supported: min_p=0.5"):
        client.completions.create(model=NAME, prompt="x", extra_body={"min_p": 0.5})


def test_top_k_and_top_p_reach_the_engine(client, engine):
    """`top_p` and `top_k` (OpenAI's field, and the one other servers take, -1 meaning
    none) go to the engine as they are; left out, the server's defaults."""
    client.completions.create(model=NAME, prompt="x", top_p=0.9, extra_body={"top_k": 40})
    client.completions.create(model=NAME, prompt="x", extra_body={"top_k": -1})
    client.completions.create(model=NAME, prompt="x")
    got = [(r.top_k, r.top_p) for r in engine.submitted]
    assert got == [(40, pytest.approx(0.9)), (0, 1.0), (0, 1.0)]


def test_priority_reaches_a_priority_server_and_is_refused_elsewhere(client, url, engine):
    """vLLM's `priority`: under `--scheduling-policy priority` it reaches the engine as it is
    (left out or null, 0); a first-come server takes 0 and refuses another value with a 400
    that names it, submitting nothing; a value of the wrong type is refused by name."""
    response = post(url, "/v1/completions", {"prompt": "x", "priority": 3})
    assert_error(response, 400, param="priority", mentions="priority=3; this server admits")
    assert post(url, "/v1/completions", {"prompt": "x", "priority": 0}).status_code == 200
    assert_error(post(url, "/v1/completions", {"prompt": "x", "priority": "1"}), 400, "priority")
    assert_error(post(url, "/v1/completions", {"prompt": "x", "priority": 1.5}), 400, "priority")
    config = engine.config
    engine.config = dataclasses.replace(config, scheduling_policy="priority")
    try:
        client.completions.create(model=NAME, prompt="x", extra_body={"priority": -2})
        client.completions.create(model=NAME, prompt="x", extra_body={"priority": None})
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], extra_body={"priority": 7}
        )
    finally:
        engine.config = config
    assert [r.priority for r in engine.submitted] == [0, -2, 0, 7]


def test_a_server_with_chunked_logits_refuses_filters(url, engine):
    """Filters need a step's whole logits: a server computing them in chunks names the
    field (and serves greedy requests, where the filters change nothing)."""
    config = engine.config
    chunked = dataclasses.replace(config.generation, logits_chunk=48)
    engine.config = dataclasses.replace(config, generation=chunked)
    try:
        response = post(url, "/v1/completions", {"prompt": "x", "top_k": 5})
        assert_error(response, 400, param="top_k", mentions="--logits-chunk")
        response = post(url, "/v1/completions", {"prompt": "x", "top_p": 0.5})
        assert_error(response, 400, param="top_p", mentions="filters need them whole")
        greedy = {"prompt": "x", "top_p": 0.5, "temperature": 0}
        assert post(url, "/v1/completions", greedy).status_code == 200
    finally:
        engine.config = config


def test_neutral_sampling_controls_are_served(url, engine):
    """A client that sends the sampling controls at their neutral values (as many do by
    default) is served: they ask for nothing djax does not do."""
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0, "frequency_penalty": 0}
    neutral |= {"presence_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}}
    response = post(url, "/v1/completions", {"prompt": "x", **neutral})
    assert response.status_code == 200, response.text
    messages = [{"role": "user", "content": "x"}]
    chat = {"messages": messages, "response_format": {"type": "text"}, **neutral}
    assert post(url, "/v1/chat/completions", chat).status_code == 200
    assert len(engine.submitted) == 2


def test_context_length_exceeded(url, engine, client):
    # 120 prompt tokens + max_tokens 9 -> two blocks of 8 = 136 > 128.
    response = post(url, "/v1/completions", {"prompt": [5] * 120, "max_tokens": 9})
    error = assert_error(response, 400, param="prompt", code="context_length_exceeded")
    assert "136" in error["message"] and "128" in error["message"]
    assert post(url, "/v1/completions", {"prompt": [5] * 120, "max_tokens": 8}).status_code == 200
    response = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 10**30})
    assert_error(response, 400, param="prompt", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "y" * 200}]
        )
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"


def test_unknown_model_is_404(url, client):
    response = post(url, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert_error(response, 404, param="model", code="model_not_found", mentions="gpt-4")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_full_queue_is_429_with_retry_after(url, engine, client):
    engine.full = True
    response = post(url, "/v1/completions", {"prompt": "x"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == str(math.ceil(1.5))
    assert response.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=NAME, prompt="x")


def test_engine_value_error_is_400(url, engine):
    engine.max_sequence = 4096  # the fake refuses max_tokens > 1000 at submit
    try:
        response = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2000})
    finally:
        engine.max_sequence = 128
    assert_error(response, 400, mentions="max_tokens=2000")


def test_a_request_over_the_memory_budget_is_400(url, engine, monkeypatch):
    """The engine's refusal of a call that cannot fit even alone is a 400 with its code."""

    def over(request, on_event):
        raise OverBudget("its block call (batch 1, sequence 128) takes 1.6 MiB")

    monkeypatch.setattr(engine, "submit", over)
    response = post(url, "/v1/completions", {"prompt": "x"})
    assert_error(response, 400, code="memory_budget_exceeded", mentions="sequence 128")


# --- failures and disconnects ---------------------------------------------------------------


def test_failed_request_is_500_and_the_next_is_served(client, engine, model):
    engine.script = lambda request, block: [BlockCommitted((62,)), Failed("device lost")]
    with pytest.raises(openai.InternalServerError, match="device lost"):
        client.completions.create(model=NAME, prompt="x")
    engine.script = scripted(model.tokenizer, ANSWER)
    assert client.completions.create(model=NAME, prompt="x").choices[0].text == ANSWER
    assert engine.cancelled == []


def test_failed_stream_sends_an_error_chunk_then_done(url, engine):
    engine.script = lambda request, block: [BlockCommitted((62, 63)), Failed("device lost")]
    body = {"prompt": "x", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        events = sse_events(response)
    assert events[0]["choices"][0]["text"] == "34"
    assert events[1]["error"]["type"] == "server_error" and "device lost" in str(events[1])
    assert events[2:] == ["[DONE]"]


def test_an_error_of_the_server_s_own_fails_the_request_and_never_hangs(
    url, engine, model, monkeypatch
):
    """A choice whose handling raises (the tokenizer's decode of an id past its own
    vocabulary, as SentencePiece tokenizers raise) fails its request with a 500 naming the
    error, whole or streamed, and the engine is told to drop the row: the request is never
    left waiting."""
    decode = model.tokenizer.decode

    def strict_decode(ids, **kwargs):
        if 120 in list(ids):
            raise IndexError("piece id is out of range")
        return decode(ids, **kwargs)

    monkeypatch.setattr(model.tokenizer, "decode", strict_decode)
    engine.script = lambda request, block: [
        BlockCommitted((40, 41)),
        BlockCommitted((120,)),
        Finished("length", 3),
    ]
    response = post(url, "/v1/completions", {"prompt": "x"})
    assert_error(response, 500, mentions="IndexError: piece id is out of range")
    body = {"prompt": "x", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        events = sse_events(response)
    assert events[-2]["error"]["type"] == "server_error" and "IndexError" in str(events[-2])
    assert events[-1] == "[DONE]"
    assert engine.cancelled == [request.request_id for request in engine.submitted]


def test_a_failed_request_counts_every_choice_as_an_error(url, engine, server):
    """`djax_requests_total{reason="error"}` counts each of a failed request's `n` choices,
    none of them as aborted, whichever choice's failure the server read first."""
    metrics = server[3]
    errors, aborted = metrics.requests.labels("error")._value.get(), metrics.aborted._value.get()
    engine.script = lambda request, block: [Failed("device lost")]
    assert post(url, "/v1/completions", {"prompt": "x", "n": 3}).status_code == 500
    wait_for(lambda: metrics.requests.labels("error")._value.get() == errors + 3)
    assert metrics.aborted._value.get() == aborted


def wait_for(condition, seconds=3.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_disconnect_mid_stream_cancels(url, engine, server, model):
    metrics = server[3]
    aborted = metrics.aborted._value.get()
    engine.script = scripted(model.tokenizer, "x" * 64)
    engine.interval = 0.05
    body = {"prompt": "x", "stream": True, "max_tokens": 64}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    wait_for(lambda: engine.cancelled == [engine.submitted[0].request_id])
    assert metrics.aborted._value.get() == aborted + 1


def test_an_api_key_guards_the_v1_routes(model):
    """With `api_key`, a request without the key or with another is a 401 (the openai
    client's AuthenticationError) and reaches no engine; with it, it is served; /health
    and /metrics stay open. An empty key is refused."""
    config = ServeConfig(GenerationConfig(gen_length=32, block_length=8))
    engine = FakeEngine(config, scripted(model.tokenizer, ANSWER))
    app = create_app(engine, model, model_name=NAME, metrics=ServerMetrics(), api_key="s3cret")
    with running_app(app, engine) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = post(url, "/v1/completions", {"prompt": "x"}, headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
            assert (
                httpx.post(url + "/tokenize", json={"prompt": "x"}, headers=headers).status_code
                == 401
            )
        assert engine.submitted == []
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=10)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=NAME, prompt="x")
        right = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=10)
        assert right.completions.create(model=NAME, prompt="x").choices[0].text == ANSWER
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(ValueError, match="api_key is empty"):
        create_app(engine, model, model_name=NAME, metrics=ServerMetrics(), api_key="")


def test_disconnect_cancels_every_choice(url, engine, server, model):
    metrics = server[3]
    aborted = metrics.aborted._value.get()
    engine.script = scripted(model.tokenizer, "x" * 64)
    engine.interval = 0.05
    body = {"prompt": "x", "stream": True, "max_tokens": 64, "n": 3}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    wait_for(lambda: sorted(engine.cancelled) == sorted(r.request_id for r in engine.submitted))
    assert len(engine.cancelled) == 3
    wait_for(lambda: metrics.aborted._value.get() == aborted + 3)


def test_disconnect_while_queued_cancels(url, engine, server):
    metrics = server[3]
    aborted = metrics.aborted._value.get()
    engine.release.clear()  # requests wait in the queue
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=0.3)
    wait_for(lambda: len(engine.cancelled) == 1)
    assert engine.cancelled == [engine.submitted[0].request_id]
    assert metrics.aborted._value.get() == aborted + 1
    engine.release.set()


def test_a_long_prompt_without_max_tokens_gets_the_room_left(url, engine):
    """No max_tokens and a prompt too long for the server's default answer (32 positions
    of blocks of 8 against a maximum sequence of 128): the answer is capped at the whole
    blocks left (100 + 24 = 124), as OpenAI and vLLM cap it; a prompt leaving no room is
    refused naming the prompt, not max_tokens."""
    response = post(url, "/v1/completions", {"prompt": [5] * 100})
    assert response.status_code == 200, response.text
    assert [r.max_tokens for r in engine.submitted] == [24]
    response = post(url, "/v1/completions", {"prompt": [5] * 125})
    error = assert_error(response, 400, param="prompt", code="context_length_exceeded")
    assert "leaves no room" in error["message"] and "max_tokens" not in error["message"]


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "logprobs", 0),  # the sampled tokens' own log-probabilities
        ("/v1/completions", "stop_token_ids", [5]),
        ("/v1/completions", "min_tokens", 8),
        ("/v1/completions", "include_stop_str_in_output", True),
        ("/v1/completions", "guided_json", {"type": "object"}),
        ("/v1/completions", "skip_special_tokens", False),
        ("/v1/completions", "prompt_logprobs", 0),  # vLLM: each prompt token's own
        ("/v1/completions", "allowed_token_ids", [5]),
        ("/v1/completions", "bad_words", ["The"]),
        ("/v1/completions", "truncate_prompt_tokens", 1),
        ("/v1/completions", "add_special_tokens", False),
        ("/v1/completions", "regex", "[0-9]+"),  # SGLang's constrained decoding
        ("/v1/completions", "json_schema", '{"type": "object"}'),
        ("/v1/completions", "ebnf", 'root ::= "a"'),
        ("/v1/completions", "no_stop_trim", True),
        ("/v1/completions", "stop_regex", "[0-9]"),  # SGLang: stop on a regex match
        ("/v1/chat/completions", "stop_regex", ["\\d"]),
        ("/v1/completions", "logits_processors", ["my_module.MyProcessor"]),  # vLLM
        ("/v1/completions", "lora_path", "my-adapter"),  # SGLang: another adapter's answer
        ("/v1/completions", "custom_logit_processor", '{"callable": "x"}'),  # SGLang
        ("/v1/chat/completions", "continue_final_message", True),
        ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": True}),
        ("/v1/chat/completions", "add_special_tokens", True),
        ("/v1/chat/completions", "documents", [{"title": "t", "text": "d"}]),
    ],
)
def test_fields_that_would_change_the_answer_are_refused(url, engine, path, field, value):
    """OpenAI's `logprobs: 0` and vLLM's fields that change the answer are refused naming
    the field, where they were silently ignored; their neutral values are taken."""
    turn = {"role": "user", "content": "x"}
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [turn]}
    response = post(url, path, body | {field: value})
    assert_error(response, 400, param=field, mentions=field)
    neutral = {"stop_token_ids": [], "min_tokens": 0, "skip_special_tokens": True}
    neutral |= {"add_special_tokens": True, "bad_words": [], "no_stop_trim": False}
    assert post(url, "/v1/completions", {"prompt": "x"} | neutral).status_code == 200
    chat = {"messages": [turn], "add_special_tokens": False, "documents": []}
    assert post(url, "/v1/chat/completions", chat).status_code == 200
    assert len(engine.submitted) == 2  # only the neutral requests ran


def test_stream_options_need_stream(url, engine):
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    response = post(url, "/v1/completions", body)
    assert_error(response, 400, param="stream_options", mentions="only allowed when stream")
    assert not engine.submitted


def test_continuous_usage_stats_put_usage_in_every_chunk(url, engine, client):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): every chunk also
    carries its choice's usage so far, its prompt's tokens and its answer's up to that
    chunk; the last chunk still sums the request. Without include_usage it adds nothing."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": [[0, 62, 63]], "stream": True, "n": 2, "stream_options": options}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    *chunks, total = events[:-1]
    assert total["choices"] == [] and total["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2 * len(ANSWER),
        "total_tokens": 3 + 2 * len(ANSWER),
    }
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert counts == [8, 16, len(ANSWER), len(ANSWER)]  # blocks of 8, 8, 6, then the end
        assert all(c["usage"]["prompt_tokens"] == 3 for c in mine)
        assert all(c["usage"]["total_tokens"] == 3 + n for c, n in zip(mine, counts, strict=True))
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options=options,
    )
    counts = [c.usage.completion_tokens for c in chat if c.choices]
    assert counts == [8, 16, len(ANSWER), len(ANSWER)]
    options["include_usage"] = False  # as vLLM: continuous stats only beside include_usage
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        events = sse_events(response)
    assert all(e.get("usage") is None for e in events[:-1])


@pytest.mark.parametrize(
    "field, value, mentions",
    [
        ("max_tokens", 0, "max_tokens=0: Input should be greater than or equal to 1"),
        ("temperature", -1, "temperature=-1: Input should be greater than or equal to 0"),
        ("seed", 2**32, f"seed={2**32}: Input should be less than"),
        ("max_tokens", 16.5, "max_tokens=16.5: Input should be a valid integer"),
        ("stream", "yes", 'stream="yes": Input should be a valid boolean'),
    ],
)
def test_a_bad_value_is_named_in_the_message(url, engine, field, value, mentions):
    """A value that fails a field's type or bounds is quoted as the client sent it,
    beside what was expected."""
    response = post(url, "/v1/completions", {"prompt": "x", field: value})
    assert_error(response, 400, param=field, mentions=mentions)


def test_an_empty_model_name_is_the_served_model(url, engine):
    """`"model": ""` (some clients' default) asks for the served model, as vLLM takes it;
    another name is a 404."""
    assert post(url, "/v1/completions", {"prompt": "x", "model": ""}).status_code == 200
    response = post(url, "/v1/completions", {"prompt": "x", "model": "other"})
    assert_error(response, 404, param="model", code="model_not_found")


def test_a_tiny_temperature_decodes_greedily(url, engine):
    """A temperature below GREEDY_BELOW is greedy decoding (dividing logits by 1e-37
    overflowed them and the tie picked the lowest id), in a request and in a config."""
    assert post(url, "/v1/completions", {"prompt": "x", "temperature": 1e-37}).status_code == 200
    assert engine.submitted[-1].temperature == 0.0
    assert GenerationConfig(temperature=1e-7).temperature == 0.0
    assert GenerationConfig(temperature=1e-5).temperature == 1e-5
