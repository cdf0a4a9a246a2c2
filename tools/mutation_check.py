"""Break the code on purpose and check the tests notice: realistic one-line mutations, each run against the
tests that cover its code. Run it before a release (not in CI; well over an hour on 2 cores, two jobs at once):

    python tools/mutation_check.py                  # all mutations, prints caught / missed
    python tools/mutation_check.py --jobs 1         # one at a time (each job has its own scratch copy)
    python tools/mutation_check.py --only wrapper   # the mutations whose name contains "wrapper"
    python tools/mutation_check.py --list
    python tools/mutation_check.py --check-stale    # only: does every snippet still match? (no tests; CI runs it)

Each mutation replaces one exact snippet of a source file in a scratch copy of the repository (the
working tree is never touched) and runs ``python -m pytest -x`` on its tests there. Caught: the tests
fail. Missed: they pass. Before anything runs, every snippet must be found exactly once in its file and
every test file must exist: a stale one fails the tool at once (exit 3, each named), so the list keeps up
with the code; ``--check-stale`` does only that (``tests/tools/test_mutation_check.py`` runs it in the suite).
Then every test selection runs once unmutated and must pass (a broken copy would otherwise count every
mutation as caught). Own code rather than mutmut: mutmut mutates every line and runs the whole suite
per mutant (hours here); these are the bugs a person would write, each with its few relevant tests.
"""
import argparse
import concurrent.futures
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "mindformers_gptlocal/"

Mutation = namedtuple("Mutation", "name path old new tests")

COMPAT_TESTS = ["tests/mf/test_mindformers_compat.py"]
PLANNER_TESTS = ["tests/plan/test_plan_values.py", "tests/plan/test_planner.py", "-k", "not cpu_estimate_is_within"]
MUTATIONS = [
    # model
    Mutation("attention scaled by 1/head_dim", PKG + "model/attention.py",
             "scale = 1.0 / math.sqrt(self.head_dim)", "scale = 1.0 / self.head_dim",
             ["tests/generation/test_generation.py"]),
    Mutation("causal mask lets a token see the next one", PKG + "model/gpt.py",
             "return ops.less_equal(index, ops.reshape(index, (seq, 1)))",
             "return ops.less_equal(index, ops.reshape(index, (seq, 1)) + 1)",
             ["tests/model/test_model.py", "-k", "causality"]),
    Mutation("attention residual dropped", PKG + "model/gpt.py",
             "hidden = block.add(hidden, attn)\n        mlp = block.mlp(",
             "hidden = attn\n        mlp = block.mlp(",
             ["tests/generation/test_generation.py"]),
    Mutation("adapter up-projection not zero-initialised", PKG + "model/adapter_cells.py",
             "        self.linear_up.weight.set_data(ops.zeros(self.linear_up.weight.shape, params_dtype))\n", "",
             ["tests/peft/test_adapter.py", "-k", "leaves_the_logits_unchanged"]),
    Mutation("LayerDrop draws one mask for every layer", PKG + "model/dropout.py",
             "return LayerDrop(p, LAYERDROP_SITE + layer_number,", "return LayerDrop(p, LAYERDROP_SITE,",
             ["tests/peft/test_adapter.py", "-k", "without_the_skipped_layers"]),
    Mutation("final LayerNorm skipped", PKG + "model/gpt.py", "return self.final_layernorm(hidden)",
             "return hidden", ["tests/generation/test_generation.py"]),
    Mutation("position embeddings ignored", PKG + "model/gpt.py",
             "return words + embedding.position_gather(embedding.position_embeddings, position_ids, 0)",
             "return words", ["tests/generation/test_generation.py"]),
    Mutation("residual projections not scaled at init", PKG + "model/layers.py",
             "return config.initializer_range / math.sqrt(2.0 * config.num_hidden_layers)",
             "return config.initializer_range", ["tests/model/test_model.py"]),
    Mutation("loss_mask ignored", PKG + "model/gpt.py",
             "keep = keep * ops.cast(ops.reshape(loss_mask, (-1,)), ms.float32)", "keep = keep",
             ["tests/model/test_model.py"]),
    Mutation("CPU GeLU backward loses the cubic term", PKG + "model/layers.py",
             "(TANH_GELU_SCALE * (1.0 + 3.0 * 0.044715 * square))", "(TANH_GELU_SCALE * (1.0 + 0.044715 * square))",
             ["tests/model/test_model.py"]),
    Mutation("LoRA layer spec ignores target_modules", PKG + "model/lora_cells.py",
             'for linear in LINEARS if is_target(spec, f"model.layers.{index}.{linear}")}', "for linear in LINEARS}",
             ["tests/kernels/test_norm_gelu_kernel.py", "-k", "quick_lora"]),
    Mutation("LoRA's input dropout never gets the model's step", PKG + "model/lora_cells.py",
             "self.lora_dropout(x, dropout_step)", "self.lora_dropout(x, None)",
             ["tests/kernels/test_lora_dropout_kernel.py", "-k", "tiny_lora_model"]),
    Mutation("block ignores the layer spec's adapter", PKG + "model/gpt.py",
             'self.mlp_adapter = layer_spec["mlp_adapter"](kernels=kernels) if "mlp_adapter" in layer_spec '
             'else Unchanged()',
             "self.mlp_adapter = Unchanged()",
             ["tests/peft/test_adapter.py", "-k", "leaves_the_logits_unchanged"]),
    Mutation("a PEFT method's tensors frozen with the base", PKG + "peft/prefix.py",
             "return not is_prefix_name(name)  # the base model is frozen", "return True  # the base model is frozen",
             ["tests/peft/test_registry.py"]),
    Mutation("a checkpoint's PEFT tensors ignored when the model has none", PKG + "model/weights.py",
             "raise CheckpointError(method.loaded_without(found[0]))", "pass",
             ["tests/peft/test_lora.py", "-k", "merge_equals"]),
    Mutation("MultiLoRA adapters served without their alpha / r", PKG + "model/lora_cells.py",
             "                    scales[k] = scaling\n", "                    scales[k] = 1.0\n",
             ["tests/serve/test_serve_lora.py", "-k", "alone_equals"]),
    Mutation("kernel fallback warned once per layer", PKG + "kernels/abi/build.py",
             "    if (off, reason) in _WARNED:\n        return\n", "",
             ["tests/kernels/test_cpu_attention_kernel.py", "-k", "fp16_and_plain"]),
    Mutation("kernel provider ignores a plain mode", PKG + "kernels/provider.py",
             'if self.device_target != "CPU" or self.modes[op] == "plain":', 'if self.device_target != "CPU":',
             ["tests/kernels/test_provider.py"]),
    Mutation("a kernel reads an options vector of another length", PKG + "kernels/csrc/aot.h",
             "ndims[p] != 1 || shapes[p][0] != sig.option_words) {", "ndims[p] != 1) {",
             ["tests/kernels/test_table.py", "-k", "options_of_another_length"]),
    Mutation("an entry point binds a size to its last use, unchecked", PKG + "kernels/csrc/aot.h",
             "if (bound[dim.value] && call->size[dim.value] != length) return Status::kBadShape;", "",
             ["tests/kernels/test_table.py", "-k", "binds_as_the_table_says"]),
    Mutation("Linear's GEMM kernel from one row past its threshold", PKG + "kernels/provider.py",
             "(not training and (rows >= from_rows or", "(not training and (rows > from_rows or",
             ["tests/kernels/test_linear_gemm_kernel.py"]),
    Mutation("the GEMM kernel drops Linear's bias", PKG + "kernels/csrc/cpu_linear.cc",
             "for (int64_t t = 0; t < T; ++t) std::copy(b + n0, b + n1, out + t * N + n0);",
             "for (int64_t t = 0; t < T; ++t) std::fill(out + t * N + n0, out + t * N + n1, 0.0f);",
             ["tests/kernels/test_linear_gemm_kernel.py"]),
    Mutation("a forked child keeps its parent's worker pool", PKG + "kernels/csrc/common.h",
             "if (current == nullptr || owner.load(std::memory_order_acquire) != pid) {\n      std::lock_guard",
             "if (current == nullptr) {\n      std::lock_guard", ["tests/kernels/test_worker_pool.py"]),
    Mutation("the worker pool's caller returns before its workers end", PKG + "kernels/csrc/common.h",
             "spin_end(); pending_.load(std::memory_order_acquire) != 0;", "spin_end(); false;",
             ["tests/kernels/test_worker_pool.py"]),
    Mutation("the GeLU epilogue applies the quick form for tanh", PKG + "kernels/csrc/cpu_linear.cc",
             "for (int64_t n = n0; n < n1; ++n) yr[n] = gelu_tanh(hr[n]);",
             "for (int64_t n = n0; n < n1; ++n) yr[n] = gelu_quick(hr[n]);",
             ["tests/kernels/test_linear_epilogue.py", "-k", "gelu_epilogue"]),
    Mutation("the GeLU epilogue's backward skips gelu'(h)", PKG + "kernels/csrc/cpu_linear.cc",
             "dhr[n] = gelu_tanh_grad(hr[n], dyr[n]);", "dhr[n] = dyr[n];",
             ["tests/kernels/test_linear_epilogue.py", "-k", "gelu_epilogue"]),
    Mutation("the residual epilogue drops the residual", PKG + "kernels/csrc/cpu_linear.cc",
             "for (int64_t n = n0; n < n1; ++n) yr[n] = r[n] + b[n];",
             "for (int64_t n = n0; n < n1; ++n) yr[n] = b[n];",
             ["tests/kernels/test_linear_epilogue.py", "-k", "residual"]),
    Mutation("the residual epilogue's backward loses d residual", PKG + "kernels/cells/linear.py",
             "return dx, dweight, self.bias_grad(dout, 0), dout, ops.zeros_like(config)",
             "return dx, dweight, self.bias_grad(dout, 0), ops.zeros_like(dout), ops.zeros_like(config)",
             ["tests/kernels/test_linear_epilogue.py", "-k", "residual"]),
    Mutation("the epilogues run float32 GEMMs for bf16", PKG + "kernels/cells/linear.py",
             "code = precision_code(library_path, precision, emulate)", "code = 0",
             ["tests/kernels/test_linear_epilogue.py", "-k", "bf16_epilogue"]),
    Mutation("the epilogue MLP drops fc1's bias", PKG + "model/gpt.py",
             "inner = self.epilogue.gelu(x, ops.cast(fc1.weight, dtype), ops.cast(fc1.bias, dtype))",
             "inner = self.epilogue.gelu(x, ops.cast(fc1.weight, dtype), ops.zeros_like(fc1.bias))",
             ["tests/model/test_gemm_epilogue.py", "-k", "training_step and float32"]),
    Mutation("gemm_epilogue: plain still fuses", PKG + "kernels/provider.py",
             'all(self.uses(op) for op in ("gemm_epilogue", "linear", "bias_gelu"))',
             'all(self.uses(op) for op in ("linear", "bias_gelu"))',
             ["tests/model/test_gemm_epilogue.py", "-k", "which_builds"]),
    Mutation("gemm_epilogue: auto fuses", PKG + "kernels/provider.py",
             'if compute_dtype != ms.float32 or self.modes["gemm_epilogue"] == "auto" or',
             "if compute_dtype != ms.float32 or", ["tests/model/test_gemm_epilogue.py", "-k", "which_builds"]),
    Mutation("bf16 rounding truncates instead of rounding to nearest even", PKG + "kernels/csrc/common.h",
             "const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;",
             "const uint32_t rounded = bits >> 16;",
             ["tests/kernels/test_cores.py", "tests/kernels/test_linear_bf16.py"]),
    Mutation("bf16 rounding turns a NaN of low payload into infinity", PKG + "kernels/csrc/common.h",
             "? (bits >> 16) | 0x40u : rounded);", "? (bits >> 16) : rounded);",
             ["tests/kernels/test_cores.py", "-k", "bf16_rounding"]),
    Mutation("the bf16 backward GEMMs take dy unrounded", PKG + "kernels/cells/linear.py",
             "dy = round_bf16(dout)", "dy = dout", ["tests/kernels/test_linear_bf16.py"]),
    Mutation("compute_dtype bfloat16 on CPU runs float32 GEMMs", PKG + "kernels/provider.py",
             'gemm = linear_gemm_kernel(compute_dtype, precision=self.gemm_dtype or "float32",',
             'gemm = linear_gemm_kernel(compute_dtype, precision="float32",',
             ["tests/kernels/test_linear_bf16.py", "tests/model/test_bf16_model.py"]),
    Mutation("the bf16 GEMM converts its weight into the input's buffer", PKG + "kernels/csrc/cpu_linear.cc",
             "if (wb == nullptr) wb = lin_to_bf16(kWeight, threads, w, N * K);",
             "if (wb == nullptr) wb = lin_to_bf16(kInput, threads, w, N * K);",
             ["tests/kernels/test_linear_bf16.py"]),
    # the derived bounds of issue 60 still catch a real bug (tests/references.py sum_error_bound, errors of one size)
    Mutation("the attention backward drops the softmax's row term", PKG + "kernels/csrc/cpu_attention.cc",
             "for (int j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - row);",
             "for (int j = 0; j < n; ++j) dp[j] = p[j] * dp[j];",
             ["tests/kernels/test_cpu_attention_kernel.py", "-k", "matches_plain_causal"]),
    # every ISA tier's path tested by capping the ISA (issue 60): the plain few-row GEMMs run only below AVX2
    Mutation("the scalar few-row GEMM drops the bias", PKG + "kernels/csrc/cpu_decoder.cc",
             "y[t * N + n] = b != nullptr ? sum + b[n] : sum;", "y[t * N + n] = sum;",
             ["tests/kernels/test_cpu_isa.py", "-k", "decoders_linear"]),
    Mutation("the scalar int8 rows skip the last product", PKG + "kernels/csrc/cpu_decoder.cc",
             "for (int64_t k = 0; k < K; ++k) acc += static_cast<int32_t>(x[k]) * static_cast<int32_t>(wr[k]);",
             "for (int64_t k = 0; k + 1 < K; ++k) acc += static_cast<int32_t>(x[k]) * static_cast<int32_t>(wr[k]);",
             ["tests/kernels/test_cpu_isa.py", "-k", "decoders_linear"]),
    Mutation("the bf16 model's GEMMs run in float32 (the model test alone)", PKG + "kernels/provider.py",
             'gemm = linear_gemm_kernel(compute_dtype, precision=self.gemm_dtype or "float32",',
             'gemm = linear_gemm_kernel(compute_dtype, precision="float32",',
             ["tests/model/test_bf16_model.py", "-k", "kernel_equals_plain"]),
    Mutation("bf16 weights: the bf16-weight kernel reads its weight one element late", PKG + "kernels/csrc/cpu_linear.cc",
             "lin_forward_bias(x, nullptr, w, b, y, T, K, N, options);",
             "lin_forward_bias(x, nullptr, w + 1, b, y, T, K, N, options);",
             ["tests/model/test_bf16_weights.py", "-k", "kernel_equals"]),
    Mutation("bf16 weights: the loader truncates a float32 weight to bf16", PKG + "safetensors_io.py",
             "flat[begin:begin + block.size] = to_bfloat16_bits(block)",
             "flat[begin:begin + block.size] = (block.view(np.uint32) >> 16).astype(np.uint16)",
             ["tests/model/test_bf16_weights.py", "-k", "converted_at_load"]),
    Mutation("bf16 weights: training builds hold bf16 weights too", PKG + "kernels/provider.py",
             'if not (self.inference and self.gemm_dtype == "bfloat16" and self.uses("linear")):',
             'if not (self.gemm_dtype == "bfloat16" and self.uses("linear")):',
             ["tests/model/test_bf16_weights.py", "-k", "provider"]),
    Mutation("bf16 weights: the plain path holds bf16 weights too", PKG + "kernels/provider.py",
             'if not (self.inference and self.gemm_dtype == "bfloat16" and self.uses("linear")):',
             'if not (self.inference and self.gemm_dtype == "bfloat16"):',
             ["tests/model/test_bf16_weights.py", "-k", "plain"]),
    Mutation("the int8 GEMM forgets the weight's per-channel scales", PKG + "kernels/csrc/cpu_decoder.h",
             "const float value = static_cast<float>(acc) * (x_scale * w_scale);",
             "const float value = static_cast<float>(acc) * x_scale;",
             ["tests/kernels/test_int8_linear_kernel.py"]),
    Mutation("the int8 kernel truncates instead of rounding the input", PKG + "kernels/csrc/common.h",
             "const float r = std::nearbyint(x[k] * inverse);", "const float r = std::trunc(x[k] * inverse);",
             ["tests/kernels/test_int8_linear_kernel.py"]),
    Mutation("the int8 GEMM's AVX2 tiles skip the last product of a tail", PKG + "kernels/csrc/cpu_decoder.cc",
             "for (int64_t k = K32; k < K; ++k) sum += static_cast<int32_t>(q[r * K + k])",
             "for (int64_t k = K32; k + 1 < K; ++k) sum += static_cast<int32_t>(q[r * K + k])",
             ["tests/kernels/test_cores.py", "-k", "int8"]),
    Mutation("the int8 GEMM's two-row tiles take one row", PKG + "kernels/csrc/cpu_decoder.cc",
             "case 2: int8_tile<2>(q + o, aq + o, wr, K, t, n, out); break;",
             "case 2: int8_tile<1>(q + o, aq + o, wr, K, t, n, out); break;",
             ["tests/kernels/test_cores.py", "-k", "int8"]),
    Mutation("oneDNN's int8 GEMM taken as exact without VNNI", PKG + "kernels/csrc/common.h",
             "return isa_has(isa, dnnl_cpu_isa_avx512_core_vnni) || isa_has(isa, dnnl_cpu_isa_avx2_vnni);",
             "return isa_has(isa, dnnl_cpu_isa_avx512_core) || isa_has(isa, dnnl_cpu_isa_avx2);",
             ["tests/kernels/test_cpu_isa.py"]),
    Mutation("oneDNN's bf16 GEMM taken as native whenever it answers", PKG + "kernels/csrc/cpu_linear.cc",
             "if (!bf16_gemm_fast(onednn_isa())) return false;", "",
             ["tests/kernels/test_cpu_isa.py"]),
    Mutation("int8 weights scaled by max / 128", PKG + "model/quantization.py",
             "scale = (amax / np.float32(127)).astype(np.float32)", "scale = (amax / np.float32(128)).astype(np.float32)",
             ["tests/kernels/test_int8_linear_kernel.py", "-k", "round_trip"]),
    Mutation("a float model reads an int8 weights file", PKG + "model/weights.py",
             "    check_precision(path, reader, params)\n", "",
             ["tests/test_quantize.py", "-k", "refused_by_a_float_model"]),
    Mutation("training from an int8 model not refused", PKG + "preflight/checks.py",
             "    check_not_int8_training(config, model_config)\n", "",
             ["tests/preflight/test_int8_training_refused.py"]),
    # the training layer (kernels/csrc/cpu_train_layer.cc)
    Mutation("the training layer's backward skips the attention output's dropout mask",
             PKG + "kernels/csrc/cpu_train_layer.cc",
             "    status = hidden_dropout(w.dattn, T * H, 1, d, in, o);\n", "    status = 0;\n",
             ["tests/model/test_train_layer.py", "-k", "float32 and gpt2"]),
    Mutation("the training layer draws the MLP output's mask at the attention output's offsets",
             PKG + "kernels/csrc/cpu_train_layer.cc", "in.hidden_t1, in.hidden_t2, in.offsets + 2 * site,",
             "in.hidden_t1, in.hidden_t2, in.offsets + 2,", ["tests/model/test_train_layer.py", "-k", "float32 and gpt2"]),
    Mutation("the training layer's backward turns the queries' gradient forward through rope",
             PKG + "kernels/csrc/cpu_train_layer.cc", "status = gptlocal_core_rope_bwd(dq,", "status = gptlocal_core_rope_fwd(dq,",
             ["tests/model/test_train_layer.py", "-k", "float32 and llama"]),
    Mutation("the training layer adds fc1's bias before the bias + GeLU core adds it again",
             PKG + "kernels/csrc/cpu_train_layer.cc", "gptlocal_core_linear_fwd(b, p.fc1_w, nullptr, mlp,",
             "gptlocal_core_linear_fwd(b, p.fc1_w, d.bias ? p.fc1_b : nullptr, mlp,",
             ["tests/model/test_train_layer.py", "-k", "float32 and gpt2"]),
    Mutation("the training layer's backward reads a slot another forward wrote",
             PKG + "kernels/csrc/cpu_train_layer.cc", "const bool paired = ticket[0] == options.slot &&",
             "const bool paired = slot.generation != 0 || ticket[0] == options.slot &&",
             ["tests/model/test_train_layer.py", "-k", "another_forward"]),
    Mutation("the parallel residual's backward leaves the MLP's norm out of the input's gradient",
             PKG + "kernels/csrc/cpu_train_layer.cc", "add3(dh, dn1, dn2, g.dhidden, T * H, o);",
             "add(dh, dn1, g.dhidden, T * H, o);", ["tests/model/test_train_layer.py", "-k", "float32 and neox"]),
    Mutation("cpu_kernels train_layer: auto runs the training layer", PKG + "kernels/provider.py",
             'self.modes["train_layer"] != "kernel"', 'self.modes["train_layer"] == "plain"',
             ["tests/model/test_train_layer.py", "-k", "which_builds"]),
    # KV cache and generation
    Mutation("the decode-layer kernel reads one cached key too few", PKG + "kernels/csrc/cpu_decoder.cc",
             "valid = rows.pos[t] + 1;", "valid = rows.pos[t];",
             ["tests/generation/test_decode_layer.py", "-k", "every_step"]),
    Mutation("the decoder writes the key into the value cache too", PKG + "kernels/csrc/cpu_decoder.cc",
             "std::memcpy(values + cached, heads + (group + 1) * D, sizeof(float) * D);",
             "std::memcpy(values + cached, heads + group * D, sizeof(float) * D);",
             ["tests/generation/test_native_runner.py", "-k", "every_step and gpt2-float32"]),
    Mutation("the decode-layer kernel ignores the attention bias", PKG + "kernels/csrc/cpu_decoder.cc",
             "scores[j] = bias != nullptr ? s * scale + bias[j] : s * scale;", "scores[j] = s * scale;",
             ["tests/kernels/test_decode_layer_kernel.py"]),
    Mutation("the decoder's rope turns the value head too", PKG + "kernels/csrc/cpu_decoder.cc",
             "for (int64_t j = 0; j <= group; ++j) rotate(", "for (int64_t j = 0; j <= group + 1; ++j) rotate(",
             ["tests/generation/test_native_runner.py", "-k", "every_step and llama-float32"]),
    Mutation("a GQA query reads the first group's keys", PKG + "kernels/csrc/cpu_decoder.cc",
             "const int64_t base = (static_cast<int64_t>(rows.slot[b]) * G + g) * L * D;",
             "const int64_t base = (static_cast<int64_t>(rows.slot[b]) * G + 0) * L * D;",
             ["tests/generation/test_native_runner.py", "-k", "every_step and llama-float32"]),
    Mutation("the parallel residual's MLP reads the attention's sum", PKG + "kernels/csrc/cpu_decoder.cc",
             "m.parallel_residual ? x : h,", "h,",
             ["tests/generation/test_native_runner.py", "-k", "every_step and neox"]),
    Mutation("the int8 rows kernel drops each row's tail", PKG + "kernels/csrc/cpu_decoder.cc",
             "for (int64_t k = K32; k < K; ++k) sum += static_cast<int32_t>(q[r * K + k])",
             "for (int64_t k = K; k < K; ++k) sum += static_cast<int32_t>(q[r * K + k])",
             ["tests/generation/test_native_runner.py", "-k", "every_step and llama-int8"]),
    Mutation("the native greedy steps feed the first token again", PKG + "runtime/native.py",
             "            ids[:, 0] = self.tokens[:batch]\n", "",
             ["tests/generation/test_native_runner.py", "-k", "every_step and gpt2-float32"]),
    Mutation("the native prefill returns the logits after the padding", PKG + "runtime/native.py",
             "last[:len(prompts)] = lengths - 1", "last[:len(prompts)] = ids.shape[1] - 1",
             ["tests/generation/test_native_runner.py", "-k", "every_step and gpt2-float32"]),
    Mutation("the model's description drops the gate of a gated MLP", PKG + "model/describe.py",
             "if part.when and not getattr(arch, part.when):", "if part.when:",
             ["tests/generation/test_native_runner.py", "-k", "every_step and llama-float32"]),
    Mutation("the model's description gives rope tables from positions one off", PKG + "model/attention.py",
             "freqs = np.arange(length, dtype=np.int32)", "freqs = np.arange(1, length + 1, dtype=np.int32)",
             ["tests/generation/test_native_runner.py", "-k", "every_step and llama-float32"]),
    Mutation("a call in column chunks returns its last chunk's logits", PKG + "runtime/native.py",
             "out[here] = self.logits[:batch][here]", "out[:] = self.logits[:batch]",
             ["tests/generation/test_native_runner.py", "-k", "column_chunks"]),
    Mutation("a LoRA model runs the native runner", PKG + "runtime/runner.py",
             " or \\\n                facts.linears not in held:", ":",
             ["tests/kernels/test_provider_decisions.py", "-k", "native_runner"]),
    Mutation("the compiled runner's calls run in the caller's PyNative mode", PKG + "runtime/runner.py",
             "    if mode == ms.GRAPH_MODE:\n        return cached_call(lm, cell, *args)",
             "    if True:\n        return cached_call(lm, cell, *args)",
             ["tests/generation/test_generate_modes.py"]),
    Mutation("a decode step runs the kernel in the prefill graphs too", PKG + "model/gpt.py",
             "hidden.shape[1] == 1 and", "hidden.shape[1] >= 1 and",
             ["tests/generation/test_decode_layer.py", "-k", "calls_the_kernel"]),
    Mutation("the bf16 decode layer is built without its GEMMs' precision", PKG + "kernels/provider.py",
             'int8=int8, precision=self.gemm_dtype or "float32",', 'int8=int8, precision="float32",',
             ["tests/generation/test_decode_layer.py", "-k", "bf16 and every_step and not emulated"]),
    Mutation("the int8 decode layer reads each weight's bias as its scales", PKG + "kernels/csrc/cpu_decode_layer.cc",
             "  w.qkv_scale = scales(given.qkv_scale);", "  w.qkv_scale = scales(given.qkv_bias);",
             ["tests/generation/test_decode_layer.py", "-k", "int8 and every_step"]),
    Mutation("the decode step's head keeps MatMul at one and two rows", PKG + "kernels/provider.py",
             "HEAD_RULE = (HEAD_GEMM_ROWS, HEAD_GEMM_FEW_ROWS)", "HEAD_RULE = (HEAD_GEMM_ROWS, 0)",
             ["tests/kernels/test_linear_gemm_kernel.py", "-k", "one_and_two_rows"]),
    Mutation("a layer with LayerDrop gets the decode-layer kernel", PKG + "kernels/provider.py",
             "if not self.layer_computes(facts) or facts.layerdrop:", "if not self.layer_computes(facts):",
             ["tests/kernels/test_provider_decisions.py", "-k", "decode_layer"]),
    Mutation("fused attention draws MindSpore's dropout masks", PKG + "kernels/provider.py",
             "or (dropout_rate > 0 and not counter_dropout)", "",
             ["tests/kernels/test_provider_decisions.py", "-k", "fused_attention"]),
    Mutation("decode_layer: auto leaves float32 models on the plain decode graph", PKG + "kernels/provider.py",
             'DECODE_LAYER_AUTO = ("int8", "float32", "bfloat16")', 'DECODE_LAYER_AUTO = ("int8", "bfloat16")',
             ["tests/generation/test_decode_layer.py", "-k", "auto_runs"]),
    Mutation("a bf16 training build's decode runs the decode-layer kernel", PKG + "kernels/provider.py",
             'not self.uses("decode_layer") or bf16 != bool(bf16_weights)', 'not self.uses("decode_layer")',
             ["tests/generation/test_decode_layer.py", "-k", "bf16"]),
    Mutation("cached decode sees the next cache row", PKG + "model/kv_cache.py",
             "ops.greater(self.key_rows, ops.expand_dims(positions, 2))",
             "ops.greater(self.key_rows, ops.expand_dims(positions, 2) + 1)",
             ["tests/generation/test_generation.py", "tests/generation/test_decode_layer.py"]),  # plain decode graph
    Mutation("device greedy steps write every step at one position", PKG + "runtime/runner.py",
             "positions = positions + 1", "positions = positions + 0", ["tests/generation/test_generation.py"]),
    Mutation("bucketed prefill returns the logits after the padding", PKG + "runtime/runner.py",
             "return self._prefill_call(ids, positions, lengths - 1)",
             "return self._prefill_call(ids, positions, np.full_like(lengths, ids.shape[1] - 1))",
             ["tests/generation/test_generation.py"]),
    Mutation("decode writes over the previous cache row", PKG + "runtime/runner.py",
             "np.asarray(positions, np.int32)[:, None],", "np.asarray(positions, np.int32)[:, None] - 1,",
             ["tests/generation/test_generation.py"]),
    Mutation("compile cache key ignores the call's arguments", PKG + "runtime/graph_cache.py",
             '"args": _describe(list(args))}', '"args": None}',
             ["tests/generation/test_graph_cache.py", "-k", "key_follows"]),
    Mutation("compile cache key ignores gpt_local's own sources", PKG + "runtime/graph_cache.py",
             'text = json.dumps({"source": source_digest(), ', 'text = json.dumps({"source": None, ',
             ["tests/generation/test_graph_cache.py", "-k", "key_follows"]),
    Mutation("compile cache key ignores MindFormers' and MindSpore's Cell code", PKG + "runtime/graph_cache.py",
             '"classes": class_sources(cell)}', '"classes": None}',
             ["tests/generation/test_graph_cache.py", "-k", "key_follows"]),
    Mutation("the training step compiles around the compile cache", PKG + "mf/wrapper.py",
             'cache = getattr(self, "graph_cache", None)', "cache = None",
             ["tests/training/test_step_compile_cache.py", "-k", "second_run"]),
    Mutation("the step cache is off under msrun whatever the YAML says", PKG + "mf/wrapper.py",
             'if root is None or ms.get_context("mode") != ms.GRAPH_MODE:',
             'if root is None or ms.get_context("mode") != ms.GRAPH_MODE or GlobalComm.INITED:',
             ["tests/e2e/test_msrun.py", "-k", "two_process"]),
    Mutation("an msrun rank's graphs staged in rank 0's folder", PKG + "runtime/graph_cache.py",
             'return f"rank_{get_rank()}" if GlobalComm.INITED else "rank_0"', 'return "rank_0"',
             ["tests/e2e/test_msrun.py", "-k", "two_process"]),
    Mutation("a stop string ends the reply at the first string listed, not the earliest",
             PKG + "runtime/detokenizer.py",
             "return min((p for p in (text.find(s) for s in stops if s) if p >= 0), default=-1)",
             "return next((p for p in (text.find(s) for s in stops if s) if p >= 0), -1)",
             ["tests/generation/test_detokenizer.py"]),
    Mutation("stop-string hold-back keeps the first matching tail, not the longest", PKG + "runtime/detokenizer.py",
             "hold = max(hold, k)", "hold = hold or k", ["tests/generation/test_detokenizer.py"]),
    Mutation("a decode row writes its token one position late", PKG + "serve/scheduler.py",
             "writes = [(row_of[i], [self.slots[i].token], self.slots[i].cursor, 0) for i in busy]",
             "writes = [(row_of[i], [self.slots[i].token], self.slots[i].cursor + 1, 0) for i in busy]",
             ["tests/serve/test_scheduler.py"]),
    Mutation("a prefill chunk skips a prompt token", PKG + "serve/scheduler.py",
             "part = slot.request.prompt[slot.cursor:slot.cursor + width]",
             "part = slot.request.prompt[slot.cursor + 1:slot.cursor + width]", ["tests/serve/test_scheduler.py"]),
    Mutation("a model folder without weights loads as a random model", PKG + "model/gpt.py",
             "        if lacking:\n            raise CheckpointError(lacking)\n", "",
             ["tests/generation/test_loader.py", "-k", "from_pretrained"]),
    Mutation("top-k narrowing drops the k-th logit", PKG + "generation/sampling.py",
             "kept = found[row[found] >= bound]", "kept = found[row[found] > bound]",
             ["tests/generation/test_sampling.py", "-k", "narrowed"]),
    Mutation("top-k keeps everything above the strided sample's bound", PKG + "generation/sampling.py",
             "bounds[index] = np.partition(row[found], -k)[-k]",
             "bounds[index] = floors[index] if floors is not None else np.partition(row[found], -k)[-k]",
             ["tests/generation/test_sampling.py", "-k", "narrowed"]),
    Mutation("top-p keeps one token too few", PKG + "generation/sampling.py",
             "drop_sorted = cumulative - probs > p", "drop_sorted = cumulative > p", ["tests/generation/test_sampling.py"]),
    Mutation("embedding_dropout forgets it defaults to hidden_dropout", PKG + "model/fields.py",
             'fallback="hidden_dropout"', "fallback=None", ["tests/model/test_config_fields.py"]),
    Mutation("validate skips the other keys' own rules", PKG + "model/config.py",
             "if key.check and not key.arch:", "if key.check and key.arch:", ["tests/model/test_config_fields.py"]),
    Mutation("the stop rule ignores a stop string", PKG + "generation/stopping.py",
             "if self.is_eos(token) or matched:", "if self.is_eos(token):", ["tests/generation/test_stopping.py"]),
    Mutation("the stop rule lets one token past the budget", PKG + "generation/stopping.py",
             "return LENGTH if produced >= self.budget else None", "return LENGTH if produced > self.budget else None",
             ["tests/generation/test_stopping.py"]),
    Mutation("the temperature rule samples without do_sample", PKG + "generation/sampling.py",
             "if not do_sample or not temperature > 0:", "if not temperature > 0:", ["tests/generation/test_stopping.py"]),
    Mutation("repetition penalty rewards repeats", PKG + "generation/sampling.py",
             "np.where(values > 0, values / penalty, values * penalty)",
             "np.where(values > 0, values * penalty, values / penalty)", ["tests/generation/test_sampling.py"]),
    # weight files
    Mutation("BF16 read as integers, not widened", PKG + "safetensors_io.py",
             "return (array.astype(np.uint32) << 16).view(np.float32)", "return array.astype(np.float32)",
             ["tests/checkpoint/test_safetensors_io.py"]),
    Mutation("in-place read ignores the stored dtype", PKG + "safetensors_io.py",
             "target.dtype != dtype or", "False and target.dtype != dtype or",
             ["tests/checkpoint/test_safetensors_io.py", "tests/checkpoint/test_lean_loading.py"]),
    # prepare-data and signals
    Mutation("prepare-data cuts a text file after any newline", PKG + "data/prepare.py",
             "if not text[newline - 1].isspace() and not text[newline + 1].isspace():", "if True:",
             ["tests/data/test_prepare_data.py", "-k", "pieces"]),
    Mutation("a piece's tokens go to the next document", PKG + "data/prepare.py",
             "if number != current and current is not None:", "if current is None:",
             ["tests/data/test_prepare_data.py", "-k", "pieces"]),
    Mutation("the staging folder is kept on a signal", PKG + "staging.py",
             "    except BaseException:\n        shutil.rmtree(staging, ignore_errors=True)",
             "    except Exception:\n        shutil.rmtree(staging, ignore_errors=True)",
             ["tests/cli/test_interrupt.py", "-k", "prepare_data"]),
    # conversion
    Mutation("HF c_proj not transposed", PKG + "checkpoint/hf_gpt2.py",
             '("attention.linear_proj.weight", "attn.c_proj.weight", "transpose")',
             '("attention.linear_proj.weight", "attn.c_proj.weight", "copy")', ["tests/checkpoint/test_hf_interop.py"]),
    Mutation("HF fused QKV not reordered head-major", PKG + "checkpoint/family.py",
             "return _fuse(_split_rows(arrays[0].T, local), local)",
             "return np.ascontiguousarray(arrays[0].T)", ["tests/checkpoint/test_hf_interop.py"]),
    Mutation("grouped QKV fused query-major instead of group-major", PKG + "checkpoint/family.py",
             "return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape((-1,) + rest))",
             "return np.ascontiguousarray(np.concatenate([q, k, v], axis=0))", ["tests/checkpoint/test_hf_families.py"]),
    Mutation("GPT-2 files without the transformer. prefix not read", PKG + "checkpoint/family.py",
             "if prefix and foreign.startswith(prefix) and foreign[len(prefix):] in source_names:",
             "if False:", ["tests/checkpoint/test_checkpoint_family.py"]),
    # sharding and placement
    Mutation("attention transpose split over the sequence", PKG + "parallel/sharding.py",
             'OpRule("attention.transpose", ((DP, 1, MP, 1, 1),))', 'OpRule("attention.transpose", ((DP, MP, 1, 1, 1),))',
             ["tests/parallel/test_sharding_golden.py", "tests/parallel/test_tensor_parallel.py"]),
    Mutation("row-parallel bias split over mp", PKG + "parallel/sharding.py",
             'OpRule(f"{linear}.bias_add", ((DP, 1), (1,)), {1: f"{linear}.bias"})',
             'OpRule(f"{linear}.bias_add", ((DP, MP), (MP,)), {1: f"{linear}.bias"})',
             ["tests/parallel/test_sharding_golden.py", "tests/parallel/test_tensor_parallel.py"]),
    Mutation("tied head ignores the vocab split", PKG + "parallel/sharding.py",
             'OpRule("head_matmul", ((DP, 1), table), {1: "output_layer.weight" if arch.untied else word})',
             'OpRule("head_matmul", ((DP, 1), (1, 1)), {1: "output_layer.weight" if arch.untied else word})',
             ["tests/parallel/test_sharding_golden.py", "tests/parallel/test_tensor_parallel.py"]),
    Mutation("pipeline remainder layers go to the first stage", PKG + "parallel/layout.py",
             "order = list(range(1, stages)) + [0]", "order = list(range(stages))",
             ["tests/model/test_model.py", "tests/model/test_params.py"]),
    Mutation("recompute counts one layer too many per stage", PKG + "parallel/layout.py",
             "chosen.append(index < per_stage[stage])", "chosen.append(index <= per_stage[stage])",
             ["tests/model/test_model.py", "tests/model/test_recompute.py"]),
    Mutation("parallel_config.offset wins over model_config.offset", PKG + "parallel/layout.py",
             'offset = config_value(model_config, "offset", None)\n    if offset is None:\n'
             '        offset = config_value(parallel_config, "offset", None)',
             'offset = config_value(parallel_config, "offset", None)\n    if offset is None:\n'
             '        offset = config_value(model_config, "offset", None)', ["tests/model/test_params.py"]),
    Mutation("tied token table only on the first stage", PKG + "model/params.py",
             "shapes = {WORD_EMBEDDINGS: ((d[\"vocab\"], d[\"hidden\"]), [0] if arch.untied else sorted({0, last}))}",
             "shapes = {WORD_EMBEDDINGS: ((d[\"vocab\"], d[\"hidden\"]), [0] if arch.untied else [0])}",
             ["tests/model/test_params.py", "tests/checkpoint/test_dist_checkpoint.py"]),
    Mutation("rank numbering with dp innermost", PKG + "checkpoint/distributed.py",
             "return stage * self.dp * self.mp + dp_index * self.mp + mp_index",
             "return stage * self.dp * self.mp + mp_index * self.dp + dp_index", ["tests/checkpoint/test_dist_checkpoint.py"]),
    # training
    Mutation("wrapper ignores max_grad_norm", PKG + "mf/wrapper.py",
             "GPTLocalClipGradNorm(max_norm=float(self.clip_grad_norm.clip_norm.asnumpy()[0]),",
             "GPTLocalClipGradNorm(max_norm=1.0,", ["tests/training/test_wrapper.py"]),
    Mutation("overflow check never fires", PKG + "training/grad_checks.py",
             "return 1.0 - F.cast(_is_finite(sum_of_squares), mstype.float32)",
             "return 0.0 * F.cast(_is_finite(sum_of_squares), mstype.float32)",
             ["tests/training/test_wrapper.py", "tests/training/test_grad_checks.py"]),
    Mutation("gradient norm without the square root", PKG + "mf/wrapper.py",
             "global_norm = F.sqrt(F.addn(self.square_sums(x)))",
             "global_norm = F.addn(self.square_sums(x))", ["tests/training/test_grad_checks.py", "tests/training/test_wrapper.py"]),
    Mutation("AdamW without bias correction of the step", PKG + "training/optim.py",
             "lr * root_correction2 / correction1, beta1, beta2,\n               eps * root_correction2, "
             "weight_decay * correction1 / root_correction2,\n               ops.cast(grad, param.dtype))",
             "lr, beta1, beta2,\n               eps * root_correction2, "
             "weight_decay * correction1 / root_correction2,\n               ops.cast(grad, param.dtype))",
             ["tests/training/test_optim.py", "-k", "step_by_step"]),
    Mutation("AdamW weight decay not rescaled", PKG + "training/optim.py",
             "weight_decay * correction1 / root_correction2,\n               ops.cast(grad, param.dtype))",
             "weight_decay,\n               ops.cast(grad, param.dtype))",
             ["tests/training/test_optim.py", "-k", "step_by_step"]),
    Mutation("the AdamW kernel drops the weight decay", PKG + "kernels/csrc/cpu_adamw.cc",
             "w[i] -= lr * (mi / (std::sqrt(vi) + eps) + decay * w[i]);", "w[i] -= lr * (mi / (std::sqrt(vi) + eps));",
             ["tests/training/test_fused_optim.py", "-k", "adamw_kernel"]),
    Mutation("the AdamW kernel's second thread updates the first chunk again", PKG + "kernels/csrc/cpu_adamw.cc",
             "adamw_chunk(w + begin, m + begin, v + begin, g + begin,", "adamw_chunk(w, m, v, g,",
             ["tests/training/test_fused_optim.py", "-k", "adamw_kernel"]),
    Mutation("the sum-of-squares kernel drops each 4096-element block's last lane", PKG + "kernels/csrc/cpu_square_sum.cc",
             "const int64_t end = std::min<int64_t>(n, start + 4096);",
             "const int64_t end = std::min<int64_t>(n, start + 4095);",
             ["tests/training/test_grad_checks.py", "-k", "kernel"]),
    Mutation("the overflow check's kernel sum misses an overflowing total", PKG + "kernels/csrc/cpu_square_sum.cc",
             "*total = static_cast<float>(sum);", "*total = static_cast<float>(std::min(sum, 3.0e38));",
             ["tests/training/test_grad_checks.py", "-k", "kernel"]),
    Mutation("the decoder's GEMV drops the tail of each row past the last 8 columns", PKG + "kernels/csrc/cpu_decoder.cc",
             "    for (int64_t k = K8; k < K; ++k) sum += x[k] * weight_value(rows[r][k]);\n", "",
             ["tests/generation/test_native_runner.py", "-k", "one_sequence"]),
    Mutation("the head + loss kernel's later chunks overwrite the head's gradient", PKG + "kernels/csrc/cpu_head_loss.cc",
             "const float beta = t0 == 0 ? 0.0f : 1.0f;", "const float beta = 0.0f;",
             ["tests/kernels/test_cores.py", "-k", "head_loss"]),
    Mutation("the fused loss ignores the loss mask", PKG + "model/gpt.py",
             "        labels, keep = loss_rows(labels, loss_mask, lm.ignore_token_id)\n        row_weight = keep /",
             "        labels, keep = loss_rows(labels, None, lm.ignore_token_id)\n        row_weight = keep /",
             ["tests/model/test_head_loss.py", "-k", "match_the_plain"]),
    Mutation("the train step keeps AdamWeightDecay", PKG + "mf/wrapper.py",
             "            self.optimizer.use_kernels(provider)\n", "",
             ["tests/training/test_fused_optim.py", "-k", "train_step_gives"]),
    Mutation("perplexity scores logits against the same position", PKG + "training/metrics.py",
             "target = labels[row, 1:]", "target = labels[row, :-1]", ["tests/training/test_metrics.py"]),
    # checkpoints and resume
    Mutation("manifest compares sizes only", PKG + "checkpoint/manifest.py",
             'if entry["sha256"] and sha256_of(path) != entry["sha256"]:', "if False:", ["tests/e2e/test_crash_safe.py"]),
    Mutation("checkpoint rotation removes other runs' checkpoints", PKG + "mf/checkpoint_monitor.py",
             'if e.get("run_id") == self._run_id),', "),",
             ["tests/checkpoint/test_resume_guards.py", "-k", "full_disk_during"]),
    Mutation("a new run lands silently on an earlier one", PKG + "preflight/checks.py",
             "    check_earlier_run(config)  #", "    pass  #", ["tests/preflight/test_earlier_run.py"]),
    Mutation("overwrite leaves the earlier run's checkpoints", PKG + "mf/run_yaml.py",
             "    start_over(config, log)\n", "", ["tests/e2e/test_stop_signals.py", "-k", "sigint"]),
    Mutation("resume takes the oldest checkpoint", PKG + "checkpoint/resume.py",
             'for entry in sorted(entries, key=lambda e: e["step"], reverse=True):',
             'for entry in sorted(entries, key=lambda e: e["step"]):', ["tests/e2e/test_crash_safe.py"]),
    # MindFormers compatibility (mf/compat.py)
    Mutation("compat check ignores a re-signed target", PKG + "mf/compat.py",
             "if target.params is not None and params != list(target.params):", "if False:", COMPAT_TESTS),
    Mutation("compat check ignores an instance attribute no longer set", PKG + "mf/compat.py",
             "        if gone:\n", "        if False:\n", COMPAT_TESTS),
    Mutation("compat verify never warns", PKG + "mf/compat.py",
             "warnings.warn(message(name, problems), GPTLocalCompatWarning, stacklevel=2)", "pass", COMPAT_TESTS),
    Mutation("checkpoint rotation patch assigns onto any manager", PKG + "mf/compat.py",
             "    if not callable(original):\n        raise CompatError", "    if False:\n        raise CompatError",
             COMPAT_TESTS),
    Mutation("barrier scan patches no module", PKG + "mf/compat.py",
             "for name in barrier_bound_modules(original):", "for name in ():", COMPAT_TESTS),
    Mutation("MindFormers' model returns 1.8's count of losses", PKG + "mf/model.py",
             "train_outputs = mcore_train_outputs()", "train_outputs = 3", COMPAT_TESTS + ["-k", "training_tuple"]),
    Mutation("pre-flight skips the compat check", PKG + "mf/run_yaml.py",
             '    require(config.get(MODE_KEY) or "strict")', "    pass", COMPAT_TESTS),
    Mutation("BLEU patch check ignores what bleu_score imports", PKG + "mf/compat.py",
             '- {"nltk.util"})', '- {"nltk.util"}) and []', COMPAT_TESTS),
    Mutation("import hook keeps the bare nltk modules loaded", "mindformers_gptlocal_autoregister.py",
             '        forget_bare_nltk(getattr(self, "bleu", ()))\n', "        pass\n",
             ["tests/mf/test_registration.py", "-k", "bleu"]),
    # models by name, generate's samples, the server's n
    Mutation("i39n: the server's n choices share one seed", PKG + "serve/app.py",
             'seed=None if spec["seed"] is None else spec["seed"] + index', 'seed=spec["seed"]',
             ["tests/serve/test_serve.py", "-k", "n_choices"]),
    Mutation("i39n: the server drops repetition_penalty", PKG + "serve/scheduler.py",
             '"repetition_penalty": float(repetition_penalty)}', '"repetition_penalty": 1.0}',
             ["tests/serve/test_serve.py", "-k", "n_choices"]),
    Mutation("i39n: generate's samples share --seed", PKG + "cli/generate.py",
             'sample["seed"] = kwargs["seed"] + i', 'sample["seed"] = kwargs["seed"]',
             ["tests/cli/test_cli.py", "-k", "num_samples"]),
    Mutation("i39n: a model id wins over an existing path", PKG + "checkpoint/hub.py",
             "return isinstance(value, str) and not os.path.exists(value) and bool(ID.match(value))",
             "return isinstance(value, str) and bool(ID.match(value))",
             ["tests/cli/test_models_by_name.py", "-k", "equals_its_converted"]),
    Mutation("i63: a published file keeps its writer's mode", PKG + "staging.py",
             "    set_new_mode(tmp)\n    fsync_path(tmp)", "    fsync_path(tmp)",
             ["tests/test_staging.py", "-k", "safetensors_file"]),
    Mutation("i63: a staged folder keeps its writers' modes", PKG + "staging.py",
             "            set_new_mode(path, mask)\n", "",
             ["tests/test_staging.py", "-k", "write_folder_publishes"]),
    Mutation("i63: progress counts to stop_step's end", PKG + "training/callbacks.py",
             "total = max(params.batch_num * params.epoch_num, step)", "total = max(self.stop_at(params), step)",
             ["tests/training/test_progress.py", "-k", "cut_by_stop_step"]),
    Mutation("i63: losses lose their trailing zeros", PKG + "training/callbacks.py",
             'return f"{loss:#.{digits}g}"', 'return f"{loss:.{digits}g}"',
             ["tests/training/test_progress.py", "-k", "significant"]),
    Mutation("i60: local tasks index lm-eval's built-in tasks too", PKG + "evaluation/run.py",
             "        if set(tasks) <= set(local.all_subtasks):\n            return local\n", "",
             ["tests/evaluation/test_eval_harness.py", "-k", "local_tasks_are_indexed"]),
    Mutation("i60: any task list indexes the --include-path folder alone", PKG + "evaluation/run.py",
             "if set(tasks) <= set(local.all_subtasks):", "if True:",
             ["tests/cli/test_command_errors.py", "-k", "eval_offline_task"]),
    Mutation("i60: a loaded step graph said to be compiled", PKG + "mf/wrapper.py",
             "cache is not None and cache.hits > hits)", "False)",
             ["tests/training/test_step_compile_cache.py", "-k", "second_run"]),
    # planner
    Mutation("1F1B holds one micro-batch fewer", PKG + "plan/memory.py",
             "return max(1, min(stages - stage, micro_batch_num))",
             "return max(1, min(stages - stage - 1, micro_batch_num))", PLANNER_TESTS),
    Mutation("Adam moments split over dp without the parallel optimizer", PKG + "plan/report.py",
             "optimizer = trainable * mem.ADAM_MOMENT_BYTES / (dp if parallel_optimizer else 1)",
             "optimizer = trainable * mem.ADAM_MOMENT_BYTES / dp", PLANNER_TESTS),
    Mutation("activations forget the softmax output", PKG + "plan/memory.py",
             "attn += scores * sm                                       # softmax output",
             "attn += 0", PLANNER_TESTS),
]


def scratch_copy():
    """The tracked and new files of the repository in a temporary folder (no .venv, no build output)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    root = tempfile.mkdtemp(prefix="gptlocal-mutants-")
    for name in filter(None, files):
        source = os.path.join(REPO, name)
        if os.path.isfile(source) and not os.path.islink(source):
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(root, name))
    os.symlink("../model_configs", os.path.join(root, PKG, "model_configs"))
    return root


def pytest(tests, root, timeout):
    """Exit code of ``pytest -x`` on ``tests`` in the scratch copy (124 on a timeout)."""
    env = dict(os.environ, PYTHONPATH=root, GLOG_v="3",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def baseline(mutations, roots, timeout):
    """Each distinct test selection must pass on the unmutated copies, or no verdict means anything (run on the
    jobs' copies at once)."""
    selections = list(dict.fromkeys(tuple(m.tests) for m in mutations))
    codes = in_jobs(roots, selections, lambda tests, root: pytest(list(tests), root, timeout))
    failing = []
    for tests, code in zip(selections, codes):
        print(f"baseline {'ok' if code == 0 else f'FAILS ({code})'}: {' '.join(tests)}", flush=True)
        if code != 0:
            failing.append(tests)
    return failing


def in_jobs(roots, items, work):
    """[work(item, root)] for each item, in order, as many at once as there are scratch copies (``roots``): a job
    takes a free copy, so no two jobs share one."""
    free = queue.Queue()
    for root in roots:
        free.put(root)

    def one(item):
        root = free.get()
        try:
            return work(item, root)
        finally:
            free.put(root)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(roots)) as pool:
        return list(pool.map(one, items))


def stale_snippets(mutations, root=REPO):
    """[(mutation, why)] for each mutation whose snippet is not found exactly once, or whose test file is gone."""
    found = []
    for mutation in mutations:
        path = os.path.join(root, mutation.path)
        if not os.path.isfile(path):
            found.append((mutation, f"{mutation.path} does not exist"))
            continue
        with open(path, encoding="utf-8") as handle:
            count = handle.read().count(mutation.old)
        if count != 1:
            found.append((mutation, f"its snippet is found {count} times in {mutation.path} (must be once): "
                                    f"{mutation.old.splitlines()[0].strip()[:80]!r}"))
        missing = [t for t in mutation.tests
                   if t.startswith("tests/") and not os.path.exists(os.path.join(root, t.split("::")[0]))]
        if missing:
            found.append((mutation, f"its tests {', '.join(missing)} do not exist"))
    return found


def report_stale(mutations, root=REPO):
    """Print each stale mutation; the number found."""
    stale = stale_snippets(mutations, root)
    for mutation, why in stale:
        print(f"STALE  {mutation.name}: {why}", flush=True)
    return len(stale)


def run(mutation, root, timeout):
    """'caught', 'missed' or 'stale', and seconds."""
    path = os.path.join(root, mutation.path)
    with open(path, encoding="utf-8") as handle:
        original = handle.read()
    if original.count(mutation.old) != 1:
        return "stale", 0.0
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(original.replace(mutation.old, mutation.new))
    started = time.time()
    try:
        code = pytest(mutation.tests, root, timeout)  # a timeout (a hang) counts as caught: a user would notice
    finally:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(original)
    verdict = "stale" if code in (4, 5) else "missed" if code == 0 else "caught"  # 4/5: no tests ran
    return verdict, time.time() - started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation")
    parser.add_argument("--jobs", type=int, default=2,
                        help="mutations tested at once, each in its own scratch copy (default 2)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the first pass that runs each test selection unmutated (must pass)")
    parser.add_argument("--check-stale", action="store_true",
                        help="only check that every snippet matches the code once (no tests run); exit 3 if not")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or args.only in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name:60} {m.path:45} {' '.join(m.tests)}")
        return 0
    stale = report_stale(chosen)
    if args.check_stale or stale:
        print(f"{len(chosen)} mutations, {stale} stale" + (": update their snippets to today's code" if stale else ""))
        return 3 if stale else 0
    roots = [scratch_copy() for _ in range(max(1, args.jobs))]
    counts = {"caught": 0, "missed": 0, "stale": 0}
    done = []

    def judge(mutation, root):
        verdict, seconds = run(mutation, root, args.timeout)
        counts[verdict] += 1
        done.append(mutation)
        print(f"[{len(done):2}/{len(chosen)}] {verdict.upper():6} {seconds:6.0f} s  {mutation.name}  "
              f"({mutation.path})", flush=True)

    try:
        if not args.no_baseline and baseline(chosen, roots, args.timeout):
            print("the tests fail without any mutation: fix them first")
            return 2
        in_jobs(roots, chosen, judge)
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    judged = counts["caught"] + counts["missed"]
    rate = 100.0 * counts["caught"] / judged if judged else 0.0
    print(f"{counts['caught']} caught, {counts['missed']} missed, {counts['stale']} stale: {rate:.0f}% caught")
    return 1 if counts["missed"] or counts["stale"] else 0


if __name__ == "__main__":
    sys.exit(main())
