"""The codes Python and the C++ cores share, written once: the MLP's form, the norm's kind, a weight's kind and the
status a core returns. Python uses these ``IntEnum`` s; ``codegen.py`` writes each as a C++ struct of one enum
(``MlpForm::kSwiglu``, ``Status::kBadShape``) into the generated ``cores.h`` every source includes, so a number is
spelled here and nowhere else (``tests/kernels/test_codes.py`` reads the C++ sources for bare codes).

A core returns ``Status.OK`` (0) or the named code of what it refused; a composite (the decoder step, the decode and
training layers) returns the code of the part that failed unchanged, and the decoder step writes the failing layer's
index into its call (``DecoderCall.failed_layer``) beside it: no code is built by arithmetic. ``describe(code)`` is
the message Python shows for a code.
"""
import enum
import textwrap


class MlpForm(enum.IntEnum):
    """The MLP's activation (``DecodeLayerOptions.form``, ``TrainLayerOptions.mlp``, ``DecoderModel.form``;
    ``BiasGeluOptions.form`` and ``LinearGeluOptions.form`` take the two GeLU forms): GeLU's tanh form (GPT-2's
    ``gelu_new``), its quick form (x sigmoid(1.702 x)), its erf form, ReLU, SwiGLU (silu(gate) * up)."""

    TANH = 0
    QUICK = 1
    ERF = 2
    RELU = 3
    SWIGLU = 4


class NormKind(enum.IntEnum):
    """A norm (``DecodeLayerOptions.norm``, ``TrainLayerOptions.norm``, ``DecoderModel.norm``)."""

    LAYER_NORM = 0
    RMS_NORM = 1


class WeightKind(enum.IntEnum):
    """How a weight is held (``DecoderModel.weights``, ``words_kind``, ``head_kind``; the decode layer's cores):
    float32, bfloat16 (its bits), int8 with float32 per-row scales."""

    FLOAT32 = 0
    BFLOAT16 = 1
    INT8 = 2


class Status(enum.IntEnum):
    """What a core or an entry point returns (``describe`` gives each its message)."""

    OK = 0
    BAD_CALL = 1
    BAD_SHAPE = 2
    WORKSPACE = 3
    CACHE_INDEX = 4
    TOKEN_ID = 5
    POSITION = 6
    DROPOUT_OFFSETS = 7
    GEMM = 8


MESSAGES = {
    Status.OK: "done",
    Status.BAD_CALL: "the call does not fit the kernel (a tensor count, dtype or rank, the options vector's length, "
                     "or an option outside its range)",
    Status.BAD_SHAPE: "a dim disagrees with another use of its name, a fixed length or the layer's layout",
    Status.WORKSPACE: "the workspace is smaller than the call needs",
    Status.CACHE_INDEX: "a slot, position or logits column outside the KV cache",
    Status.TOKEN_ID: "a token id or label outside the vocabulary",
    Status.POSITION: "a position past the learned position table",
    Status.DROPOUT_OFFSETS: "a counter dropout's offsets outside its tables",
    Status.GEMM: "oneDNN refused a GEMM",
}

# every enum the C++ sees, in cores.h's order
ENUMS = (MlpForm, NormKind, WeightKind, Status)


def name_of(cls, text):
    """The member of ``cls`` named ``text`` in the model's spelling ("swiglu", "RMSNorm", "bfloat16"): case and
    underscores ignored. A ValueError names the members where none fits."""
    key = text.replace("_", "").lower()
    for member in cls:
        if member.name.replace("_", "").lower() == key:
            return member
    raise ValueError(f"{text!r}: not a {cls.__name__} ({', '.join(m.name.lower() for m in cls)})")


def describe(code):
    """``code`` (an int a core or entry point returned) as "NAME: message" (an unknown code: its number)."""
    try:
        status = Status(int(code))
    except ValueError:
        return f"status {int(code)} (not a Status)"
    return f"{status.name}: {MESSAGES[status]}"


def c_name(member):
    """The C++ constant of ``member``: ``SWIGLU`` -> ``kSwiglu``, ``LAYER_NORM`` -> ``kLayerNorm``."""
    return "k" + "".join(part.capitalize() for part in member.name.split("_"))


def c_enum(cls):
    """``cls`` as C++: a struct holding one unscoped enum of int32 (``MlpForm::kTanh`` converts to the option
    structs' int32 fields and to a core's int status)."""
    doc = " ".join((cls.__doc__ or "").split())
    lines = ["// " + line for line in textwrap.wrap(f"{cls.__name__}: {doc}", 116)]
    lines += [f"struct {cls.__name__} {{", "  enum Code : int32_t {"]
    lines += [f"    {c_name(member)} = {int(member)}," for member in cls]
    return "\n".join(lines + ["  };", "};"])
