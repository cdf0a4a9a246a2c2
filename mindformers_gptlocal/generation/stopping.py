"""When a sequence stops: the one rule of the host decode loop (``loop.decode_loop``: ``model.generate``,
``gptlocal generate`` / ``chat``, the eval's ``generate_until``) and of the server's scheduler (``serve/scheduler.py``).

A sequence that has just taken a token ends

* ``"stop"`` when the token is one of its EOS ids (the token is not part of the reply's text), else
* ``"stop"`` when a stop string appeared in its text (asked of the caller, which holds the text: ``generate``'s
  ``stop_when`` hook, the server's ``Detokenizer``; only when the token is not EOS), else
* ``"length"`` once it has its budget of new tokens (``max_new_tokens``, capped by the KV cache's rows).

EOS wins over a stop string, and both over the budget: a reply whose last token is EOS ends "stop" even when the
budget is reached with it (OpenAI's ``finish_reason``).
"""
STOP, LENGTH = "stop", "length"


class StopRule:
    """The stop conditions of one sequence (or of a batch sharing its EOS ids and budget): ``eos``, the ids that end
    it; ``budget``, the most new tokens it may have."""

    def __init__(self, eos, budget):
        self.eos = frozenset(int(t) for t in eos)
        self.budget = int(budget)

    def is_eos(self, token):
        """Whether ``token`` ends the sequence as an EOS id (its text is then that of the tokens before it)."""
        return int(token) in self.eos

    def finish(self, token, produced, matched=False):
        """Why the sequence ends now that it took ``token``, its ``produced``-th new token: ``"stop"`` (``token`` is
        EOS, or ``matched``: a stop string appeared in its text), ``"length"`` (``produced`` reached the budget), or
        None (it goes on)."""
        if self.is_eos(token) or matched:
            return STOP
        return LENGTH if produced >= self.budget else None
