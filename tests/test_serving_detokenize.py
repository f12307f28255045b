"""The serving detokenizer: final text per block, held-back tails, stop strings."""

import pytest

from djax.demo.tokenizer import build_char_tokenizer
from djax.serving.detokenize import Detokenizer


class ByteTokenizer:
    """One token per UTF-8 byte: a character of several bytes spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class WordTokenizer:
    """Tokens are words joined by spaces (a merge rule: text depends on neighbours)."""

    def __init__(self, words):
        self.words = words

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids)


def ids(text):
    return list(text.encode())


def run(detokenizer, blocks):
    """The pieces handed out per block, then the finish() piece."""
    pieces = [detokenizer.push(block) for block in blocks]
    return pieces, detokenizer.finish()


def test_demo_tokenizer_blocks_and_special_tokens():
    tok = build_char_tokenizer()
    answer = tok("3305", add_special_tokens=False)["input_ids"]
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    d = Detokenizer(tok)
    assert run(d, [answer[:2], answer[2:] + [eos]]) == (["33", "05"], "")
    assert d.text == "3305" and not d.stopped


def test_incomplete_utf8_is_held_until_its_last_byte():
    d = Detokenizer(ByteTokenizer())
    euro = ids("€")  # three bytes
    assert run(d, [ids("a") + euro[:1], euro[1:2], euro[2:] + ids("b")]) == (["a", "", "€b"], "")
    assert d.text == "a€b"


def test_merges_come_from_decoding_the_whole_answer():
    d = Detokenizer(WordTokenizer(["hello", "big", "world"]))
    assert run(d, [[0], [1, 2]]) == (["hello", " big world"], "")


def test_stop_string_split_across_blocks_is_held_then_cut():
    d = Detokenizer(ByteTokenizer(), stop=["STOP"])
    pieces, tail = run(d, [ids("abc ST"), ids("OP def")])
    assert pieces == ["abc ", ""] and tail == ""
    assert d.text == "abc " and d.stopped


def test_stop_string_spanning_three_blocks():
    d = Detokenizer(ByteTokenizer(), stop=["<end>"])
    pieces, _ = run(d, [ids("x<e"), ids("n"), ids("d>y")])
    assert pieces == ["x", "", ""] and d.text == "x" and d.stopped


def test_held_prefix_that_is_no_stop_is_released():
    d = Detokenizer(ByteTokenizer(), stop=["STOP"])
    assert run(d, [ids("go ST"), ids("AY")]) == (["go ", "STAY"], "")
    assert not d.stopped
    d = Detokenizer(ByteTokenizer(), stop=["STOP"])
    assert run(d, [ids("go STO")]) == (["go "], "STO")  # the answer ended: nothing held


def test_overlapping_prefixes_first_completed_stop_wins():
    # "abcd" would start earlier, but "bc" is complete first reading left to right.
    d = Detokenizer(ByteTokenizer(), stop=["abcd", "bc"])
    pieces, _ = run(d, [ids("xa"), ids("bcd")])
    assert pieces == ["x", "a"] and d.text == "xa" and d.stopped
    # A tail that two stop strings start with is held for the longest.
    d = Detokenizer(ByteTokenizer(), stop=["aab", "ab"])
    assert d.push(ids("zaa")) == "z"
    assert d.push(ids("c")) == "aac"
    # Equal ends: the longer (earlier) one cuts.
    d = Detokenizer(ByteTokenizer(), stop=["b", "ab"])
    assert run(d, [ids("xab")]) == (["x"], "") and d.stopped


def test_stop_string_in_the_tail_at_finish():
    d = Detokenizer(ByteTokenizer(), stop=["\n\n"])
    assert d.push(ids("line\n")) == "line"
    assert d.finish() == "\n" and not d.stopped
    d = Detokenizer(ByteTokenizer(), stop=["!"])
    assert run(d, [ids("hi!"), ids("more")]) == (["hi", ""], "")


def test_tokens_count_up_to_the_one_that_completes_the_stop_string():
    d = Detokenizer(ByteTokenizer(), stop=["STOP"])
    d.push(ids("abc ST"))
    assert d.tokens == 6 and not d.stopped  # held back, still counted
    d.push(ids("OP def"))
    assert d.stopped and d.tokens == len("abc STOP")
    d = Detokenizer(ByteTokenizer(), stop=["!"])
    run(d, [ids("hé!"), ids("more")])  # "é" is two tokens
    assert d.text == "hé" and d.tokens == 4
    d = Detokenizer(WordTokenizer(["hello", "big", "world", "x"]), stop=["big w"])
    run(d, [[0, 1], [2, 3]])  # the stop string needs the third word
    assert d.text == "hello " and d.tokens == 3
    d = Detokenizer(ByteTokenizer(), stop=["STOP"])
    run(d, [ids("no stop"), ids(" here")])
    assert not d.stopped and d.tokens == len("no stop here")


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        Detokenizer(ByteTokenizer(), stop=["a", ""])
