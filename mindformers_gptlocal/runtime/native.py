"""The native runner: a causal LM's forward over its KV cache as ONE C++ call a step, no MindSpore graph.

``NativeRunner`` has ``ModelRunner``'s interface (``runner.py``: ``prefill``, ``decode``, ``decode_greedy``, ``step``
with slots and the logits column, ``compile`` (nothing to compile), ``batch_size``, ``max_length``, ``widths``,
``decode_steps``, the caches) and runs each call through ``gptlocal_decoder_step`` (``kernels/csrc/cpu_decoder.cc``:
embedding, every layer of any layout the model builds, the final norm and the head of the asked rows, or only their
argmax for greedy steps). ``runner.py`` ``runner_kind`` chooses it (op ``runner`` of ``cpu_kernels``) on CPU; the
compiled graphs stay the reference it is tested against (``cpu_kernels: {runner: plain}``).

What it reads of the model: its ``Description`` (``model/describe.py``; nothing of ``model/`` is imported here). What
it holds: zero-copy numpy views of the model's Parameters (on CPU ``Parameter.asnumpy()`` shares the
Parameter's host buffer; bfloat16 ones viewed as their uint16 bits), taken when the runner is made and described to
the library once (``DecoderModel``, one ``DecoderLayer`` a layer: ctypes structs of pointers, ``kernels/abi/table.py``);
its KV cache as two numpy arrays [layers, slots, G, max_length, D] float32 (each layer's [slots, G, L, D] block
the compiled runner's layout), zeros the allocator maps only as rows are written; the rope's cos and sin by position;
one workspace for its largest call (``gptlocal_decoder_workspace``) and its input and logits buffers. Nothing else:
no compiled graph, no MindSpore memory pool.

The views stay true: a ``set_data`` gives a Parameter a new buffer, so ``GPTLocalForCausalLM.load_weights`` drops the
model's runners (the next ``kv_cache`` makes new ones), and ``prefill`` (the start of every generation) checks that
each Parameter still holds the buffer the runner points at and takes the views again where one does not; the server's
``step`` calls trust the views of its warm-up (its weights do not change under it).
"""
import ctypes

import numpy as np

from ..kernels.abi import build
from ..kernels.abi.threads import kernel_threads
from ..kernels.abi.codes import MlpForm, NormKind, Status, WeightKind, describe, name_of
from ..kernels.abi.layer_table import LAYER, Linear, Norm
from ..kernels.abi.precision import precision_code
from ..kernels.abi.table import DecoderCache, DecoderCall, DecoderLayer, DecoderModel
from .buckets import greedy_steps, width_buckets

PREFILL_ROWS = 512  # token rows a call at most: a longer prefill runs as several calls of its columns (chunks)


class NativeError(RuntimeError):
    """The library refused a call (its status: a slot, position or token id outside the cache or vocabulary, ...)."""


def failure(status, layer, batch_size, max_length):
    """The message of a step the library refused: its ``Status`` by name (``kernels/abi/codes.py``), the layer whose part
    failed (``layer`` >= 0) and the cache's size."""
    where = f" in layer {layer}" if layer >= 0 else ""
    return (f"gptlocal_decoder_step failed{where}: {describe(status)} (this runner's cache: {batch_size} slots x "
            f"{max_length} positions)")


def _held(param):
    """(numpy view of the Parameter's buffer, its kind): float32, bfloat16 (as uint16 bits) or int8."""
    array = param.asnumpy()
    name = str(array.dtype)
    if name == "bfloat16":
        return array.view(np.uint16), "bfloat16"
    if name in ("float32", "int8"):
        return array, name
    raise NativeError(f"{param.name}: a {name} Parameter; the native runner takes float32, bfloat16 or int8")


class NativeRunner:
    """Prefill, one-token decode and greedy decode of the model ``description`` tells of (``model/describe.py``
    ``Description``) over a cache of ``batch_size`` slots x ``max_length`` rows, as one library call a step; logits
    come back as numpy float32 [B, V]."""

    fresh_kernel = False  # no separate prefill graph: every call attends over the cache (ModelRunner's attribute)

    def __init__(self, description, batch_size, max_length):
        path, reason = build.library()
        if path is None:
            raise NativeError(f"the native runner needs the kernel library: {reason}")
        self.lib = ctypes.CDLL(path)
        self.lib.gptlocal_decoder_step.restype = ctypes.c_int
        self.lib.gptlocal_decoder_step.argtypes = [ctypes.c_void_p] * 4
        self.lib.gptlocal_decoder_workspace.restype = ctypes.c_int64
        self.lib.gptlocal_decoder_workspace.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self.description = description
        self.path = path
        self.batch_size = batch_size
        self.max_length = max_length
        self.widths = width_buckets(max_length)
        self.num_groups = description.groups
        self.vocab = description.vocab
        self.decode_steps = greedy_steps(len(description.layers))
        # "float32", "bfloat16" or "int8": one kind (runner.py runner_kind's check)
        self.weights = description.layer_facts[0].linears
        shape = (len(description.layers), batch_size, description.groups, max_length, description.head_dim)
        self.keys = np.zeros(shape, np.float32)  # calloc: pages mapped as rows are written
        self.values = np.zeros(shape, np.float32)
        self.rows = max(PREFILL_ROWS, batch_size)  # token rows a call at most
        self._describe()
        self.cache = DecoderCache(keys=self.keys.ctypes.data, values=self.values.ctypes.data,
                                  cos=None if self.cos is None else self.cos.ctypes.data,
                                  sin=None if self.sin is None else self.sin.ctypes.data, slots=batch_size,
                                  length=max_length)
        self.work = np.empty(self.lib.gptlocal_decoder_workspace(ctypes.byref(self.model), self.rows, batch_size),
                             np.uint8)
        self.logits = np.empty((batch_size, self.vocab), np.float32)
        self.tokens = np.empty(batch_size, np.int32)
        self.failed_layer = np.full(1, -1, np.int32)  # where a failed call names its layer

    # --- what the library is told, once ------------------------------------------------------------
    def _view(self, param, want=None):
        """The address of ``param``'s buffer (kept referenced here), checked to be of kind ``want``; None for None."""
        if param is None:
            return None
        array, kind = _held(param)
        if want is not None and kind != want:
            raise NativeError(f"{param.name}: {kind}, the runner expects {want}")
        self._views.append((param, array.ctypes.data))
        self._arrays.append(array)
        return array.ctypes.data

    def _linear(self, linear):
        """(weight, scales or None, bias or None) addresses of one Linear (``describe.LinearParams``)."""
        return self._view(linear.weight, self.weights), self._view(linear.scale, "float32"), \
            self._view(linear.bias, "float32")

    def _norm(self, norm):
        return self._view(norm.weight, "float32"), self._view(norm.bias, "float32")

    def _describe(self):
        """The ``DecoderModel`` and ``DecoderLayer`` structs from the model's Parameters as they are now (its
        ``Description``), and the rope tables."""
        d = self.description
        self._views, self._arrays = [], []
        words_kind, head_kind = _held(d.words)[1], _held(d.head)[1]
        final_weight, final_bias = self._norm(d.final_norm)
        if self.weights == "bfloat16" or (self.weights == "float32" and d.kernels.gemm_dtype == "bfloat16"):
            precision = precision_code(self.path, "bfloat16")
        else:
            precision = 0
        self.model = DecoderModel(
            hidden=d.hidden, heads=d.heads, groups=d.groups, head_dim=d.head_dim, inter=d.inter, vocab=d.vocab,
            layers=len(d.layers), norm=NormKind.RMS_NORM if d.rmsnorm else NormKind.LAYER_NORM, rotary_dim=d.rotary_dim, form=name_of(MlpForm, d.mlp_form),
            parallel_residual=int(d.parallel_residual), weights=name_of(WeightKind, self.weights), precision=precision,
            threads=kernel_threads(), max_positions=d.max_positions, words_kind=name_of(WeightKind, words_kind),
            head_kind=name_of(WeightKind, head_kind), epsilon=d.epsilon, words=self._view(d.words),
            words_scale=self._view(d.words_scale, "float32"), positions=self._view(d.positions, "float32"),
            final_weight=final_weight, final_bias=final_bias, head=self._view(d.head),
            head_scale=self._view(d.head_scale, "float32"))
        layers = DecoderLayer.array(len(d.layers))
        for struct, layer in zip(layers, d.layers):
            struct.scale = layer.scale
            for part in LAYER:  # DecoderLayer's fields (layer_table.py decoder_layer_fields), null where absent
                params = layer.parts[part.name]
                if params is None:
                    continue
                if isinstance(part, Norm):
                    fields, values = (f"{part.name}_weight", f"{part.name}_bias"), self._norm(params)
                elif isinstance(part, Linear):
                    fields, values = (part.name, f"{part.name}_scale", f"{part.name}_bias"), self._linear(params)
                else:
                    fields, values = (part.name,), (self._view(params, "float32"),)
                for field, value in zip(fields, values):
                    setattr(struct, field, value)
        self.layer_structs = layers
        self.cos, self.sin = d.rope(self.max_length)

    def _current(self):
        """True while every Parameter still holds the buffer the structs point at (``data_ptr``: ~0.3 us a
        Parameter, where ``asnumpy`` takes ~35)."""
        return all(param.data_ptr() == address for param, address in self._views)

    # --- the caches, as the compiled runner's callers read them --------------------------------------------
    @property
    def key_caches(self):
        """Each layer's key cache [slots, G, L, D] as a Tensor sharing this runner's memory."""
        from mindspore import Tensor  # pylint: disable=import-outside-toplevel
        return tuple(Tensor.from_numpy(layer) for layer in self.keys)

    @property
    def value_caches(self):
        from mindspore import Tensor  # pylint: disable=import-outside-toplevel
        return tuple(Tensor.from_numpy(layer) for layer in self.values)

    # --- calls ---------------------------------------------------------------------------------------------
    def _call(self, ids, positions, slots, last, logits=True, tokens=False):
        """One library call on host arrays: ids, positions [b, S] int32, slots, last [b]; fills ``self.logits[:b]``
        and / or ``self.tokens[:b]``."""
        batch, width = ids.shape
        if batch * width > self.rows or batch > self.batch_size:
            raise NativeError(f"a call of {batch} x {width} tokens; this runner takes {self.batch_size} rows and "
                              f"{self.rows} tokens a call")
        call = DecoderCall(ids=ids.ctypes.data, positions=positions.ctypes.data, slots=slots.ctypes.data,
                           last=last.ctypes.data, batch=batch, width=width,
                           logits=self.logits.ctypes.data if logits else None,
                           tokens=self.tokens.ctypes.data if tokens else None, work=self.work.ctypes.data,
                           work_bytes=self.work.nbytes, failed_layer=self.failed_layer.ctypes.data)
        status = self.lib.gptlocal_decoder_step(ctypes.byref(self.model), self.layer_structs,
                                                ctypes.byref(self.cache), ctypes.byref(call))
        if status != Status.OK:
            raise NativeError(failure(status, int(self.failed_layer[0]), self.batch_size, self.max_length))

    def step(self, ids, positions, last_index, slots=None):
        """One call on host arrays: next-token logits [b, V] as numpy float32 (``ModelRunner.step``'s contract:
        ``slots`` the cache slot of each of the b <= batch_size rows, default row i = slot i; each row's keys and
        values written at (its slot, its positions), each row attending to its slot's rows 0..position).
        More than ``rows`` tokens run as several calls of their columns."""
        ids = np.ascontiguousarray(ids, np.int32)
        positions = np.ascontiguousarray(positions, np.int32)
        last = np.ascontiguousarray(last_index, np.int32).reshape(-1)
        slots = np.arange(ids.shape[0], dtype=np.int32) if slots is None else np.ascontiguousarray(slots, np.int32)
        batch, width = ids.shape
        columns = max(1, self.rows // batch)
        if width <= columns:
            self._call(ids, positions, slots, last)
            return self.logits[:batch].copy()
        out = np.empty((batch, self.vocab), np.float32)
        for start in range(0, width, columns):
            stop = min(width, start + columns)
            here = (last >= start) & (last < stop)
            self._call(np.ascontiguousarray(ids[:, start:stop]), np.ascontiguousarray(positions[:, start:stop]),
                       slots, np.where(here, last - start, 0).astype(np.int32))
            out[here] = self.logits[:batch][here]
        return out

    def compile(self, ids, positions, last_index, slots=None):
        """Nothing to compile (``ModelRunner.compile``'s place in the server's warm-up)."""

    def prefill(self, prompts, pad_id=0):
        """Write the right-padded prompts into rows 0..W-1 (W: the longest prompt; no width buckets: nothing is
        compiled per width); logits after each prompt's last token. Checks first that the Parameters still hold the
        buffers this runner points at (a ``set_data`` since: the views taken again)."""
        if not self._current():
            self._describe()
        lengths = np.array([len(p) for p in prompts], np.int32)
        ids = np.full((self.batch_size, int(lengths.max())), pad_id, np.int32)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        positions = np.tile(np.arange(ids.shape[1], dtype=np.int32), (self.batch_size, 1))
        last = np.zeros(self.batch_size, np.int32)
        last[:len(prompts)] = lengths - 1
        return self.step(ids, positions, last)

    def decode(self, tokens, positions):
        """Write one token per sequence at its own position; logits after it."""
        tokens = np.asarray(tokens, np.int32)
        return self.step(tokens[:, None], np.asarray(positions, np.int32)[:, None], np.zeros(len(tokens), np.int32))

    def decode_greedy(self, tokens, positions, with_logits=False):
        """``decode_steps`` greedy steps (``ModelRunner.decode_greedy``'s contract): token t_0 [B] written at
        ``positions``, each next token the argmax after the previous one (computed in the library: no logits copied
        unless ``with_logits``), written at the next position (clamped to the cache's last row: such steps are ones
        the caller discards). Returns the picks [B, decode_steps] (and the logits [B, decode_steps, V])."""
        tokens = np.ascontiguousarray(tokens, np.int32)
        batch = tokens.shape[0]
        positions = np.asarray(positions, np.int32)
        slots = np.arange(batch, dtype=np.int32)
        last = np.zeros(batch, np.int32)
        picks = np.empty((batch, self.decode_steps), np.int32)
        seen = np.empty((batch, self.decode_steps, self.vocab), np.float32) if with_logits else None
        ids = tokens[:, None].copy()
        for step in range(self.decode_steps):
            where = np.minimum(positions + step, self.max_length - 1).astype(np.int32)[:, None]
            self._call(ids, where, slots, last, logits=with_logits, tokens=True)
            picks[:, step] = self.tokens[:batch]
            if with_logits:
                seen[:, step] = self.logits[:batch]
            ids[:, 0] = self.tokens[:batch]
        return (picks, seen) if with_logits else picks
