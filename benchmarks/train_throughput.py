"""Training throughput and peak memory of gpt_local (MindSpore, through MindFormers' trainer) against
Hugging Face GPT-2 (and, for the Llama-style shapes, LlamaForCausalLM) on PyTorch, same shapes, same tokens, same
machine, same run.

    python benchmarks/train_throughput.py                            # tiny and GPT-2 small, 3 rounds
    python benchmarks/train_throughput.py --shapes llama --steps 5 --warmup 2 --ours-bf16 \
        --torch-variants compile,sdpa+fused-bf16,compile-bf16        # Llama-style 12 x 768, fp32 and bf16
    python benchmarks/train_throughput.py --shapes small --seq-length 1024 --batch-size 1 --attention-block-size 256
    python benchmarks/train_throughput.py --shapes tiny --seq-length 2048 --torch-variants sdpa+fused

Shapes (``_common.SHAPES``): tiny (GPT-2 layout, 4 x 256, vocab 8,192), small (GPT-2 small, 124M), llama (12 x 768,
12 heads over 4 key/value groups, SwiGLU 2,048, RMSNorm, rope, no biases, untied head, vocab 8,192: ours with the
Llama-style model_config keys of model_configs/pretrain_llama_style_tiny_cpu.yaml, theirs LlamaForCausalLM of the same
sizes), llama-tiny (the same layout at 4 x 256, 8 heads over 2 groups: a quick check).

Sides, each run in its own worker process (so VmHWM is its own peak RSS), started with an explicit
environment (OMP_NUM_THREADS = MKL_NUM_THREADS = OPENBLAS_NUM_THREADS = --threads) that each worker
checks in its C environment before importing anything; MindSpore's runtime_num_threads and
torch.set_num_threads get the same count (benchmarks/_common.py):
  ours        ``gptlocal run`` on the tiny YAML resized to the shape (GPTLocalAdamW, clip 1.0), step times
              from GPTLocalThroughputMonitor; its first step includes the graph compile
  eager       the HF model, eager attention, AdamW (foreach)
  sdpa+fused  the HF model, scaled_dot_product_attention, AdamW(fused=True)
  compile     sdpa+fused under torch.compile; its first step (the compile) is shown apart
All sides: AdamW betas 0.9/0.95, eps 1e-8, weight decay 0.01 (fp32 moments for every weight), grad-norm
clip 1.0, dropout off, fp32 (the bf16 sides below aside). The sides run alternately (A B C D,
D C B A, ...) for --rounds rounds; tokens/s of a run = batch x seq / median step time after --warmup steps; the
tables give the median over rounds and [min-max]. MFU = tokens/s x (6N + 12 L H S) / peak, where peak is the
higher of the two fp32 GEMM rates measured at the start of this run (torch's MKL matmul and MindSpore's MatMul,
2048^3, best of 7, same threads), so neither side's MFU can borrow the other's faster GEMM.

bfloat16 sides (``python benchmarks/run.py train``):

    python benchmarks/train_throughput.py --shapes tiny --ours-bf16 \
        --torch-variants sdpa+fused-bf16,compile-bf16,compile

  ours_kernels     ours with the cpu_kernels ops of ``--ours-kernels OPS`` (a comma list, e.g. ``head_loss``) set to
                   ``kernel``: an opt-in kernel against the defaults, in the same run
  ours_bf16        ours with model_config.compute_dtype bfloat16 (``--ours-bf16``: the GEMMs in bf16, fp32 master
                   weights and optimizer state)
  ours_layer       ours with model_config.cpu_kernels {train_layer: kernel} (``--ours-train-layer``: each layer's
                   training step one kernel node each way, kernels/csrc/cpu_train_layer.cc); ours_layer_bf16 the same
                   in bfloat16 (with ``--ours-bf16`` too)
  sdpa+fused-bf16  sdpa+fused with the forward and loss under torch.autocast("cpu", dtype=torch.bfloat16)
  compile-bf16     compile, the same under autocast
The machine line is followed by the CPU's bf16 / int8 instructions (a CPU without avx512_bf16 or AMX says so). MFU
stays against the fp32 GEMM peak (a bf16 side can pass 100%).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)

SIDES = ("ours",) + tuple(C.TORCH_VARIANTS) + tuple(C.TORCH_BF16_VARIANTS)
# ours_bf16 (--ours-bf16): model_config.compute_dtype bfloat16
BF16 = {"compute_dtype": "bfloat16"}
# ours_layer (--ours-train-layer): model_config.cpu_kernels {train_layer: kernel}; ours_layer_bf16 with BF16 too
TRAIN_LAYER = {"cpu_kernels": {"train_layer": "kernel"}}
# ours_plain: model_config.cpu_kernels {layer_norm: plain, bias_gelu: plain} (MindSpore's LayerNorm and Add + GeLU);
# a Llama-style shape's {rms_norm: plain, swiglu: plain}
PLAIN_NORM_GELU = {"layer_norm": "plain", "bias_gelu": "plain"}
PLAIN_RMS_SWIGLU = {"rms_norm": "plain", "swiglu": "plain"}
LABELS = {"ours": "gpt_local (MindSpore)", "ours_plain": "gpt_local, its norm/MLP kernels plain",
          "ours_kernels": "gpt_local, --ours-kernels",
          "eager": "HF {peer}, eager", "sdpa+fused": "HF {peer}, sdpa + fused AdamW",
          "compile": "HF {peer}, torch.compile",
          "ours_bf16": "gpt_local, compute_dtype bfloat16",
          "ours_layer": "gpt_local, train_layer kernel", "ours_layer_bf16": "gpt_local, train_layer kernel, bf16",
          "sdpa+fused-bf16": "HF {peer}, sdpa + fused AdamW, bf16 autocast",
          "compile-bf16": "HF {peer}, torch.compile, bf16 autocast"}


def label(side, s):
    """The table's name of ``side`` for shape ``s`` (the HF model it trains: GPT-2 or Llama)."""
    return LABELS[side].format(peer="Llama" if s.get("arch") == "llama" else "GPT-2")
# the sides run through gptlocal run
OURS = ("ours", "ours_plain", "ours_kernels", "ours_bf16", "ours_layer", "ours_layer_bf16")
BF16_SIDES = ("ours_bf16", "ours_layer_bf16", *C.TORCH_BF16_VARIANTS)


def side_yaml(side, s, steps, corpus, workdir, name, threads, model_extra=None):
    """Our side's YAML: the tiny one resized (``_common.ours_yaml``); ours_plain's model_config also holds
    cpu_kernels {layer_norm: plain, bias_gelu: plain} (MindSpore's LayerNorm and Add + GeLU instead of our kernels;
    a Llama-style shape's {rms_norm: plain, swiglu: plain}); ours_bf16's compute_dtype bfloat16; ours_layer's
    cpu_kernels {train_layer: kernel}, ours_layer_bf16's with compute_dtype bfloat16 too."""
    if side == "ours_plain":
        plain = PLAIN_RMS_SWIGLU if s.get("arch") == "llama" else PLAIN_NORM_GELU
        model_extra = dict(model_extra or {}, cpu_kernels=dict(plain))
    if side in ("ours_bf16", "ours_layer_bf16"):
        model_extra = dict(model_extra or {}, **BF16)
    if side in ("ours_layer", "ours_layer_bf16"):
        model_extra = dict(model_extra or {}, **TRAIN_LAYER)
    return C.ours_yaml(s, steps, corpus, workdir, name, threads, model_extra=model_extra)


def measure(side, s, steps, corpus, windows, workdir, threads, name, model_extra=None):
    """One run of ``side``: its worker's report. A bf16 side that cannot run here (this tree or CPU) reports
    ``{"failed": its one error line}`` instead of stopping the benchmark."""
    one_line = side in BF16_SIDES
    if side in OURS:
        yaml_path = side_yaml(side, s, steps, corpus, workdir, name, threads, model_extra)
        report, text = C.run_worker(__file__, ["--ms-worker", yaml_path, "--threads", str(threads)], threads,
                                    one_line=one_line)
        if "failed" in report:
            return report
        report["step_times"] = C.ms_step_times(text)[0][:steps]  # (short data is read again: more steps)
        report["graph_compile_s"] = C.ms_graph_compile_seconds(text)  # the run's own timing of the compile
        if len(report["step_times"]) != steps:
            raise SystemExit(f"ours: {len(report['step_times'])} step lines, expected {steps}:\n{text[-3000:]}")
    else:
        report, _ = C.run_worker(__file__, ["--torch-worker", json.dumps(s), "--variant", side, "--steps", str(steps),
                                            "--data", windows, "--threads", str(threads)], threads, one_line=one_line)
    return report


def summarise(report, s, warmup, peak):
    step = C.steady_median(report["step_times"], warmup)
    tokens = s["batch"] * s["seq"] / step
    first = report["step_times"][0]
    return dict(report, tokens_per_s=tokens, step_s=step, first_step_s=first, compile_s=max(first - step, 0.0),
                mfu=tokens * C.flops_per_token(s) / (peak * 1e9))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,small", help=f"comma list of {list(C.SHAPES)}")
    parser.add_argument("--seq-length", type=int, help="tokens per row (default 256)")
    parser.add_argument("--batch-size", type=int, help="rows per step (default 4 tiny, 2 small)")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default 20 tiny shapes, 8 the others)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--torch-variants", default=",".join(C.TORCH_VARIANTS),
                        help=f"comma list of {list(C.TORCH_VARIANTS) + list(C.TORCH_BF16_VARIANTS)} (compile costs "
                             "~30 s a run for GPT-2 small; *-bf16: under torch.autocast bfloat16)")
    parser.add_argument("--attention-block-size", type=int, default=0,
                        help="ours: model_config.attention_block_size (memory-efficient attention; 0 = plain)")
    parser.add_argument("--ours-plain", action="store_true",
                        help="also run ours with model_config.cpu_kernels {layer_norm: plain, bias_gelu: plain} "
                             "(MindSpore's LayerNorm and Add + GeLU instead of the kernels)")
    parser.add_argument("--ours-kernels", metavar="OPS",
                        help="also run ours with these cpu_kernels ops (a comma list, e.g. head_loss) set to kernel")
    parser.add_argument("--ours-bf16", action="store_true",
                        help="also run ours with model_config.compute_dtype bfloat16")
    parser.add_argument("--ours-train-layer", action="store_true",
                        help="also run ours with model_config.cpu_kernels {train_layer: kernel} (and, with "
                             "--ours-bf16, the same in bfloat16)")
    parser.add_argument("--json", help="also write every run's numbers here")
    parser.add_argument("--ms-worker", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", help=argparse.SUPPRESS)
    parser.add_argument("--gemm-worker", choices=("torch", "mindspore"), help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="sdpa+fused", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ms_worker:
        return C.ms_train_worker(args.ms_worker, args.threads)
    if args.torch_worker:
        return C.torch_train_worker(json.loads(args.torch_worker), args.steps, args.data, args.threads, args.variant)
    if args.gemm_worker:
        return C.gemm_worker(args.gemm_worker, args.threads)

    variants = [v for v in args.torch_variants.split(",") if v]
    unknown = [v for v in variants if v not in SIDES[1:]]
    if unknown:
        raise SystemExit(f"--torch-variants: unknown {unknown}; choose from {list(SIDES[1:])}")
    layer = ("ours_layer", *(("ours_layer_bf16",) if args.ours_bf16 else ())) if args.ours_train_layer else ()
    sides = ("ours", *(("ours_plain",) if args.ours_plain else ()), *(("ours_kernels",) if args.ours_kernels else ()),
             *(("ours_bf16",) if args.ours_bf16 else ()), *layer, *variants)
    unknown = [name for name in args.shapes.split(",") if name not in C.SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {list(C.SHAPES)}")
    shapes = {name: C.shape_with(name, args.batch_size, args.seq_length) for name in args.shapes.split(",")}
    seq = next(iter(shapes.values()))["seq"]
    workdir = C.scratch_dir("gptlocal-bench-")
    corpus, windows, count = C.prepare_windows(workdir, seq, args.threads)
    gemm = {fw: C.run_worker(__file__, ["--gemm-worker", fw, "--threads", str(args.threads)], args.threads)[0]["gflops"]
            for fw in ("torch", "mindspore")}
    peak = max(gemm.values())
    print(C.machine_line(args.threads), flush=True)
    bf16 = any(side in BF16_SIDES for side in sides)
    if bf16:
        print(C.precision_line(), flush=True)
    print(f"fp32 GEMM 2048^3 here: torch {gemm['torch']:.0f} GFLOP/s, MindSpore {gemm['mindspore']:.0f} GFLOP/s; "
          f"MFU below is against the higher, {peak:.0f}", flush=True)
    rows, failed = {}, {}
    for name, s in shapes.items():
        steps = args.steps or (20 if "tiny" in name else 8)

        def one(side, index, name=name, s=s, steps=steps):
            if side in failed:
                return None
            extra = {"attention_block_size": args.attention_block_size} if args.attention_block_size else None
            if side == "ours_kernels":
                extra = dict(extra or {}, cpu_kernels=dict.fromkeys(args.ours_kernels.split(","), "kernel"))
            report = measure(side, s, steps, corpus, windows, workdir, args.threads, f"{side}_{name}_{index}", extra)
            if "failed" in report:  # one line; the side leaves the table, the others run
                print(f"{name} round {index + 1} {side}: failed: {report['failed']}", flush=True)
                failed[side] = report["failed"]
                return None
            report = summarise(report, s, args.warmup, peak)
            graph = report.get("graph_compile_s")
            graph = "" if graph is None else f", the step graph's own {graph:.1f} s"
            print(f"{name} round {index + 1} {side:15} {report['tokens_per_s']:8.0f} tokens/s  first step "
                  f"{report['first_step_s']:6.1f} s (compile ~{report['compile_s']:.1f} s{graph})  peak RSS "
                  f"{report['peak_rss_mb']:6.0f} MB  threads: C env "
                  f"{report['env']}, runtime {report['runtime_threads']}", flush=True)
            return report
        runs = C.alternate(sides, args.rounds, one)
        rows[name] = (s, steps, {side: [r for r in reports if r] for side, reports in runs.items()})

    print(f"\n{C.machine_line(args.threads)}")
    if bf16:
        print(C.precision_line())
    print(f"fp32 GEMM peak (2048^3, best of 7, this run): torch {gemm['torch']:.0f} GFLOP/s, MindSpore "
          f"{gemm['mindspore']:.0f} GFLOP/s; MFU against {peak:.0f}. {args.rounds} rounds, sides alternating; "
          f"median [min-max] over rounds; tokens/s from the median step after {args.warmup} warm-up steps.\n")
    if args.attention_block_size:
        print(f"ours: model_config.attention_block_size {args.attention_block_size}\n")
    ours_bf16 = "ours_bf16" in sides
    print(f"| shape | batch x seq | side | tokens/s | vs ours |{' vs ours bf16 |' if ours_bf16 else ''} compile s | "
          f"peak RSS MB | MFU |")
    print(f"| --- | --- | --- | ---: | ---: |{' ---: |' if ours_bf16 else ''} ---: | ---: | ---: |")
    for name, (s, steps, results) in rows.items():
        ours = C.median([r["tokens_per_s"] for r in results["ours"]])
        ours_b = C.median([r["tokens_per_s"] for r in results["ours_bf16"]]) if ours_bf16 else None
        for side in sides:
            runs = results[side]
            if not runs:
                continue
            rate = C.median([r["tokens_per_s"] for r in runs])
            compiles = side in (*OURS, "compile", "compile-bf16")
            print(f"| {name} ({C.params_count(s) / 1e6:.0f}M) | {s['batch']} x {s['seq']} | {label(side, s)} | "
                  f"{C.spread([r['tokens_per_s'] for r in runs])} | {ours / rate:.2f}x | "
                  f"{(f'{ours_b / rate:.2f}x' if ours_b else '-') + ' | ' if ours_bf16 else ''}"
                  f"{C.spread([r['compile_s'] for r in runs], '{:.1f}') if compiles else '-'} | "
                  f"{C.spread([r['peak_rss_mb'] for r in runs])} | "
                  f"{100 * C.median([r['mfu'] for r in runs]):.0f}% |")
    for side, reason in failed.items():
        print(f"\n{side}: not in the table, its worker failed: {reason}")
    if any(r["mfu"] > 1.0 for _, _, results in rows.values() for runs in results.values() for r in runs):
        print("\nWARNING: an MFU above 100%: the GEMM peak measured at the start was below what a step reached "
              "(a busy machine at that moment?); rerun on a quiet machine.")
    print("\n'vs ours' = ours / that side (above 1: ours faster); 'vs ours bf16' the same for ours_bf16. "
          "'compile s' = first step - median step: ours compiles the training graph in its first step (and "
          "its first run is slower than later ones: the per-run lines above give the graph's compile alone, as the "
          "run prints it), torch.compile its graphs (issue #15 target for GPT-2 small: <= 20 s).")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "gemm_gflops": gemm,
                       "results": {n: {"shape": s, "runs": r} for n, (s, _, r) in rows.items()}}, handle, indent=1)


if __name__ == "__main__":
    main()
