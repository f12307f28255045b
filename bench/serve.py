"""Serving benchmark of `djax serve`: a trace of requests sent to the OpenAI-compatible server
through the `openai` client, per scheduler (continuous, phase, static) and request rate.

Three roles in one script:

    python -m bench.serve --model dense|moe|llada2_mini [--tiny]
        [--schedulers continuous phase static] [--rates 2 4 8 inf] [--requests 500] [--seed 0]
        [--max-batch 32] [--equal N] [--weights dtype|fp8] [--temperature T] [--top-k K]
        [--top-p P] [--urgent-share F]
    python -m bench.serve server --model dense|moe|llada2_mini [--tiny]
        --scheduler continuous|phase|static --port P [--max-batch N] [--routing spread|model]
        [--weights dtype|fp8] [--sampling] [--scheduling-policy fcfs|priority]
    python -m bench.serve plot RESULT.json [RESULT.json ...]

The client (the default role) starts one server per scheduler (`server` role, this Python, as a
child process logging to `serve_<model>_<scheduler>.log` under $OUT or a temporary folder),
waits for `GET /health` to answer 200 (programs compiled), records how long that took
(`ready_s`), the programs compiled by then (`programs_at_ready`) and the server's memory budget
beside the weights (`memory_budget_bytes`, 0 on a CPU), runs the same trace at each rate, then
stops the server with SIGTERM and records its exit status (0: drained and exited).

The server: JAX's device pool sized as `djax serve` sizes it
(`djax.serving.memory.size_device_pool`), random bf16 weights built on the device
(`bench.common`; with `--weights fp8` its projections and experts quantised to e4m3, the results
then in `serve_<model>_fp8_<device>.json`), LLaDA-MoE and LLaDA2.0-mini (block diffusion) with
spread routing unless `--routing model`, answers decoded to one word per token id
(`IdTokenizer`: the random model has no text); the dual cache, blocks of 32 and the fixed-steps
`low_confidence` decoder with 8 steps a block, 4 tokens per forward as in `SETTING`. The engine
splits `GenerationConfig.steps` evenly over the blocks of `gen_length`, so the served config has
gen_length = the longest answer of the trace (512) and steps = gen_length / 4: every block of
every request takes 8 steps, whatever the request's own length. (The threshold decoder would
commit about one token per forward on random weights.) The server's longest sequence
(max_seq_len) is the trace's longest prompt + answer.

The trace (`LENGTHS`): prompt and answer lengths lognormal with median 128 and σ 0.5 of the
log, clipped to 16–512 prompt and 32–512 answer tokens; prompts of random token ids (never a
special id); arrivals a Poisson process at each rate (exponential gaps; `inf`: every request
at t = 0, saturation). Every rate sends the same requests, with its gaps the same unit-rate
draws divided by the rate. A rate such as `0.85x` is that fraction of the first scheduler's
saturation requests/s in this run (`--schedulers static continuous --rates inf 0.85x`: near
the static scheduler's capacity). Requests stream (a chunk per committed block that made text, usage
in the last) with `ignore_eos`, so every answer is exactly `max_tokens` long; an answer of
another length counts as failed. Requests are greedy unless `--temperature` (then the
server compiles its sampling programs too), with `--top-k`/`--top-p` in every request
(the result's `sampling`). Time to first chunk: to the first chunk with a choice.
`--equal N` adds, after the rates, N requests of prompt 128 / answer 256, all at t = 0 (rate
`equal`): continuous batching against the static scheduler's full batches. The static
scheduler compiles each batch shape the first time it meets it, so by default (`--warm-pass`)
it runs the first `--warm-requests` of each trace unmeasured before the measured run (three
full batches meet the shapes most batches of the trace have; the rows report the compiles
left during the measured run). `--tiny` also
shortens the lengths (`TINY_LENGTHS`: prompts up to 32 tokens, answers up to 64).
`--urgent-share F` sends that share of each trace's requests (the same requests, drawn
apart from the rest of the trace) with priority -1 to servers run with `--scheduling-policy
priority`, the others with 0; each row then also holds `by_priority`, the latency figures
of each priority's requests.

Per scheduler and rate: answer tokens/s (answer tokens of the requests that succeeded / the
makespan, first arrival to last answer), requests/s, p50/p99 end-to-end latency and time to
first chunk, failures; from `GET /metrics` scraped before and after the rate: programs
compiled during the run (0 when the warm-up compiled every shape the run needs), the median
host time between two block calls and the idle fraction (host time between calls /
makespan; the engine records no gap while it has nothing to run), the busy fraction (block
calls' time / makespan), from the histograms' buckets, sums and counts; and from samples of
the server's gauges every `--sample-every` seconds during the run (`samples`: device memory
in use, queue depth, running rows), the range of the memory in use and the deepest queue:
flat memory under overload shows there. The `openai` client holds at most 1,000 connections
(its default pool, below the server's queue bound of 1,024), so a trace of more requests
than that keeps the rest waiting in the client, counted in their latency. Results go to
`serve_<model>_<device>.json` (`bench.common.save`) and a plot of answer tokens/s and p99
latency against the rate beside it (same stem, `.png`; skipped without matplotlib).

On the GPU machine, which lacks the server's and the client's packages: run `bash
bench/wheels.sh` here (wheels into `.whl/`), carry `.whl`, and run `bash bench/run_device.sh
serve --model dense ...` there, which installs them first. One device command runs at most 10
minutes, warm-up compiles included: run one scheduler per command (`--schedulers static`) with
fewer requests at the slow rates, and draw the files together with `plot A.json B.json`. A run
longer than one command (an overload test of 10 minutes) goes through `run_device.sh detach`
and `collect` (`bench/README.md`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.common import ROUTINGS, SETTING, bench_model, model_config, save, use_routing
from djax import GenerationConfig, engine
from djax.config import WEIGHTS

REPO = Path(__file__).resolve().parent.parent
SCHEDULERS = ("continuous", "phase", "static")
TOKENS_PER_FORWARD = SETTING.gen_length // SETTING.steps
URGENT = -1  # the priority of a trace's urgent requests (`--urgent-share`), ahead of 0


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A trace's token counts: prompt and answer lengths lognormal (median, sigma: σ of the
    log), clipped to `prompt` and `answer` (min, max); `equal`: the (prompt, answer) of every
    request of `--equal`."""

    median: int
    sigma: float
    prompt: tuple[int, int]
    answer: tuple[int, int]
    equal: tuple[int, int]

    @property
    def max_sequence(self) -> int:
        return self.prompt[1] + self.answer[1]


LENGTHS = Lengths(median=128, sigma=0.5, prompt=(16, 512), answer=(32, 512), equal=(128, 256))
# --tiny: short lengths, so a CPU compiles the few shapes they need in seconds.
TINY_LENGTHS = Lengths(median=24, sigma=0.5, prompt=(8, 32), answer=(16, 64), equal=(16, 64))


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: sent `arrival` seconds after the trace starts, with its
    `priority` (vLLM's field; lower is admitted first by a `priority` server)."""

    arrival: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """What one request did, in seconds from the trace's start. first_chunk: when the first
    chunk carrying a choice arrived (None if none did); error: why it failed, None if not."""

    start: float
    first_chunk: float | None
    end: float
    completion_tokens: int
    error: str | None = None
    priority: int = 0


def prompt_vocabulary(vocab_size: int, special_ids: Sequence[int]) -> np.ndarray:
    """Every token id a random prompt may hold: the vocabulary less `special_ids`."""
    return np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids))


def lognormal_lengths(
    rng: np.random.Generator, n: int, lengths: Lengths, bounds: tuple[int, int]
) -> np.ndarray:
    """n lengths, lognormal as `lengths` says, clipped to `bounds`."""
    draws = rng.lognormal(math.log(lengths.median), lengths.sigma, n)
    return np.clip(np.rint(draws), *bounds).astype(int)


def make_trace(
    n: int,
    rate: float,
    vocabulary: np.ndarray,
    seed: int,
    lengths: Lengths = LENGTHS,
    urgent_share: float = 0.0,
) -> list[TraceRequest]:
    """The bench's trace: prompt and answer `lengths`, random prompts from
    `vocabulary`, Poisson arrivals at `rate` requests/s (math.inf: all at t = 0). The same
    seed gives the same requests at every rate, their gaps scaled by 1 / rate.
    `urgent_share`: that share of the requests (drawn apart, so the requests are the same
    at every share) is sent with priority `URGENT`, the rest with 0."""
    if not 0 <= urgent_share <= 1:
        raise ValueError(f"urgent share {urgent_share}; expected a number in [0, 1]")
    if not rate > 0:
        raise ValueError(f"request rate {rate}; expected a positive number or inf")
    rng = np.random.default_rng(seed)
    prompt_lengths = lognormal_lengths(rng, n, lengths, lengths.prompt)
    answer_lengths = lognormal_lengths(rng, n, lengths, lengths.answer)
    unit_gaps = rng.exponential(1.0, n)
    arrivals = np.concatenate([[0.0], np.cumsum(unit_gaps[:-1])]) / rate
    trace = [
        TraceRequest(float(arrival), tuple(rng.choice(vocabulary, length).tolist()), int(answer))
        for arrival, length, answer in zip(arrivals, prompt_lengths, answer_lengths, strict=True)
    ]
    urgent = np.random.default_rng((seed, 1)).random(n) < urgent_share
    return [
        dataclasses.replace(r, priority=URGENT) if u else r
        for r, u in zip(trace, urgent, strict=True)
    ]


def equal_trace(
    n: int, vocabulary: np.ndarray, seed: int, lengths: Lengths = LENGTHS
) -> list[TraceRequest]:
    """n requests of `lengths.equal` (prompt, answer) tokens, all at t = 0."""
    rng = np.random.default_rng(seed)
    prompt, answer = lengths.equal
    return [
        TraceRequest(0.0, tuple(rng.choice(vocabulary, prompt).tolist()), answer) for _ in range(n)
    ]


def _percentile(values, q):
    return float(np.percentile(values, q)) if values else None


def latencies(records: Sequence[RequestRecord]) -> dict:
    """p50/p99 end-to-end latency and time to first chunk of the requests that succeeded
    (numpy's linear rule), and how many there were and failed."""
    done = [r for r in records if r.error is None]
    latency = [r.end - r.start for r in done]
    ttft = [r.first_chunk - r.start for r in done]
    return {
        "p50_latency_s": _percentile(latency, 50),
        "p99_latency_s": _percentile(latency, 99),
        "p50_ttft_s": _percentile(ttft, 50),
        "p99_ttft_s": _percentile(ttft, 99),
        "failed": len(records) - len(done),
        "requests": len(records),
    }


def summarize(records: Sequence[RequestRecord], makespan: float) -> dict:
    """Throughput and latency figures of one run. Percentiles (numpy's linear rule) and
    tokens count the requests that succeeded; makespan: trace start to the last answer.
    Where requests had priorities other than 0, also `by_priority`: `latencies` of each
    priority's requests."""
    done = [r for r in records if r.error is None]
    summary = {
        "output_tokens_per_s": sum(r.completion_tokens for r in done) / makespan,
        "requests_per_s": len(done) / makespan,
        **latencies(records),
        "makespan_s": makespan,
    }
    priorities = sorted({r.priority for r in records})
    if priorities != [0]:
        summary["by_priority"] = {
            str(p): latencies([r for r in records if r.priority == p]) for p in priorities
        }
    return summary


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as {sample name with its labels: value}, e.g.
    `djax_compiles_total`, `djax_block_call_seconds_bucket{le="0.01"}`."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def histogram_median(before: dict, after: dict, name: str) -> float | None:
    """The median of histogram `name`'s observations between two scrapes, interpolated
    linearly inside its bucket (as Prometheus' histogram_quantile); None with none."""
    prefix = f'{name}_bucket{{le="'
    buckets = sorted(
        (float(k[len(prefix) : -2]), after[k] - before.get(k, 0.0))
        for k in after
        if k.startswith(prefix)
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    bounds, counts = zip(*buckets, strict=True)
    half = counts[-1] / 2
    i = next(i for i, c in enumerate(counts) if c >= half)
    low = bounds[i - 1] if i else 0.0
    if math.isinf(bounds[i]):
        return low
    below = counts[i - 1] if i else 0.0
    return low + (bounds[i] - low) * (half - below) / (counts[i] - below)


def histogram_above(before: dict, after: dict, name: str, bound: float) -> int:
    """How many of histogram `name`'s observations between two scrapes exceed `bound` (one
    of its bucket bounds)."""
    prefix = f'{name}_bucket{{le="'

    def count(le: str) -> float:
        key = f'{prefix}{le}"}}'
        return after.get(key, 0.0) - before.get(key, 0.0)

    return int(count("+Inf") - count(repr(bound)))


def server_figures(before: dict, after: dict, makespan: float) -> dict:
    """What the server's metrics say of one run: programs compiled during it, the median
    host time between two block calls and its share of the makespan (idle_fraction: the
    device waiting on the host while it has work), how many of those waits exceeded 10 ms,
    the block calls, their median and their share of the makespan (busy_fraction), the
    device memory in use after the run and its peak since the server started."""

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    gaps = "djax_host_seconds_between_calls"
    return {
        "compiles_during_run": int(delta("djax_compiles_total")),
        "host_gap_median_s": histogram_median(before, after, gaps),
        "idle_fraction": delta(f"{gaps}_sum") / makespan,
        "host_gaps_over_10ms": histogram_above(before, after, gaps, 0.01),
        "block_calls": int(delta("djax_block_call_seconds_count")),
        "block_call_median_s": histogram_median(before, after, "djax_block_call_seconds"),
        "busy_fraction": delta("djax_block_call_seconds_sum") / makespan,
        # device memory after the run and the most since the server started (None: the
        # backend reports none)
        "device_bytes_in_use": after.get("djax_device_bytes_in_use") or None,
        "device_peak_bytes": after.get("djax_device_peak_bytes_in_use") or None,
    }


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What every request of a trace asks of sampling: its temperature (0: greedy, the
    default; above 0 the server compiles its sampling programs too) and its top_k and
    top_p (0 and 1: none)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


async def send(
    client, model: str, request: TraceRequest, t0: float, sampling: Sampling = Sampling()
) -> RequestRecord:
    """Stream one completion; times in seconds from `t0` (perf_counter)."""
    await asyncio.sleep(max(0.0, t0 + request.arrival - time.perf_counter()))
    start = time.perf_counter() - t0
    first = None
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=list(request.prompt_ids),
            max_tokens=request.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "top_k": sampling.top_k}
            | ({"priority": request.priority} if request.priority else {}),
        )
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        error = None
        if first is None:
            error = "no chunk with a choice"
        elif tokens != request.max_tokens:
            error = f"{tokens} answer tokens, expected {request.max_tokens}"
    except Exception as e:  # any failure is the request's: it is counted, the run goes on
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter() - t0
    return RequestRecord(start, first, end, tokens, error, request.priority)


async def run_trace(
    base_url: str, model: str, trace: Sequence[TraceRequest], sampling: Sampling = Sampling()
):
    """Send every request at its arrival time; (records, makespan in seconds)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=3600.0
    ) as client:
        t0 = time.perf_counter()
        records = await asyncio.gather(*(send(client, model, r, t0, sampling) for r in trace))
    return records, max(r.end for r in records)


class Sampler:
    """Scrapes the server's gauges every `every` seconds on a thread while a trace runs: one
    sample when started, one when stopped and those between, each `{t (seconds since
    start), device_bytes_in_use, queue_depth, running_rows}` (None where the server reported
    none). With `wait_ready`'s scrape these show whether memory stays flat under load."""

    GAUGES = {
        "device_bytes_in_use": "djax_device_bytes_in_use",
        "queue_depth": "djax_queue_depth",
        "running_rows": "djax_running_rows",
    }

    def __init__(self, base_url: str, every: float):
        self.base_url, self.every = base_url, every
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def _sample(self) -> None:
        try:
            metrics = scrape(self.base_url)
        except OSError:  # a scrape that fails is a missing sample, not a failed run
            return
        sample = {"t": round(time.perf_counter() - self._t0, 3)}
        for name, metric in self.GAUGES.items():
            sample[name] = metrics.get(metric)
        self.samples.append(sample)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> Sampler:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def sample_figures(samples: Sequence[dict]) -> dict:
    """The range of the device memory in use over a run's samples (None where none was
    reported) and the deepest queue seen, beside the samples themselves."""
    used = [s["device_bytes_in_use"] for s in samples if s["device_bytes_in_use"]]
    queues = [s["queue_depth"] for s in samples if s["queue_depth"] is not None]
    return {
        "device_bytes_min": min(used) if used else None,
        "device_bytes_max": max(used) if used else None,
        "queue_depth_max": int(max(queues)) if queues else None,
        "samples": list(samples),
    }


def served_model_name(model: str) -> str:
    return f"bench-{model}"


def scrape(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as answer:
        return parse_metrics(answer.read().decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, scheduler: str, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "bench.serve", "server", "--model", args.model]
    command += ["--scheduler", scheduler, "--port", str(port)]
    command += ["--max-batch", str(args.max_batch), "--routing", args.routing]
    command += ["--weights", args.weights]
    command += ["--scheduling-policy", "priority" if args.urgent_share else "fcfs"]
    command += ["--sampling"] if args.temperature > 0 else []
    command += ["--tiny"] if args.tiny else []
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(base_url: str, server: subprocess.Popen, log: Path, timeout: float) -> float:
    """Poll /health until it answers 200; the seconds it took. Raises if the server exits
    or `timeout` passes first."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if server.poll() is not None:
            tail = log.read_text()[-3000:]
            raise RuntimeError(f"server exited with {server.returncode}; {log}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while compiling
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout} s; see {log}")


def stop_server(server: subprocess.Popen, timeout: float = 120.0) -> dict:
    """SIGTERM, then wait for the drain: the exit status (`killed` past `timeout`) and
    whether it is clean (0)."""
    server.send_signal(signal.SIGTERM)
    try:
        status = server.wait(timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        status = "killed"
    return {"exit": status, "clean_exit": status == 0}


def rate_label(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


@dataclasses.dataclass(frozen=True)
class OfCapacity:
    """A rate given as a fraction of the first scheduler's saturation requests/s (`0.85x`)."""

    fraction: float


def parse_rate(text: str) -> float | OfCapacity:
    relative = text.endswith("x")
    try:
        rate = float(text[:-1] if relative else text)
    except ValueError:
        rate = math.nan
    if not rate > 0 or (relative and math.isinf(rate)):
        raise argparse.ArgumentTypeError(
            f"rate {text!r}; expected a positive number, inf, or a fraction of the first "
            "scheduler's saturation rate such as 0.85x"
        )
    return OfCapacity(rate) if relative else rate


def check_rates(rates: Sequence[float | OfCapacity]) -> None:
    """A fraction of capacity needs the saturation run (inf) before it."""
    for i, rate in enumerate(rates):
        if isinstance(rate, OfCapacity) and math.inf not in rates[:i]:
            raise SystemExit(
                f"bench.serve: rate {rate.fraction}x needs inf (the saturation run) before it"
            )


def run_client(args) -> None:
    config = model_config(args.model, args.tiny)
    vocabulary = prompt_vocabulary(config.vocab_size, special_ids(config))
    lengths = trace_lengths(args.tiny)
    check_rates(args.rates)
    capacity: list[float] = []  # the first scheduler's saturation requests/s

    def trace_at(rate: float | OfCapacity) -> tuple[float | str, list[TraceRequest]]:
        if isinstance(rate, OfCapacity):
            rate = round(rate.fraction * capacity[0], 3)
        trace = make_trace(args.requests, rate, vocabulary, args.seed, lengths, args.urgent_share)
        return rate_label(rate), trace

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    runs: list = list(args.rates)
    if args.equal:
        runs.append(("equal", equal_trace(args.equal, vocabulary, args.seed, lengths)))
    logs = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="djax_serve_"))
    logs.mkdir(parents=True, exist_ok=True)
    rows, servers = [], {}

    def record(rows: list[dict]) -> Path:
        return save(
            "serve",
            {
                "trace": trace_parameters(args),
                "generation": dataclasses.asdict(served_generation(lengths)),
                "max_seq_len": lengths.max_sequence,
                "max_batch": args.max_batch,
                "routing": args.routing if config.is_moe else None,
                "weights": args.weights,
                "sampling": dataclasses.asdict(sampling),
                "tiny": args.tiny,
                "servers": servers,
                "results": rows,
            },
            setting=args.model if args.weights == "dtype" else f"{args.model}_{args.weights}",
        )

    for scheduler in args.schedulers:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        log = logs / f"serve_{args.model}_{scheduler}.log"
        server = start_server(args, scheduler, port, log)
        servers[scheduler] = {"log": log.name}
        try:
            servers[scheduler]["ready_s"] = wait_ready(base_url, server, log, args.ready_timeout)
            # The block calls' budget beside the weights (0: none, as on a CPU), and the
            # programs the warm-up compiled.
            ready = scrape(base_url)
            servers[scheduler]["memory_budget_bytes"] = ready["djax_memory_budget_bytes"]
            servers[scheduler]["programs_at_ready"] = int(ready["djax_compiles_total"])
            for i, run in enumerate(runs):
                if not isinstance(run, tuple):  # a rate: its trace, drawn once
                    runs[i] = run = trace_at(run)
                label, trace = run
                if scheduler in args.warm_pass:  # compiles the shapes this trace meets first
                    warm = trace[: args.warm_requests]
                    asyncio.run(run_trace(base_url, served_model_name(args.model), warm, sampling))
                before = scrape(base_url)
                with Sampler(base_url, args.sample_every) as sampler:
                    records, makespan = asyncio.run(
                        run_trace(base_url, served_model_name(args.model), trace, sampling)
                    )
                after = scrape(base_url)
                errors = sorted({r.error for r in records if r.error})
                rows.append(
                    {
                        "model": args.model,
                        "scheduler": scheduler,
                        "request_rate": label,
                        "warm_requests": args.warm_requests if scheduler in args.warm_pass else 0,
                        **summarize(records, makespan),
                        **server_figures(before, after, makespan),
                        "errors": errors[:5],
                        **sample_figures(sampler.samples),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                record(rows)  # so far: a run cut short keeps its finished rows
                if label == "inf" and not capacity:
                    capacity.append(rows[-1]["requests_per_s"])
        finally:
            servers[scheduler] |= stop_server(server)
        print(f"{scheduler} server: {servers[scheduler]}", flush=True)
    path = record(rows)
    print(table(rows))
    plot(rows, path.with_suffix(".png"))


def trace_lengths(tiny: bool) -> Lengths:
    return TINY_LENGTHS if tiny else LENGTHS


def trace_parameters(args) -> dict:
    """How the client's traces were drawn, for the result file."""
    lengths = trace_lengths(args.tiny)
    drawn = {"median": lengths.median, "sigma_of_log": lengths.sigma}
    parameters = {
        "requests": args.requests,
        "seed": args.seed,
        "prompt": {**drawn, "range": lengths.prompt},
        "answer": {**drawn, "range": lengths.answer},
        "rates": [
            f"{r.fraction}x of {args.schedulers[0]}'s saturation requests/s"
            if isinstance(r, OfCapacity)
            else rate_label(r)
            for r in args.rates
        ],
        "arrivals": "poisson (inf: all at t=0)",
        "urgent_share": args.urgent_share,
        "scheduling_policy": "priority" if args.urgent_share else "fcfs",
    }
    if args.equal:
        prompt, answer = lengths.equal
        parameters["equal"] = {"requests": args.equal, "prompt": prompt, "answer": answer}
    return parameters


def served_generation(lengths: Lengths) -> GenerationConfig:
    """The server's generation config: `SETTING`'s decoder, cache and tokens per forward,
    over answers up to the trace's longest."""
    gen_length = lengths.answer[1]
    return dataclasses.replace(
        SETTING, gen_length=gen_length, steps=gen_length // TOKENS_PER_FORWARD, early_stop=True
    )


class IdTokenizer:
    """The bench model's tokenizer: its weights are random and its vocabulary holds no text,
    so each token id decodes to one word, ` <id>` (special ids dropped when asked). Prompts
    are sent as token ids; the server decodes every answer with this."""

    def __init__(self, special_ids: Sequence[int]):
        self.special_ids = frozenset(special_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        skip = self.special_ids if skip_special_tokens else frozenset()
        return "".join(f" {i}" for i in ids if i not in skip)


def special_ids(config) -> tuple[int, ...]:
    """The model's special token ids: never in a prompt, dropped from answers' text."""
    ids = (config.mask_token_id, config.eos_token_id, config.pad_token_id)
    return tuple(i for i in ids + (config.eot_token_id, config.bos_token_id) if i is not None)


def run_server(args) -> None:
    from djax.serving.engine import ServeConfig
    from djax.serving.memory import size_device_pool
    from djax.serving.server import serve

    size_device_pool()  # JAX's pool as `djax serve` sizes it, before the backend starts
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = model_config(args.model, args.tiny)
    if config.is_moe:
        use_routing(args.routing)
    engine.enable_compile_cache()
    model, _ = bench_model(config, weights=args.weights)
    model = dataclasses.replace(model, tokenizer=IdTokenizer(special_ids(config)))
    lengths = trace_lengths(args.tiny)
    serve_config = ServeConfig(
        generation=served_generation(lengths),
        scheduler=args.scheduler,
        scheduling_policy=args.scheduling_policy,
        max_batch=args.max_batch,
        max_seq_len=lengths.max_sequence,
        sampling=args.sampling,  # a greedy trace compiles no sampling programs
    )
    serve(model, serve_config, port=args.port, model_name=served_model_name(args.model))


COLUMNS = (
    ("scheduler", "scheduler", "{}"),
    ("rate", "request_rate", "{}"),
    ("tok/s", "output_tokens_per_s", "{:.1f}"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("p50 s", "p50_latency_s", "{:.2f}"),
    ("p99 s", "p99_latency_s", "{:.2f}"),
    ("p50 ttft", "p50_ttft_s", "{:.2f}"),
    ("p99 ttft", "p99_ttft_s", "{:.2f}"),
    ("failed", "failed", "{}"),
    ("compiles", "compiles_during_run", "{}"),
    ("gap ms", "host_gap_median_s", "{:.3f}"),
    ("idle", "idle_fraction", "{:.3f}"),
)


def table(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width text table (host gap in ms, `-` for a missing figure)."""

    def cell(row, key, form):
        value = row.get(key)
        if value is None:
            return "-"
        return form.format(1e3 * value if key == "host_gap_median_s" else value)

    lines = [[title for title, _, _ in COLUMNS]]
    lines += [[cell(row, key, form) for _, key, form in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines
    )


KINDS = {"inf": (1, 0.0), "equal": (2, 0.0)}  # the runs that have no rate of their own


def rate_order(label: float | str) -> tuple[int, float]:
    """Finite rates ascending, then `inf`, then `equal`."""
    return KINDS.get(label, (0, label))


def plot(rows: Sequence[dict], path: Path) -> Path | None:
    """Answer tokens/s and p99 latency against the request rate, a line per model and
    scheduler, written to `path` (PNG); None, with a note, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.serve: no matplotlib, no plot")
        return None
    first: dict[tuple, dict] = {}
    for r in rows:  # a rate measured twice: the first row drawn
        first.setdefault((r["model"], r["scheduler"], r["request_rate"]), r)
    rows = list(first.values())
    labels = sorted({r["request_rate"] for r in rows}, key=rate_order)
    position = {label: i for i, label in enumerate(labels)}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["model"], r["scheduler"]) for r in rows}):
        mine = sorted(
            (r for r in rows if (r["model"], r["scheduler"]) == key),
            key=lambda r: rate_order(r["request_rate"]),
        )
        line = [r for r in mine if r["request_rate"] != "equal"]  # the rate axis
        equal = [r for r in mine if r["request_rate"] == "equal"]  # apart, unconnected
        for ax, field in zip(axes, ("output_tokens_per_s", "p99_latency_s"), strict=True):
            y = [math.nan if r[field] is None else r[field] for r in line]
            drawn = ax.plot([position[r["request_rate"]] for r in line], y, marker="o")
            drawn[0].set_label(" ".join(key))
            if equal:
                ax.plot([position["equal"]], [equal[0][field]], "s", color=drawn[0].get_color())
    for ax, title in zip(axes, ("answer tokens/s", "p99 end-to-end latency (s)"), strict=True):
        ax.set_xticks(range(len(labels)), [f"{x:g}" if x not in KINDS else x for x in labels])
        ax.set_xlabel("request rate (requests/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    partial = path.with_name(f".{path.name}.partial")
    figure.savefig(partial, format="png", dpi=120)
    plt.close(figure)
    partial.replace(path)
    print(f"wrote {path}")
    return path


def run_plot(args) -> None:
    """Re-draw the plot of result files, together: beside the first, same stem."""
    rows = [row for f in args.results for row in json.loads(Path(f).read_text())["results"]]
    plot(rows, Path(args.results[0]).with_suffix(".png"))


def parse(argv: Sequence[str]) -> argparse.Namespace:
    role = argv[0] if argv and argv[0] in ("server", "plot") else "client"
    parser = argparse.ArgumentParser(
        prog=f"bench.serve{'' if role == 'client' else ' ' + role}",
        description=__doc__.splitlines()[0],
    )
    if role == "plot":
        parser.add_argument("results", nargs="+", help="result JSON files of bench.serve")
        return parser.parse_args(argv[1:], argparse.Namespace(role=role))
    parser.add_argument("--model", choices=("dense", "moe", "llada2_mini"), required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--max-batch", type=int, default=32, help="rows decoded together")
    parser.add_argument("--routing", choices=ROUTINGS, default="spread", help="MoE routing")
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="dtype",
        help="the served weights: dtype (bf16) or fp8 (e4m3 projections and experts, the fp8 "
        "products auto picks)",
    )
    if role == "server":
        parser.add_argument("--scheduler", choices=SCHEDULERS, required=True)
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--sampling", action="store_true", help="serve temperature > 0")
        parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
        return parser.parse_args(argv[1:], argparse.Namespace(role=role))
    parser.add_argument("--schedulers", nargs="+", choices=SCHEDULERS, default=list(SCHEDULERS))
    parser.add_argument(
        "--rates",
        nargs="+",
        type=parse_rate,
        default=[2.0, 4.0, 8.0, math.inf],
        help="requests/s; inf: all at t=0",
    )
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="every request's (0: greedy)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="every request's (0: none)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's (1: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--urgent-share",
        type=float,
        default=0.0,
        help="share of each trace's requests sent with priority -1 to servers run with "
        "--scheduling-policy priority; rows then give each priority's latencies under "
        "by_priority (default: 0, every request 0 and first come, first served)",
    )
    parser.add_argument(
        "--equal", type=int, metavar="N", help="after the rates: N requests 128/256 at t=0"
    )
    parser.add_argument(
        "--warm-pass",
        nargs="*",
        choices=SCHEDULERS,
        default=["static"],
        help="schedulers that run the first --warm-requests of each trace unmeasured first: "
        "the static scheduler compiles a batch shape when it first meets it (default: static)",
    )
    parser.add_argument(
        "--warm-requests", type=int, default=96, help="requests of the warm pass (default: 96)"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=900.0, help="seconds to wait for the warm-up"
    )
    parser.add_argument(
        "--sample-every",
        type=float,
        default=10.0,
        help="seconds between two samples of the server's memory and queue during a run",
    )
    return parser.parse_args(argv, argparse.Namespace(role=role))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    {"client": run_client, "server": run_server, "plot": run_plot}[args.role](args)


if __name__ == "__main__":
    main()
