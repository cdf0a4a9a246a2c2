"""Dropout whose masks are a function of (seed, step, site, element), so a resumed run draws the same ones.

MindSpore's ``Dropout`` keeps its random state inside the kernel: it is not saved with a checkpoint, so after
a resume the masks differ from the uninterrupted run's. MindSpore 2.7.2 has no CPU kernel for the
generator-based ops whose state could be saved (``DropoutExt``, ``rand_like``: "Unsupported op ... on CPU").
So the masks come from two fixed random bit tables, drawn with numpy from ``dropout_seed`` when the model
is built (65,521 and 65,537 entries, coprime), each read cyclically from an offset that the step counter and
the dropout site pick:

    dropped[i] = B1[(i + a) % P1] XOR B2[(i + b) % P2],   a, b = functions of (step, site)

for element i of the flattened tensor. Each bit is 1 with probability q, where 2q(1 - q) = p (for p > 0.5
the XOR marks the kept elements instead). The pair of table positions repeats only after P1 * P2 (4.3e9)
elements, and each step and site shifts the two tables by different amounts. A rolled copy of each table
(a gather of 65k entries), tiled to the tensor's size, then one comparison: the same bits on CPU, GPU and
Ascend, and the same mask when recompute runs a layer's forward again (the step is an input, not a state).
The counter (``GPTLocalForCausalLM.dropout_step``, read and advanced by ``DropoutCounter``) counts forward
calls, so micro-batches of one step get different masks; it is saved in training checkpoints (not in model
weights) and comes back on resume.
"""
import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ..parallel.sharding import LINEAR_SPLITS, is_parallel_build

TABLE_SIZES = (65521, 65537)
STEP_MULTIPLIERS = (7919, 6007)  # per table: (step % P) * m < 2**31
SITE_MULTIPLIERS = (104729, 3571)
_TABLES = {}


def bit_probability(p):
    """q with 2q(1 - q) = min(p, 1 - p): two independent bits with P(1) = q differ with that probability."""
    rate = min(p, 1.0 - p)
    return (1.0 - np.sqrt(1.0 - 2.0 * rate)) / 2.0


def tables(seed, p):
    """The two bit tables (float32 0/1) for ``seed`` and rate ``p`` (shared by the sites of a model)."""
    key = (seed, round(p, 12))
    if key not in _TABLES:
        rng = np.random.default_rng(seed)
        q = bit_probability(p)
        _TABLES[key] = tuple(Tensor((rng.random(size) < q).astype(np.float32)) for size in TABLE_SIZES)
    return _TABLES[key]


class CounterDropout(nn.Cell):
    """Inverted dropout with probability ``p`` at dropout site ``site`` (a number unique in the model).

    ``construct(x, step)``: ``step`` an int32 scalar tensor; identity when not training or when ``step`` is None
    (decided when the graph is compiled, not on tensor values), and for ``p`` 0. What the training forward does is
    picked here from ``p`` (``drop``: nothing, zeros for ``p`` >= 1, the counter mask), and which of the two table
    bits' relations keeps an element (``kept``), never in ``construct``."""

    def __init__(self, p, site, seed=0):
        super().__init__()
        self.p = float(p)
        self.site = int(site)
        self.keep_when_differ = self.p > 0.5
        if 0.0 < self.p < 1.0:
            self.bits1, self.bits2 = tables(int(seed), self.p)
        self.range1 = Tensor(np.arange(TABLE_SIZES[0], dtype=np.int32))
        self.range2 = Tensor(np.arange(TABLE_SIZES[1], dtype=np.int32))
        self.gather1, self.gather2 = ops.Gather(), ops.Gather()
        self.scale = 1.0 / (1.0 - self.p) if self.p < 1.0 else 0.0
        self.drop = self._keep_all if self.p == 0.0 else (self._drop_all if self.p >= 1.0 else self._drop_masked)
        self.kept = self._differ if self.keep_when_differ else self._same

    def construct(self, x, step=None):
        if not self.training or step is None:
            return x
        return self.drop(x, step)

    def _keep_all(self, x, step):  # pylint: disable=unused-argument
        return x

    def _drop_all(self, x, step):  # pylint: disable=unused-argument
        return x * 0.0

    def _drop_masked(self, x, step):
        return x * ops.cast(self.keep(x, step), x.dtype) * self.scale

    def _differ(self, differ):
        return differ

    def _same(self, differ):
        return ops.logical_not(differ)

    def keep(self, x, step):
        """bool [x.shape]: which elements stay."""
        return self.keep_shape(x.shape, step)

    def _offsets(self, step):
        """The two tables' offsets (a, b) of this step and site, int32 scalars."""
        (p1, p2), (m1, m2), (s1, s2) = TABLE_SIZES, STEP_MULTIPLIERS, SITE_MULTIPLIERS
        step = ops.cast(step, ms.int32)
        a = ops.floor_mod(ops.floor_mod(step, p1) * m1 + self.site * s1, p1)
        b = ops.floor_mod(ops.floor_mod(step, p2) * m2 + self.site * s2, p2)
        return a, b

    def offsets(self, step):
        """int32 [2]: (a, b) of this step and site, for a kernel that draws the same masks itself
        (``kernels/csrc/cpu_attention.cc``)."""
        a, b = self._offsets(step)
        return ops.stack((ops.reshape(a, ()), ops.reshape(b, ())))

    def keep_shape(self, shape, step):
        """bool mask of ``shape``: which elements of a tensor of that shape stay (``keep``)."""
        (p1, p2) = TABLE_SIZES
        a, b = self._offsets(step)
        rolled1 = self.gather1(self.bits1, ops.floor_mod(self.range1 + a, p1), 0)  # B1[(j + a) % P1]
        rolled2 = self.gather2(self.bits2, ops.floor_mod(self.range2 + b, p2), 0)
        size = 1
        for dim in shape:
            size *= dim
        bits1 = ops.tile(rolled1, ((size + p1 - 1) // p1,))[:size]
        bits2 = ops.tile(rolled2, ((size + p2 - 1) // p2,))[:size]
        return ops.reshape(self.kept(ops.not_equal(bits1, bits2)), shape)


class KernelDropout(nn.Dropout):
    """MindSpore's Dropout behind the same ``(x, step)`` call; the step is ignored (its masks do not resume)."""

    def construct(self, x, step=None):
        return super().construct(x)


class LayerDrop(CounterDropout):
    """LayerDrop (Fan et al. 2019, "Reducing Transformer Depth on Demand with Structured Dropout"): in training
    a whole layer is skipped with probability ``p``, for the whole batch of a forward, by multiplying the
    layer's residual updates (attention and MLP) by one 0/1 draw of the counter stream above (site
    ``LAYERDROP_SITE + layer_number``), so a resumed run skips the same layers. No rescaling (fairseq's
    LayerDrop has none either): at eval and in generation every layer runs. A skipped layer is still computed;
    its update is multiplied by 0 (no Python control flow on tensor values in ``construct``)."""

    def _drop_masked(self, x, step):
        return x * ops.cast(self.keep_shape((1,), step), x.dtype)


LAYERDROP_SITE = 10000  # LayerDrop sites: 10000 + layer_number, apart from the 3 dropout sites per layer (< 2**31
# in _offsets up to layer ~5,500)


def make_layerdrop(config, layer_number, counter):
    """The LayerDrop Cell of one layer, or None without ``model_config.layerdrop``."""
    p = config.layerdrop
    if p == 0.0:
        return None
    if not counter:
        from ..errors import ConfigError
        raise ConfigError(f"model_config.layerdrop {p} needs counter-based dropout, which gpt_local uses only with "
                          f"parallel_mode 0 (stand-alone or data parallel); set layerdrop: 0 for semi-auto/auto "
                          f"parallel runs.")
    return LayerDrop(p, LAYERDROP_SITE + layer_number, config.dropout_seed)


def counter_dropout_build():
    """True where this build may draw counter-based masks: stand-alone or data parallel (``parallel_mode`` 0), where
    every rank holds whole tensors. Under semi-auto/auto parallel their index arithmetic would need shard
    strategies, and the counter would be shared across pipeline stages; there MindSpore's own Dropout is kept (its
    masks do not resume)."""
    return not is_parallel_build()


def counter_dropout_enabled(config):
    """Counter-based dropout when some dropout (or LayerDrop) is on and the build allows it
    (``counter_dropout_build``)."""
    spec = config.pet_spec()  # LoRA's lora_dropout, the prefix's dropout (peft/)
    rates = (config.hidden_dropout, config.attention_dropout, config.embedding_dropout, config.layerdrop,
             0.0 if spec is None else spec.dropout_rate)
    return any(rate > 0 for rate in rates) and counter_dropout_build()


# Dropout sites, numbered once here: 0 the embedding's, then three per layer (layer_number counts from 1);
# the prefix-tuning prefix's (model/prefix_cells.py) is -1, below every layer's and LayerDrop's 10000+ at any depth
# (_offsets takes it modulo the table sizes)
SITES_PER_LAYER = 3
LAYER_SITES = {"attention_probs": 1, "attention_output": 2, "mlp_output": 3}
PREFIX_SITE = -1


# LoRA's input dropouts (lora_dropout, one site per adapted Linear): LORA_SITE + 5 (layer_number - 1) + the Linear's
# index in LORA_LINEARS (a block's 5 Linear paths, parallel/sharding.py's order), 5000-9999 up to layer 1,000, apart
# from the layers' 3 per layer (< 5000 up to layer 1,666) and LayerDrop's 10000+
LORA_SITE = 5000
LORA_LINEARS = tuple(LINEAR_SPLITS)


def lora_dropout_site(layer_number, linear):
    """The site number of LoRA's input dropout on ``linear`` (a path of ``LORA_LINEARS``) of a layer."""
    return LORA_SITE + len(LORA_LINEARS) * (layer_number - 1) + LORA_LINEARS.index(linear)


def dropout_site(layer_number=0, part="embedding"):
    """The site number of a dropout: ``part`` "embedding" (layer_number 0), "prefix" (the prefix-tuning
    prefix's, one per model), or one of ``LAYER_SITES`` of a layer."""
    if part == "embedding":
        return 0
    if part == "prefix":
        return PREFIX_SITE
    return SITES_PER_LAYER * (layer_number - 1) + LAYER_SITES[part]


class DropoutCounter(nn.Cell):
    """Reads and advances the forward counter of counter-based dropout. The counter itself is a Parameter
    of the model at its top level (``new_counter``), so checkpoints keep its name ``dropout_step``
    (``params.DROPOUT_STEP``): a Parameter held by this Cell would be saved as ``<attribute>.dropout_step``."""

    def __init__(self):
        super().__init__()
        self.one = Tensor(1, ms.int32)

    @staticmethod
    def new_counter(name):
        """The counter Parameter, int32 0, not trained."""
        return Parameter(Tensor(0, ms.int32), name=name, requires_grad=False)

    def read(self, counter):
        """This forward's step: a copy read before ``advance``."""
        return counter * 1

    def advance(self, value, counter):
        """``value`` once the counter has moved on by one forward."""
        return ops.depend(value, ops.assign_add(counter, self.one))


def make_dropout(p, site, config, counter):
    """The dropout Cell for one site (``dropout_site``): ``CounterDropout`` when ``counter``, else MindSpore's."""
    if counter:
        return CounterDropout(p, site, config.dropout_seed)
    return KernelDropout(p=p)
