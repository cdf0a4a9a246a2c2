"""runtime/detokenizer.py: the one stop-string behaviour of generate, chat, serve and the eval's generate_until,
as the OpenAI API and vLLM have it: the reply ends just before the EARLIEST occurrence of any stop string (not
the first string in the list, not the longest); while streaming, the longest tail that may still become a stop
string and a half-decoded character are held back, and the deltas add up to the final text."""
from mindformers_gptlocal.runtime.detokenizer import Detokenizer, cut_at_stop, find_stop, settled


def chars(tokens):
    """A toy tokenizer: token t is chr(t); 0xFFFD stands for a half-decoded character."""
    return "".join(chr(t) for t in tokens)


def stream(text, stops, final_at=None):
    """Feed ``text`` one character a token; (deltas, the detokenizer)."""
    detok = Detokenizer(chars, stops)
    deltas = []
    for n in range(1, len(text) + 1):
        deltas.append(detok.update([ord(c) for c in text[:n]]))
        if detok.stopped:
            break
    deltas.append(detok.rest())
    return deltas, detok


def test_the_earliest_stop_string_ends_the_reply_whatever_its_place_in_the_list():
    assert find_stop("abc END x STOP", ["STOP", "END"]) == 4
    assert cut_at_stop("abc END x STOP", ["STOP", "END"]) == "abc "
    assert cut_at_stop("no stop here", ["STOP", ""]) == "no stop here"
    # two stop strings completed by the same token: the one that starts first wins, as a longer one would not
    deltas, detok = stream("say xyz!", ["yz", "xyz"])
    assert detok.stopped and detok.text == "say " and "".join(deltas) == "say "


def test_hold_back_keeps_the_longest_tail_that_may_start_a_stop_string():
    assert settled("hello Us", ["\nUser:", "Use"]) == "hello "  # "Us" may start "Use": held
    assert settled("hello U", ["User", "xU"]) == "hello "  # the longest possible start: one char here
    assert settled("a\nUs", ["\nUser:", "s"]) == "a"  # "\nUs" (3) held, not just the 1 of another stop's
    assert settled("ab\ufffd", []) == "ab"  # a half-decoded character waits for its next byte
    deltas, detok = stream("hi\nUsers\nUser: next", ["\nUser:"])
    assert detok.text == "hi\nUsers" and "".join(deltas) == "hi\nUsers"
    assert "\nU" not in deltas[2] and deltas[2:5] == ["", "", ""]  # "\n", "\nU", "\nUs" held as they come


def test_without_a_stop_the_deltas_add_up_to_the_text_and_final_sends_the_rest():
    deltas, detok = stream("plain text", ["zz"])
    assert not detok.stopped and "".join(deltas) == "plain text"
    detok = Detokenizer(chars, ["END"])
    assert detok.update([ord(c) for c in "abcE"]) == "abc"
    assert detok.update([ord(c) for c in "abcEN"], final=True) == "EN"  # the end (a limit, an EOS): all of it
    assert detok.rest() == ""
