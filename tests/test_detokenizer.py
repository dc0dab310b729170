"""IncrementalDetokenizer with a tiny byte-level tokenizer: multi-byte characters split over
tokens are emitted once complete, and stop strings cut the text, also across token boundaries."""

from minicore.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Each token id is one byte (ids < 256); 256 is a special token."""

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(bytes([i]) if i < 256 else b"" if skip_special_tokens else b"<s>"
                        for i in ids)
        return data.decode("utf-8", errors="replace")

    def encode(self, text):
        return list(text.encode())


def test_multibyte_character_is_emitted_once_complete():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("say: "))
    euro = tok.encode("€")  # three bytes
    d.update(euro[:1])
    assert d.output_text == ""
    d.update(euro[1:2])
    assert d.output_text == ""
    d.update(euro[2:] + tok.encode("!"))
    assert d.output_text == "€!"


def test_special_tokens_are_skipped():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("x"))
    d.update(tok.encode("ok") + [256])
    assert d.output_text == "ok"


def test_stop_string_across_tokens_cuts_before_it():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("q"), stop=["END"])
    assert d.update(tok.encode("abc E")) is None
    assert d.update(tok.encode("N")) is None
    assert d.update(tok.encode("Dxyz")) == "END"
    assert d.output_text == "abc "


class WordTokenizer:
    """Each token id decodes to a whole word of VOCAB."""
    VOCAB = ["a", "bzz", " ", "c"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.VOCAB[i] for i in ids)


def test_earliest_stop_string_in_one_token_wins():
    d = IncrementalDetokenizer(WordTokenizer(), [2], stop=["zz", "b"])
    assert d.update([0, 1, 3]) == "b"
    assert d.output_text == "a"


def test_include_stop_str_in_output_cuts_after_the_stop_string():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("q"), stop=["END"], include_stop_str_in_output=True)
    assert d.update(tok.encode("abc ENDx")) == "END"
    assert d.output_text == "abc END"


def test_special_tokens_kept_when_not_skipped():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("x"), skip_special_tokens=False)
    d.update(tok.encode("ok") + [256])
    assert d.output_text == "ok<s>"


def test_spaces_between_special_tokens_reaches_a_slow_tokenizer_only():
    class SlowTokenizer(ByteTokenizer):
        calls = []

        def decode(self, ids, **kwargs):
            self.calls.append(kwargs)
            return super().decode(ids, skip_special_tokens=kwargs["skip_special_tokens"])

    slow = SlowTokenizer()
    IncrementalDetokenizer(slow, [1], spaces_between_special_tokens=False).update([65])
    assert all(call.get("spaces_between_special_tokens") is False for call in slow.calls)
    SlowTokenizer.calls = []
    IncrementalDetokenizer(slow, [1]).update([65])
    assert all("spaces_between_special_tokens" not in call for call in SlowTokenizer.calls)
