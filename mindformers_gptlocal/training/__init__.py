"""Training's MindSpore pieces: optimizer, gradient checks, callbacks, metric, the safe stop on a signal (the train-step
wrappers, subclasses of MindFormers' step, are ``mf/wrapper.py``)."""
