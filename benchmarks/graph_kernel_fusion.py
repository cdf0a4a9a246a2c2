"""Whole-model training step with MindSpore's graph-kernel fusion (AKG) on and off: gpt_local only.

    python benchmarks/graph_kernel_fusion.py                         # tiny 4 x 256, off vs on, 3 rounds
    python benchmarks/graph_kernel_fusion.py --shapes tiny,small --variants off,on,off_passive,on_passive
    python benchmarks/graph_kernel_fusion.py --variant-flags 'mine=--disable_expand_ops=Gelu'

Each run is ``gptlocal run`` on the tiny pretrain YAML resized to the shape (as in train_throughput.py)
in its own worker process (so VmHWM is its own peak RSS, and the compile is its own), with the YAML's
``context`` extended by the variant: ``off`` = no graph-kernel keys; ``on`` = ``enable_graph_kernel: True``;
the others add ``graph_kernel_flags``; ``*_passive`` start the worker with OMP_WAIT_POLICY=PASSIVE.
Variants run alternately (A B C, C B A, ...).
tokens/s = batch x seq / median step after --warmup steps; compile s = first step - median step; the losses of every run are printed
so the variants can be compared for exactness.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)

VARIANTS = {
    "off": {},
    "on": {"enable_graph_kernel": True},
    # what the CPU default touches minus the element-wise expanders (clusters only)
    "on_ln": {"enable_graph_kernel": True, "graph_kernel_flags": "--enable_expand_ops=LayerNorm,LayerNormGrad"},
    "on_o2": {"enable_graph_kernel": True, "graph_kernel_flags": "--opt_level=2"},
}
# AKG's CPU kernels run in `#pragma omp parallel` regions (libgomp); libgomp's idle threads spin (the
# default OMP_WAIT_POLICY) against MindSpore's own thread pool. "_passive" variants start the worker with
# OMP_WAIT_POLICY=PASSIVE (it must be set before libgomp loads, i.e. before `import mindspore`).
for _name in ("off", "on", "on_ln", "on_o2"):
    VARIANTS[_name + "_passive"] = dict(VARIANTS[_name], _env={"OMP_WAIT_POLICY": "PASSIVE"})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny", help=f"comma list of {sorted(C.SHAPES)}")
    parser.add_argument("--variants", default="off,on",
                        help=f"comma list of {sorted(VARIANTS)} or --variant-flags names")
    parser.add_argument("--variant-flags", action="append", default=[],
                        help="NAME=FLAGS: a variant with enable_graph_kernel True and graph_kernel_flags FLAGS")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default 20 tiny, 8 small)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--ms-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ms_worker:
        return C.ms_train_worker(args.ms_worker, args.threads)
    variants = dict(VARIANTS)
    for item in args.variant_flags:
        name, _, flags = item.partition("=")
        variants[name] = {"enable_graph_kernel": True, "graph_kernel_flags": flags}
    sides = [v for v in args.variants.split(",") if v]
    unknown = [v for v in sides if v not in variants]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(variants)}")
    from mindformers_gptlocal import yaml_io
    shapes = {name: C.shape_with(name) for name in args.shapes.split(",")}
    workdir = C.scratch_dir("gptlocal-gk-")
    corpus, _, _ = C.prepare_windows(workdir, 256, args.threads)
    print(C.machine_line(args.threads), flush=True)
    rows = {}
    for name, s in shapes.items():
        steps = args.steps or (20 if name == "tiny" else 8)

        def one(side, index, name=name, s=s, steps=steps):
            path = C.ours_yaml(s, steps, corpus, workdir, f"{side}_{name}_{index}", args.threads)
            config = yaml_io.load_yaml(path)
            context = dict(variants[side])
            env = context.pop("_env", {})
            config["optimizer"].update(context.pop("_optimizer", {}))
            config["context"].update(context)
            yaml_io.dump_yaml(config, path)
            report, text = C.run_worker(__file__, ["--ms-worker", path, "--threads", str(args.threads)], args.threads,
                                        **env)
            times = C.ms_step_times(text)[0][:steps]
            if len(times) != steps:
                raise SystemExit(f"{side}: {len(times)} step lines, expected {steps}:\n{text[-3000:]}")
            import re
            losses = [float(x) for x in re.findall(r"\[gpt_local\] step \d+/\d+\s+loss (\S+)", text)][:steps]
            step = C.steady_median(times, args.warmup)
            report.update(tokens_per_s=s["batch"] * s["seq"] / step, compile_s=max(times[0] - step, 0.0),
                          losses=losses)
            print(f"{name} round {index + 1} {side:12} {report['tokens_per_s']:8.0f} tokens/s  compile "
                  f"~{report['compile_s']:.1f} s  peak RSS {report['peak_rss_mb']:6.0f} MB  losses "
                  f"{' '.join(f'{x:.6f}' for x in losses[:4])}", flush=True)
            return report
        rows[name] = (s, C.alternate(sides, args.rounds, one))

    print(f"\n{C.machine_line(args.threads)}\n{args.rounds} rounds, variants alternating; median [min-max].\n")
    print("| shape | variant | tokens/s | vs off | compile s | peak RSS MB | max loss diff vs first variant |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (s, results) in rows.items():
        base = C.median([r["tokens_per_s"] for r in results[sides[0]]])
        ref = results[sides[0]][0]["losses"]
        for side in sides:
            runs = results[side]
            rate = C.median([r["tokens_per_s"] for r in runs])
            diff = max(abs(a - b) for r in runs for a, b in zip(r["losses"], ref))
            print(f"| {name} {s['batch']} x {s['seq']} | {side} | {C.spread([r['tokens_per_s'] for r in runs])} | "
                  f"{rate / base:.2f}x | {C.spread([r['compile_s'] for r in runs], '{:.1f}')} | "
                  f"{C.spread([r['peak_rss_mb'] for r in runs])} | {diff:.2e} |")
    print("\nvariants:", {v: variants[v] for v in sides})


if __name__ == "__main__":
    main()
