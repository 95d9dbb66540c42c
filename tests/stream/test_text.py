"""TextBuffer: sentence cuts, idle delays, flush, long-text cuts (pure Python, no clock)."""

from higgs_stream.stream.text import TextBuffer


def test_sentence_end_needs_following_whitespace():
    buf = TextBuffer()
    assert buf.append("Hello world.", now=0.0) == []  # could still be "world.com" or "3.5"
    assert buf.append(" How are", now=0.1) == ["Hello world."]
    assert buf.pending == "How are"
    assert buf.append(" you?\n", now=0.2) == ["How are you?"]
    assert buf.pending == ""


def test_tokens_concatenate_verbatim():
    buf = TextBuffer()
    out = []
    for i, tok in enumerate(["It", " costs", " 3", ".", "5", " dollars", ".", " Ok", "!", " "]):
        out += buf.append(tok, now=i * 0.01)
    assert out == ["It costs 3.5 dollars.", "Ok!"]


def test_abbreviations_and_initials_do_not_end_sentences():
    buf = TextBuffer()
    assert buf.append("Dr. Smith met J. R. Doe, e.g. at St. Mary. Then", now=0) == ["Dr. Smith met J. R. Doe, e.g. at St. Mary."]
    assert buf.pending == "Then"


def test_cjk_and_blank_line_cut_without_space():
    buf = TextBuffer()
    assert buf.append("你好。今天", now=0) == ["你好。"]
    assert buf.append("很好！", now=0) == ["今天很好！"]
    assert buf.append("first paragraph\n\nsecond", now=0) == ["first paragraph"]
    assert buf.pending == "second"


def test_closing_quotes_stay_with_their_sentence():
    buf = TextBuffer()
    assert buf.append('He said "stop!" Then left.) More', now=0) == ['He said "stop!"', "Then left.)"]


def test_idle_deadlines():
    buf = TextBuffer(max_delay_s=1.0, sentence_delay_s=0.15)
    assert buf.deadline() is None
    buf.append("partial text", now=10.0)
    assert buf.deadline() == 11.0
    assert buf.poll(10.9) == []
    buf.append(" more", now=10.9)  # the idle clock restarts on every append
    assert buf.poll(11.5) == []
    assert buf.poll(11.9) == ["partial text more"]
    assert buf.deadline() is None
    buf.append("Looks done.", now=20.0)  # ends like a sentence: the short delay applies
    assert buf.deadline() == 20.15
    assert buf.poll(20.2) == ["Looks done."]


def test_zero_delay_cuts_at_next_poll():
    buf = TextBuffer(max_delay_s=0.0, sentence_delay_s=0.15)
    buf.append("word", now=5.0)
    assert buf.deadline() == 5.0 and buf.poll(5.0) == ["word"]


def test_flush_and_whitespace_only():
    buf = TextBuffer()
    assert buf.append("   \n ", now=0) == []
    assert buf.flush() == []  # blank text never becomes a segment
    buf.append("no punctuation", now=0)
    assert buf.flush() == ["no punctuation"]
    assert buf.pending == "" and buf.deadline() is None


def test_long_text_is_cut_at_clause_or_space():
    buf = TextBuffer(max_segment_chars=30)
    out = buf.append("one two three four five, six seven eight nine ten eleven twelve", now=0)
    assert out == ["one two three four five,", "six seven eight nine ten"]
    assert all(len(s) <= 30 for s in out)
    assert buf.flush() == ["eleven twelve"]
    # a single word longer than the limit is hard-cut
    buf2 = TextBuffer(max_segment_chars=10)
    assert buf2.append("abcdefghijklmnopqrstuvwxyz", now=0) == ["abcdefghij", "klmnopqrst"]
    assert buf2.flush() == ["uvwxyz"]


def test_long_sentence_is_cut_too():
    buf = TextBuffer(max_segment_chars=20)
    out = buf.append("alpha beta gamma delta epsilon zeta. Next", now=0)
    assert out == ["alpha beta gamma", "delta epsilon zeta."]
    assert "".join(out).replace(" ", "") == "alphabetagammadeltaepsilonzeta."
