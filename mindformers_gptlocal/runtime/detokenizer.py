"""Generated tokens -> text, incrementally, with stop strings: the one detokenizer of ``generate``, ``chat``,
``serve`` (and the eval's ``generate_until`` cut), after vLLM v1's ``IncrementalDetokenizer``.

Stop strings behave as in the OpenAI API and vLLM: the text ends just before the earliest occurrence of any stop
string, which is not part of the reply. While streaming, a tail that may still become a stop string (the longest
suffix that is a prefix of one of them) and a half-decoded character (``\\ufffd``) are held back, and sent once
the next tokens settle them (or at the end).
"""


def find_stop(text, stops):
    """Index of the earliest occurrence of any of ``stops`` in ``text``, or -1."""
    return min((p for p in (text.find(s) for s in stops if s) if p >= 0), default=-1)


def cut_at_stop(text, stops):
    """``text`` up to (without) its earliest stop string."""
    cut = find_stop(text, stops)
    return text if cut < 0 else text[:cut]


def settled(text, stops):
    """What of ``text`` can be sent now: no half-decoded character at the end, no tail that may start a stop
    string (the longest such tail is held)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return text[:len(text) - hold] if hold else text


class Detokenizer:
    """The text of one sequence's generated tokens. ``decode(tokens) -> str``: the tokenizer's; ``stop``: stop
    strings. ``update(tokens)`` (every generated token so far, an EOS left out by the caller) returns the new text
    that may be sent; ``stopped`` turns True once a stop string appeared (``text`` is then cut before it);
    ``update(..., final=True)`` and ``rest()`` send what was held back."""

    def __init__(self, decode, stop=()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.text = ""  # the reply so far, cut at a stop string
        self.sent = ""  # the part of it handed out
        self.stopped = False

    def update(self, tokens, final=False):
        """Decode ``tokens``; the text that can be sent now (``final``: everything)."""
        text = self.decode(tokens)
        cut = find_stop(text, self.stop)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        self.text = text
        return self._send(text if final or self.stopped else settled(text, self.stop))

    def rest(self):
        """What was held back (the end of the reply)."""
        return self._send(self.text)

    def _send(self, safe):
        if not safe.startswith(self.sent):  # a decode that rewrote earlier text: wait for the end
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta
