"""Prompts in and answers out for `djax generate`: prompt files, JSONL records, resuming.

A prompt is a `PromptRecord`: an `id` and either a string `prompt` or a chat conversation
(`messages`, a list of `{"role", "content"}` dicts). Sources: `--prompt` texts (ids 0, 1,
...), a prompts file (one prompt per line; the id is the 1-based line number) or a JSONL
file (one JSON object per line with `prompt` or `messages` and an optional `id`, by default
the line number). Lines end at a line feed (or CR LF) only: a form feed, U+2028 or any other
character Python's `splitlines` would also break at stays inside its line. A conversation's
turns take the roles and contents `djax serve` takes (`ROLES`; a string, or a list of text
parts joined), and reach the chat template as `template_turn` gives them. Answers are
appended to an output JSONL file one record per prompt, a whole batch per write, so an
interrupted job keeps every finished batch and a second run skips the ids the file already
holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from djax.generation import GenerationConfig

# A chat turn's roles, as the OpenAI API names them (`djax serve` takes the same); a
# `developer` turn reaches the chat template as a `system` turn (`template_turn`).
ROLES = ("system", "developer", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt: `id` (str or int, unique in a job) and `prompt`, a string or a list of
    `{"role": ..., "content": ...}` messages."""

    id: str | int
    prompt: str | list[dict[str, Any]]

    @property
    def is_conversation(self) -> bool:
        return not isinstance(self.prompt, str)

    def fields(self) -> dict[str, Any]:
        """The record's id and prompt as an output record names them."""
        key = "messages" if self.is_conversation else "prompt"
        return {"id": self.id, key: self.prompt}


def turn_text(content: Any) -> str | None:
    """A chat turn's content as text: a string as it is, a list of text parts
    (`{"type": "text", "text": ...}`) joined; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def template_turn(role: str, text: str) -> dict[str, str]:
    """A turn as the chat template takes it: `developer` given as `system`."""
    return {"role": "system" if role == "developer" else role, "content": text}


def _lines(text: str) -> list[str]:
    """`text`'s lines, broken at line feeds only (`_text` reads CR LF as one), without the
    empty one after a final line feed."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def from_texts(texts: Sequence[str]) -> list[PromptRecord]:
    """`--prompt` texts, ids 0, 1, ...; ValueError naming a text that is empty (as a JSONL
    record's `"prompt": ""` is refused) or not valid Unicode (bytes the shell passed that
    are not UTF-8)."""
    for i, text in enumerate(texts):
        if not text:
            raise ValueError(f"--prompt {i} is empty; expected a non-empty prompt")
        _check_unicode(text, f"--prompt {i}")
    return [PromptRecord(i, text) for i, text in enumerate(texts)]


def _check_id(id_: Any, where: str) -> None:
    """ValueError naming `where` unless `id_` is a string of valid Unicode or an int."""
    if not isinstance(id_, str | int) or isinstance(id_, bool):
        raise ValueError(f"{where}: id {id_!r}; expected a string or an int")
    if isinstance(id_, str):
        _check_unicode(id_, f"{where}: id")


def _check_unicode(text: str, where: str) -> None:
    """ValueError naming `where` when `text` holds a lone surrogate (from a JSON escape such
    as "\\ud800", or bytes that are not UTF-8 on the command line): no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{where}: character {err.start} ({text[err.start]!r}) is not valid Unicode; "
            "expected UTF-8 text"
        ) from None


def _text(path: str | Path) -> str:
    """A file's UTF-8 text, CR LF read as a line feed (a lone CR stays in its line) and a
    leading byte-order mark dropped; ValueError naming the file where it is not UTF-8."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: byte {err.start} is not UTF-8 ({err.reason}); expected a UTF-8 text file"
        ) from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def read_prompts_file(path: str | Path) -> list[PromptRecord]:
    """One prompt per non-blank line, its id the 1-based line number; raises ValueError when
    the file holds no prompt."""
    lines = _lines(_text(path))
    records = [PromptRecord(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no prompts; expected one prompt per line")
    return records


def read_jsonl(path: str | Path) -> list[PromptRecord]:
    """One JSON object per non-blank line with `prompt` (a non-empty string) or `messages`
    (a non-empty list of {"role", "content"} objects) and an optional `id` (default: the
    1-based line number). Raises ValueError naming the file and line of a bad record, a
    repeated id, or a file without records."""
    records, seen = [], set()
    for n, line in enumerate(_lines(_text(path)), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        record = _record(item, n, where)
        if record.id in seen:
            raise ValueError(f"{where}: id {record.id!r} repeats an earlier record's")
        seen.add(record.id)
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records; expected one JSON object per line")
    return records


# Keys no input record may hold: generation options (`GenerationConfig`'s and the API's),
# which `djax generate` takes from its command line alone, one config for every record: a
# record's own would be ignored. Other keys (an eval file's metadata) are.
OPTION_KEYS = frozenset(
    {f.name for f in dataclasses.fields(GenerationConfig)}
    | {"max_tokens", "max_completion_tokens", "stop", "n"}
)


def _record(item: Any, line: int, where: str) -> PromptRecord:
    if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
        raise ValueError(f'{where}: expected an object with "prompt" or "messages"')
    options = sorted(OPTION_KEYS & item.keys())
    if options:
        raise ValueError(
            f'{where}: holds "{options[0]}", a generation option; every record runs with '
            "the command line's options (djax generate --help): expected no such key"
        )
    id_ = item.get("id", line)
    _check_id(id_, where)
    if "prompt" in item:
        prompt = item["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{where}: "prompt" must be a non-empty string')
        _check_unicode(prompt, where)
        return PromptRecord(id_, prompt)
    messages = item["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}}')
    turns = []
    for j, message in enumerate(messages):
        turn = message if isinstance(message, dict) else {}
        if turn.get("role") not in ROLES:
            raise ValueError(
                f"{where}: messages[{j}] has role {turn.get('role')!r}; expected one of {ROLES}"
            )
        text = turn_text(turn.get("content"))
        if text is None:
            raise ValueError(
                f"{where}: messages[{j}] has content {turn.get('content')!r:.60}; expected a "
                'string or a list of text parts ({"type": "text", "text": ...})'
            )
        _check_unicode(text, f"{where}: messages[{j}]")
        turns.append(template_turn(turn["role"], text))
    return PromptRecord(id_, turns)


# The fields every record of a djax output file holds beside its prompt or messages.
OUTPUT_FIELDS = ("id", "answer", "token_ids")


class Answered(NamedTuple):
    """What an output record says of an answered prompt: the prompt (text or messages) and
    the settings it was generated with (None in records written before djax kept them)."""

    prompt: str | list
    settings: dict | None


def finished(path: str | Path) -> dict[str | int, Answered]:
    """The records an output JSONL file already holds, as {id: `Answered`} (none when it
    does not exist yet). Raises ValueError naming the line of anything that
    is not such a record (an object with `OUTPUT_FIELDS` and one of `prompt` and
    `messages`), so a file that is not djax's output, a prompts file among them, is never
    appended to, and naming a folder the file could not be created in because it does not
    exist (found before any work is done)."""
    path = Path(path)
    if not path.exists():
        if not path.parent.is_dir():
            raise ValueError(
                f"{path}: its folder {str(path.parent)!r} does not exist; expected an output "
                "file in an existing folder"
            )
        return {}
    if path.is_dir():
        raise ValueError(f"{path} is a folder; expected an output file (JSONL)")
    if not path.is_file():  # a pipe, a terminal, a device: no file to append to and read back
        raise ValueError(
            f"{path} is not a regular file; expected an output file (JSONL), which djax "
            "appends to and reads back to resume (--json prints the results instead)"
        )
    stream = _stream_of(path)
    if stream:
        raise ValueError(
            f"{path} is this run's {stream}, where djax prints too; expected an output file "
            "of its own (--json prints the results instead)"
        )
    done = {}
    text = _text(path)
    if text and not text.endswith("\n"):
        raise ValueError(f"{path}: the last line is cut short; remove it to resume")
    for n, line in enumerate(_lines(text), 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = None
        ok = isinstance(item, dict) and all(k in item for k in OUTPUT_FIELDS)
        if not ok or ("prompt" in item) == ("messages" in item):
            raise ValueError(
                f"{path}:{n}: not a djax output record; expected a JSON object with "
                f"{', '.join(OUTPUT_FIELDS)} and a prompt or messages"
            )
        _check_id(item["id"], f"{path}:{n}")
        done[item["id"]] = Answered(item.get("prompt", item.get("messages")), item.get("settings"))
    return done


def _stream_of(path: Path) -> str | None:
    """ "standard output" or "standard error" where `path` is the file this process writes
    that stream to (a shell's `> file` given as `/dev/stdout`), else None."""
    here = path.stat()
    for fd, name in ((1, "standard output"), (2, "standard error")):
        try:
            stream = os.fstat(fd)
        except OSError:
            continue
        if (stream.st_dev, stream.st_ino) == (here.st_dev, here.st_ino):
            return name
    return None


def batches(records: Sequence[PromptRecord], size: int) -> Iterator[list[PromptRecord]]:
    """`records` in consecutive batches of `size` (the last one may be smaller)."""
    for start in range(0, len(records), size):
        yield list(records[start : start + size])


def append_records(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append `records` to a JSONL file in one unbuffered write, then sync it to disk; a
    write that fails (a full disk) is cut back to the file's length before it, so the file
    stays whole and a later run resumes from it."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (os.write may take part of it at a time)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
