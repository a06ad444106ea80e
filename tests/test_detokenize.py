"""Incremental decoding: the text of a growing token list equals decoding the whole list, for
the tokenizer families SoT serves (byte-level BPE as GPT-2 and SmolLM2, SentencePiece-style
BPE with byte fallback as Llama and Gemma), with characters split across tokens."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from sot.detokenize import MAX_UNSETTLED, IncrementalText
from sot.requests import GenerationParams, LiveRequest, SequenceResult

_TEXT = ["the quick brown fox jumps over the lazy dog, naïve café déjà vu " * 3,
         "héllo wörld ünïcode 日本語のテキスト 😀🎉 emoji, and code: def f(x): return x ** 2"] * 20


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TEXT, trainer)
    return tok


def _sentencepiece_like() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    # a small alphabet, so that accents, CJK and emoji are spelled in byte tokens
    tok.train_from_iterator(_TEXT, trainers.BpeTrainer(vocab_size=420, special_tokens=byte_tokens, limit_alphabet=30,
                                                       initial_alphabet=list("abcdefghijklmnopqrstuvwxyz▁")))
    return tok


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
def test_incremental_text_equals_decoding_everything(family: str) -> None:
    tok = _byte_level() if family == "byte_level" else _sentencepiece_like()

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    rng = random.Random(0)
    split = 0
    for text in _TEXT[:2]:
        ids = tok.encode(text).ids
        assert decode(ids) == text.lstrip() or family == "byte_level"
        for _ in range(5):
            inc, n, settled = IncrementalText(decode), 0, []
            while n < len(ids):
                k = rng.choice([1, 1, 2, 3, 7, 25])  # 25: a speculative step's run
                inc.extend(ids[n : n + k])
                n += k
                whole = decode(ids[:n])
                settled.append(inc.text[: inc.settled_length])
                if "\ufffd" in whole:  # a character split across tokens: the text before it is settled
                    split += 1
                else:
                    assert inc.text == whole and len(inc) == len(whole) and inc.settled_length == len(whole)
            assert inc.text == decode(ids)
            assert all(inc.text.startswith(s) for s in settled), "settled text is never taken back"
    assert split > 0, "the texts must split some characters across tokens"
    # random tokens: invalid byte sequences and replacement characters that never complete
    inc = IncrementalText(decode)
    for _ in range(300):
        inc.extend([rng.randrange(tok.get_vocab_size()) for _ in range(rng.choice([1, 2, 5]))])
        assert len(inc.ids) - inc._read <= MAX_UNSETTLED + 5, "unsettled tokens stay bounded"


def test_a_clean_up_rule_across_the_boundary_falls_back_to_the_whole_text() -> None:
    def decode(ids: list[int]) -> str:  # like clean_up_tokenization_spaces: " ." becomes "."
        return "".join(chr(i) for i in ids).replace(" .", ".")

    inc = IncrementalText(decode)
    for piece in ("a b ", ".", " c"):
        inc.extend([ord(c) for c in piece])
    assert inc.text == "a b. c"


def test_the_engine_finds_a_stop_string_split_across_steps() -> None:
    def decode(ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    params = GenerationParams(max_new_tokens=100, stop=("STOP",))
    seq = LiveRequest(0, [1], params, SequenceResult(index=0, token_ids=[]), None, 0.0)
    for piece in ("abc S", "T", "O", "P and more"):
        event = seq.commit([ord(c) for c in piece], 0.0, decode, counts_as_step=True)
    assert event.finished and event.finish_reason == "stop"
    assert seq.result.text == "abc STOP", "the run ends at the token that completes the stop string"
    assert event.token_ids == [ord("P")] and seq.result.accept_lengths == [5, 1, 1, 1]


def _chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_a_stop_string_inside_an_accepted_run_cuts_the_run_there() -> None:
    """As plain decoding, one token a step, would: the tokens after the one that completes
    the stop string are not committed, nor their log probabilities."""
    params = GenerationParams(max_new_tokens=100, stop=("cd",))
    seq = LiveRequest(0, [1], params, SequenceResult(index=0, token_ids=[]), None, 0.0)
    seq.result.logprobs.extend(range(6))  # one per offered token, as the acceptance adds them
    event = seq.commit([ord(c) for c in "abcdef"], 0.0, _chars, counts_as_step=True)
    assert event.finish_reason == "stop" and event.token_ids == [ord(c) for c in "abcd"]
    assert seq.result.token_ids == event.token_ids and seq.result.accept_lengths == [4]
    assert seq.result.logprobs == [0, 1, 2, 3]


def test_a_stop_string_on_the_last_allowed_token_is_a_stop() -> None:
    params = GenerationParams(max_new_tokens=4, stop=("cd",))
    seq = LiveRequest(0, [1], params, SequenceResult(index=0, token_ids=[]), None, 0.0)
    assert seq.commit([ord(c) for c in "abcdef"], 0.0, _chars, counts_as_step=True).finish_reason == "stop"
    params = GenerationParams(max_new_tokens=3, stop=("cd",))
    seq = LiveRequest(0, [1], params, SequenceResult(index=0, token_ids=[]), None, 0.0)
    assert seq.commit([ord(c) for c in "abcdef"], 0.0, _chars, counts_as_step=True).finish_reason == "length"


def test_streamed_deltas_of_byte_fallback_text_join_to_the_text() -> None:
    from sot.server.protocol import TextAssembler

    class Tok:  # the byte tokens are registered as special ones: keep them
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return sp.decode(ids, skip_special_tokens=False)

    sp = _sentencepiece_like()
    text = _TEXT[1]
    ids = sp.encode(text).ids
    stream = TextAssembler(Tok(), ("STOP",))
    rng = random.Random(1)
    deltas, n = [], 0
    while n < len(ids):
        k = rng.choice([1, 2, 3, 25])
        deltas.append(stream.add(ids[n : n + k], final=n + k >= len(ids)))
        n += k
    assert all("\ufffd" not in d for d in deltas), "no replacement character is sent for a split character"
    assert "".join(deltas) == stream.final_text() == text


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
def test_token_pieces_join_to_the_text(family: str) -> None:
    """A trace's pieces, one per token, join to the decoded text with no replacement
    character: a character spelled in several byte tokens goes to the token that completes it."""
    from sot.detokenize import token_pieces

    tok = _byte_level() if family == "byte_level" else _sentencepiece_like()
    for text in _TEXT[:2]:
        ids = tok.encode(text).ids
        pieces = token_pieces(tok, ids)
        assert len(pieces) == len(ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)
    assert "\ufffd" not in "".join(pieces) and "" in pieces, "the emoji and CJK text spans tokens"
