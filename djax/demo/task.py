"""The demo model's task: short problems with exactly checkable answers.

Three kinds (equally likely unless `sample` is given weights):

- `add`: "347+2958=" -> "3305" (operands of 1 to `MAX_DIGITS` digits). Most digits follow
  from their own column; the ones a carry chain reaches are the hard ones.
- `sort`: "sort 3,9,1,4" -> "1,3,4,9" (2 to 8 digits or lowercase letters, repeats allowed).
  The commas and the answer's length are known at once; each item needs a count.
- `reverse`: "reverse abcde" -> "edcba" (2 to 12 lowercase letters): every character is
  predictable in parallel.

Problems are sampled in bulk as ASCII code arrays (`sample`), so a trainer can draw a
fresh batch per step cheaply; `make_problems` returns them as text. Train and test are
disjoint by construction: a problem belongs to the test split when the FNV-1a hash of its
prompt text falls in bucket 0 of `SPLIT_BUCKETS`, whatever seed drew it.

The chat prompt is the problem text as the user's message; the trained answer region is
`GEN_LENGTH` tokens: the answer's characters, the end-of-turn token, then EOS to the end.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

TASKS = ("add", "sort", "reverse")
SPLITS = ("train", "test")
MAX_DIGITS = 4
SORT_ITEMS = (2, 8)
REVERSE_CHARS = (2, 12)
SPLIT_BUCKETS = 8
MAX_PROMPT_CHARS = max(
    2 * MAX_DIGITS + 2, len("sort ") + 2 * SORT_ITEMS[1] - 1, len("reverse ") + REVERSE_CHARS[1]
)
MAX_ANSWER_CHARS = max(MAX_DIGITS + 1, 2 * SORT_ITEMS[1] - 1, REVERSE_CHARS[1])
GEN_LENGTH = 32  # answer, end-of-turn, EOS padding
BLOCK_LENGTH = 8

_DIGITS = np.arange(ord("0"), ord("9") + 1, dtype=np.uint8)
_LETTERS = np.arange(ord("a"), ord("z") + 1, dtype=np.uint8)
_FNV_OFFSET, _FNV_PRIME = 2166136261, 16777619


@dataclasses.dataclass
class Problems:
    """A batch of problems as ASCII codes, left-aligned and zero-padded.

    prompt: [n, prompt_width] uint8; prompt_len: [n]; answer: [n, answer_width] uint8;
    answer_len: [n].
    """

    prompt: np.ndarray
    prompt_len: np.ndarray
    answer: np.ndarray
    answer_len: np.ndarray

    def __len__(self) -> int:
        return len(self.prompt_len)

    def texts(self) -> list[tuple[str, str]]:
        """(prompt, answer) strings."""
        return [
            (_text(p, n), _text(a, m))
            for p, n, a, m in zip(
                self.prompt, self.prompt_len, self.answer, self.answer_len, strict=True
            )
        ]

    def take(self, rows: np.ndarray) -> Problems:
        return Problems(
            self.prompt[rows], self.prompt_len[rows], self.answer[rows], self.answer_len[rows]
        )


def _text(codes: np.ndarray, length: int) -> str:
    return codes[:length].tobytes().decode("ascii")


Field = tuple[np.ndarray, np.ndarray]  # ([n, width] codes, [n, width] valid)


def pack(fields: list[Field], right: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-row variable-length fields and squeeze out the invalid entries.

    Each field is `[n, width]` codes with a validity mask. Returns `[n, total_width]` codes
    with each row's valid entries moved to the front (to the back with `right=True`, i.e.
    left-padded), in order, zero elsewhere, and the `[n]` row lengths.
    """
    codes = np.concatenate([c for c, _ in fields], axis=1)
    valid = np.concatenate([v for _, v in fields], axis=1)
    order = np.argsort(valid if right else ~valid, axis=1, kind="stable")
    packed = np.where(np.take_along_axis(valid, order, 1), np.take_along_axis(codes, order, 1), 0)
    return packed.astype(codes.dtype), valid.sum(axis=1)


def _literal(text: str, n: int) -> Field:
    codes = np.frombuffer(text.encode("ascii"), np.uint8)
    return np.broadcast_to(codes, (n, len(codes))), np.ones((n, len(codes)), bool)


def _number(values: np.ndarray, width: int) -> Field:
    """Decimal digits of non-negative ints, right-aligned in `width` columns."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    codes = (ord("0") + (values[:, None] // powers) % 10).astype(np.uint8)
    n_digits = 1 + (values[:, None] >= 10 ** np.arange(1, width, dtype=np.int64)).sum(axis=1)
    return codes, np.arange(width) >= width - n_digits[:, None]


def _interleave_commas(items: np.ndarray, count: np.ndarray) -> Field:
    """Items [n, k] (the first `count` valid) as "a,b,c": [n, 2k] codes."""
    n, k = items.shape
    codes = np.stack([items, np.full_like(items, ord(","))], axis=2).reshape(n, 2 * k)
    index = np.arange(k)
    valid = np.stack([index < count[:, None], index < count[:, None] - 1], axis=2)
    return codes, valid.reshape(n, 2 * k)


def _add(rng: np.random.Generator, n: int) -> tuple[list[Field], list[Field]]:
    operands = []
    for _ in range(2):
        digits = rng.integers(1, MAX_DIGITS + 1, n)
        low = np.where(digits == 1, 0, 10 ** (digits - 1))
        operands.append(rng.integers(low, 10**digits))
    a, b = operands
    prompt = [_number(a, MAX_DIGITS), _literal("+", n), _number(b, MAX_DIGITS), _literal("=", n)]
    return prompt, [_number(a + b, MAX_DIGITS + 1)]


def _sort(rng: np.random.Generator, n: int) -> tuple[list[Field], list[Field]]:
    k = SORT_ITEMS[1]
    count = rng.integers(SORT_ITEMS[0], k + 1, n)
    letters = rng.random(n) < 0.5
    items = np.where(
        letters[:, None],
        _LETTERS[rng.integers(0, 26, (n, k))],
        _DIGITS[rng.integers(0, 10, (n, k))],
    )
    present = np.arange(k) < count[:, None]
    ordered = np.sort(np.where(present, items, 255), axis=1).astype(np.uint8)
    prompt = [_literal("sort ", n), _interleave_commas(items, count)]
    return prompt, [_interleave_commas(ordered, count)]


def _reverse(rng: np.random.Generator, n: int) -> tuple[list[Field], list[Field]]:
    k = REVERSE_CHARS[1]
    count = rng.integers(REVERSE_CHARS[0], k + 1, n)
    chars = _LETTERS[rng.integers(0, 26, (n, k))]
    valid = np.arange(k) < count[:, None]
    backwards = np.take_along_axis(chars, np.maximum(count[:, None] - 1 - np.arange(k), 0), 1)
    return [_literal("reverse ", n), (chars, valid)], [(backwards, valid)]


_GENERATORS = {"add": _add, "sort": _sort, "reverse": _reverse}


def prompt_hash(codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """32-bit FNV-1a of each row's first `lengths` codes: [n, width] -> [n] uint64."""
    h = np.full(len(codes), _FNV_OFFSET, np.uint64)
    for j in range(codes.shape[1]):
        mixed = ((h ^ codes[:, j].astype(np.uint64)) * np.uint64(_FNV_PRIME)) & np.uint64(
            0xFFFFFFFF
        )
        h = np.where(j < lengths, mixed, h)
    return h


def split_of(prompt: str) -> str:
    """ "test" or "train": the split a problem's prompt text belongs to."""
    codes = np.frombuffer(prompt.encode("ascii"), np.uint8)[None]
    bucket = int(prompt_hash(codes, np.array([codes.shape[1]]))[0]) % SPLIT_BUCKETS
    return "test" if bucket == 0 else "train"


def _check_args(split: str, tasks: tuple[str, ...]) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {SPLITS}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks={tasks!r}; expected a non-empty subset of {TASKS}")


def _draw(
    rng: np.random.Generator, n: int, tasks: tuple[str, ...], weights: tuple[float, ...] | None
) -> Problems:
    kinds = rng.choice(len(tasks), n, p=weights)
    prompts, answers = [], []
    for i, task in enumerate(tasks):
        rows = np.flatnonzero(kinds == i)
        prompt_fields, answer_fields = _GENERATORS[task](rng, len(rows))
        prompts.append((rows, *pack(prompt_fields)))
        answers.append(pack(answer_fields))
    prompt = np.zeros((n, max(p.shape[1] for _, p, _ in prompts)), np.uint8)
    answer = np.zeros((n, max(a.shape[1] for a, _ in answers)), np.uint8)
    prompt_len, answer_len = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for (rows, p, p_len), (a, a_len) in zip(prompts, answers, strict=True):
        prompt[rows, : p.shape[1]], prompt_len[rows] = p, p_len
        answer[rows, : a.shape[1]], answer_len[rows] = a, a_len
    return Problems(prompt, prompt_len, answer, answer_len)


def sample(
    rng: np.random.Generator,
    n: int,
    split: str = "train",
    tasks: tuple[str, ...] = TASKS,
    weights: tuple[float, ...] | None = None,
) -> Problems:
    """`n` random problems of one split, as ASCII code arrays. weights: each task's
    probability (default: equal)."""
    _check_args(split, tasks)
    if weights is not None:
        if len(weights) != len(tasks) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"weights={weights!r}; expected {len(tasks)} non-negative numbers")
        weights = tuple(w / sum(weights) for w in weights)
    parts, have = [], 0
    while have < n:
        want = n - have
        draw = 2 * want + 16 if split == "train" else 2 * SPLIT_BUCKETS * want + 16
        problems = _draw(rng, draw, tasks, weights)
        bucket = prompt_hash(problems.prompt, problems.prompt_len) % np.uint64(SPLIT_BUCKETS)
        keep = np.flatnonzero((bucket == 0) == (split == "test"))[:want]
        parts.append(problems.take(keep))
        have += len(keep)
    return _concat(parts)


def _concat(parts: list[Problems]) -> Problems:
    def cat(name: str) -> np.ndarray:
        arrays = [getattr(p, name) for p in parts]
        if arrays[0].ndim == 1:
            return np.concatenate(arrays)
        width = max(a.shape[1] for a in arrays)
        return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])

    return Problems(cat("prompt"), cat("prompt_len"), cat("answer"), cat("answer_len"))


def make_problems(
    n: int, split: str = "test", seed: int = 0, tasks: tuple[str, ...] = TASKS
) -> list[tuple[str, str]]:
    """`n` (prompt, answer) text pairs of a split, deterministic given the seed."""
    return sample(np.random.default_rng(seed), n, split, tasks).texts()


_ADD = re.compile(r"(\d+)\+(\d+)=")
_SORT = re.compile(r"sort ([0-9a-z](?:,[0-9a-z])*)")
_REVERSE = re.compile(r"reverse ([a-z]+)")


def kind_of(prompt: str) -> str:
    """Which of the `TASKS` a problem prompt is."""
    for kind, pattern in (("add", _ADD), ("sort", _SORT), ("reverse", _REVERSE)):
        if pattern.fullmatch(prompt):
            return kind
    raise ValueError(
        f"prompt {prompt!r} is not a demo problem; expected 'A+B=', 'sort x,y,...' or "
        "'reverse letters'"
    )


def solve(prompt: str) -> str:
    """The exact answer to a problem prompt of any of the `TASKS` formats."""
    if m := _ADD.fullmatch(prompt):
        return str(int(m[1]) + int(m[2]))
    if m := _SORT.fullmatch(prompt):
        return ",".join(sorted(m[1].split(",")))
    if m := _REVERSE.fullmatch(prompt):
        return m[1][::-1]
    return kind_of(prompt)  # raises: no task matched


def check(prompt: str, answer_text: str) -> bool:
    """Exact match of a generated answer against the problem's solution."""
    return answer_text == solve(prompt)


def chat_prompt(tokenizer, prompt: str) -> str:
    """The text `djax.generate(..., chat=True)` feeds the model for a problem prompt."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
