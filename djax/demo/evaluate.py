"""Exact-match scoring of a model on demo problems through `djax.generate`.

Counting forwards: a batch decodes in lockstep, so every row rides through every forward
its batch makes, until the batch's slowest row is done. `row_forwards` sums, over batches,
rows × forwards; `forwards_per_answer` and `tokens_per_forward` divide by it. With batch 1
they are exact per-answer figures; with larger batches they are what an answer costs when
served in such a batch (more forwards than it alone would need).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from djax.demo import task
from djax.engine import GenerationConfig, generate
from djax.model import Model


@dataclasses.dataclass
class Score:
    """Totals over all batches; see the module docstring for the forward counts."""

    problems: int
    correct: int
    batches: int
    blocks: int
    forwards: int
    refreshes: int
    row_forwards: int
    generated_tokens: int
    seconds: float
    compile_seconds: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.problems

    @property
    def forwards_per_answer(self) -> float:
        return self.row_forwards / self.problems

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / max(self.row_forwards, 1)

    def summary(self) -> dict:
        return dataclasses.asdict(self) | {
            "accuracy": self.accuracy,
            "forwards_per_answer": self.forwards_per_answer,
            "tokens_per_forward": self.tokens_per_forward,
        }


def accuracy_by_task(problems: Sequence[tuple[str, str]], texts: Sequence[str]) -> dict:
    """Exact match per task kind (`task.kind_of`)."""
    right: dict[str, list[bool]] = {}
    for (prompt, _), text in zip(problems, texts, strict=True):
        right.setdefault(task.kind_of(prompt), []).append(task.check(prompt, text))
    return {kind: sum(hits) / len(hits) for kind, hits in sorted(right.items())}


def demo_config(**changes) -> GenerationConfig:
    """The generation layout the demo model was trained for, with `changes` applied."""
    return GenerationConfig(
        **{"gen_length": task.GEN_LENGTH, "block_length": task.BLOCK_LENGTH} | changes
    )


def score(
    model: Model,
    problems: Sequence[tuple[str, str]],
    config: GenerationConfig,
    batch_size: int = 64,
) -> tuple[Score, list[str]]:
    """Generate an answer for each (prompt, answer) problem in batches; returns the totals
    and the generated texts."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; expected ≥ 1")
    totals = Score(len(problems), 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0)
    texts: list[str] = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        out = generate(model, [p for p, _ in chunk], config, chat=True)
        texts += out.texts
        s = out.stats
        totals.correct += sum(task.check(p, t) for (p, _), t in zip(chunk, out.texts, strict=True))
        totals.batches += 1
        totals.blocks += s.blocks
        totals.forwards += s.forwards
        totals.refreshes += s.refreshes
        totals.row_forwards += s.forwards * len(chunk)
        totals.generated_tokens += s.generated_tokens
        totals.seconds += s.seconds
        totals.compile_seconds += s.compile_seconds
    return totals, texts
