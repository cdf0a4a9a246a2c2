"""``gptlocal serve``: an OpenAI-compatible server (``app.py``: FastAPI routes, ``protocol.py``: request checks,
``scheduler.py``: the continuous-batching engine on one model thread). Needs the ``[serve]`` extra."""
