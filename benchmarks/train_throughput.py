"""Train a DSpark draft for SmolLM2-135M-Instruct on its own answers and measure training throughput.

Reports supervised block tokens/s (valid draft slots per second, after warm-up), peak memory, the
training-time acceptance estimates (tau_prob, tau_greedy, accept@k) on held-out conversations, and, for a
cached run, the cache's size in bytes per token and its build time. The trained draft is saved to --output_dir
(keep it outside git; the evaluation issue reads it from there).

    # all 10,240 conversations, the target online (a full bf16 cache of them would take ~30 GB)
    python benchmarks/train_throughput.py --data ../shared/data/responses/smollm2-135m-instruct.jsonl.gz \
        --mode online --time_budget 360 --output_dir /tmp/dspark-smollm2 \
        --output benchmarks/results/train_throughput_online.json
    # from a cache of a subset: cache bytes/token and cached-mode throughput
    python benchmarks/train_throughput.py --data ... --mode cached --num_rows 2048 --cache_dir /tmp/smollm2-cache \
        --time_budget 120 --output_dir /tmp/dspark-smollm2-cached \
        --output benchmarks/results/train_throughput_cached.json
    python benchmarks/train_throughput.py --data ... --device cpu --smoke     # a few steps on CPU

Everything goes through the public training API: tokenize_conversations -> (build_target_cache ->
load_target_cache) -> DraftTrainer. Batches are padded to --pad_to_multiple_of (default: max_length), so the
compiled flex_attention kernels see one shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import add_draft_shape_args, bench_training_args  # noqa: E402

from hf_dspark.data import build_target_cache, load_conversations, load_target_cache, tokenize_conversations
from hf_dspark.training import DraftTrainer, build_draft
from hf_dspark.training.loss_buffers import DEFAULT_CHUNK_ELEMENTS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="conversations answered by the target (JSONL(.gz))")
    p.add_argument("--target_model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--algorithms", nargs="+", default=["dspark"], choices=["dspark", "dflash", "eagle3"],
                   help="drafters to train one after another on the same data (same steps: see --same_steps)")
    p.add_argument("--same_steps", action=argparse.BooleanOptionalAction, default=True,
                   help="later drafters train for as many steps as the first one reached in its time budget")
    p.add_argument("--mode", choices=["online", "cached"], default="online")
    p.add_argument("--cache_dir", default="/tmp/hf_dspark_bench_cache", help="cache folder (reused when present)")
    p.add_argument("--cache_dtype", default="bf16", choices=["bf16", "fp16", "fp8"])
    p.add_argument("--probe_cache_rows", type=int, default=0,
                   help="also build bf16 and fp8 caches of this many held-out rows and report their bytes/token")
    p.add_argument("--output_dir", default="/tmp/hf_dspark_bench_draft", help="where the trained draft is saved")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny run: few rows, short sequences, 3 steps")
    p.add_argument("--num_rows", type=int, default=None, help="training conversations (default: all)")
    p.add_argument("--eval_rows", type=int, default=256, help="held-out conversations for the tau estimates")
    add_draft_shape_args(p)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=6e-4)
    p.add_argument("--warmup_steps", type=int, default=50, help="linear LR warm-up, then constant")
    p.add_argument("--lr_scheduler_type", default="constant_with_warmup",
                   help="constant after warm-up: runs stopped by a time budget see the same schedule")
    p.add_argument("--max_steps", type=int, default=2000, help="upper bound; --time_budget usually stops first")
    p.add_argument("--time_budget", type=float, default=300.0,
                   help="seconds of training per drafter, counted from the end of the first (compiling) step")
    p.add_argument("--warmup_steps_excluded", type=int, default=5, help="first steps left out of tokens/s")
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "dense"],
                   help="the draft's training attention (block_mask_kind): auto is each drafter's default")
    p.add_argument("--compile_loss", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--compile_draft_layers", nargs="+", choices=["off", "on"], default=None,
                   help="train each drafter with its layer methods eager (off), compiled (on), or both in turn "
                   "(default: the trainer's, on for CUDA)")  # fmt: skip
    p.add_argument("--loss_rows", nargs="+", choices=["host", "device"], default=["host"],
                   help="who counts the loss's rows: the collator on the host (the trainer's default, no wait a "
                   "step), the device (one wait a step), or both in turn")  # fmt: skip
    p.add_argument("--intermediate_size", nargs="+", type=int, default=[None],
                   help="draft MLP widths, one run each (default: the target's; e.g. 1536 3072 for SmolLM2)")
    p.add_argument("--batch_copy", nargs="+", choices=["async", "wait"], default=["async"],
                   help="how each batch is copied to the GPU: asynchronously from pinned memory (the trainer's "
                   "default), or waiting for the copy and so for all the work queued before it (one wait a step), "
                   "or both in turn")  # fmt: skip
    p.add_argument("--loss_chunk_elements", nargs="+", type=int, default=[None],
                   help="elements of the loss's [rows, V] fp32 buffer per chunk, one run each (default: the "
                   "trainer's, 2**26: 1,280 rows at V 49,152; larger chunks mean fewer chunks a step, so fewer "
                   "launches and compiled calls for the host to issue)")  # fmt: skip
    p.add_argument("--target_cuda_graphs", nargs="+", choices=["off", "on"], default=None,
                   help="the online target's forward plain (off) or replayed from CUDA graphs (on: the trainer's "
                   "target_cuda_graphs), or both in turn; default as the trainer: on with CUDA")  # fmt: skip
    p.add_argument("--loss_cuda_graphs", nargs="+", choices=["off", "on"], default=["off"],
                   help="the loss's forward issued chunk by chunk (off, the trainer's default) or replayed from CUDA "
                   "graphs (on: the trainer's loss_cuda_graphs), or both in turn")  # fmt: skip
    p.add_argument("--dataloader_num_workers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.smoke:
        args.num_rows, args.eval_rows, args.max_length = 16, 4, 192
        args.num_hidden_layers, args.num_anchors, args.batch_size = 1, 32, 4
        args.max_steps, args.time_budget, args.warmup_steps_excluded, args.warmup_steps = 3, 600.0, 1, 1
    if args.pad_to_multiple_of is None:
        args.pad_to_multiple_of = args.max_length
    if args.compile_loss is None:
        args.compile_loss = cuda
    if args.compile_draft_layers is None:
        args.compile_draft_layers = ["on" if cuda else "off"]
    if args.target_cuda_graphs is None:
        args.target_cuda_graphs = ["on" if cuda else "off"]
    if args.dataloader_num_workers is None:
        args.dataloader_num_workers = 2 if cuda and args.mode == "cached" else 0
    return args


class Throughput(TrainerCallback):
    """Wall time and supervised block tokens between the end of warm-up and the end of training; time budget; the
    median step. With padding to several lengths each new length compiles mid-run, seconds that the mean carries
    (and the first configuration of a process alone pays) and the median leaves out. On CUDA a step's time is read
    from events recorded on the device's stream at each step end (the interval between two step ends on the
    device, its waits for the host included), so measuring adds no wait to the free-running loop."""

    def __init__(self, trainer_ref, warmup_steps: int, time_budget: float, cuda: bool):
        self.trainer_ref, self.warmup_steps, self.time_budget, self.cuda = trainer_ref, warmup_steps, time_budget, cuda
        self.start_time = self.start_tokens = self.end_time = self.end_tokens = None
        self.train_start = None
        self.steps = 0
        self.step_ends: list = []  # torch.cuda.Event on CUDA, perf_counter seconds elsewhere

    def median_step_s(self) -> float:
        import statistics

        ends = self.step_ends
        if self.cuda:
            torch.cuda.synchronize()
            gaps = [a.elapsed_time(b) / 1000 for a, b in zip(ends, ends[1:])]
        else:
            gaps = [b - a for a, b in zip(ends, ends[1:])]
        gaps = gaps[self.warmup_steps - 1 :]  # gaps[i] is step i + 2
        return statistics.median(gaps) if gaps else float("nan")

    def _mark(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter(), float(self.trainer_ref[0].supervised_tokens_seen)

    def on_step_end(self, args, state, control, **kw):
        self.steps = state.global_step
        if self.cuda:
            self.step_ends.append(torch.cuda.Event(enable_timing=True))
            self.step_ends[-1].record()
        else:
            self.step_ends.append(time.perf_counter())
        if state.global_step == 1:  # the first step compiles kernels; the budget starts after it
            self.train_start = time.perf_counter()
        if state.global_step == self.warmup_steps:
            self.start_time, self.start_tokens = self._mark()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
        if time.perf_counter() - self.train_start > self.time_budget:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kw):
        self.end_time, self.end_tokens = self._mark()


def main(argv=None):
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    setup_start = time.perf_counter()
    target_path = args.target_model
    if target_path is None:
        from hf_dspark.resources import default_target_path

        target_path = str(default_target_path())
    dtype = torch.bfloat16 if cuda else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)

    conversations = load_conversations(args.data)
    wanted = (args.num_rows or len(conversations)) + args.eval_rows
    conversations = conversations.select(range(min(wanted, len(conversations))))
    rows = tokenize_conversations(conversations, tokenizer, max_length=args.max_length)
    split = rows.train_test_split(test_size=args.eval_rows, seed=args.seed)
    train_rows, eval_rows = split["train"], split["test"]
    setup_s = time.perf_counter() - setup_start
    cache_probe = probe_cache_sizes(args, target, tokenizer, eval_rows) if args.probe_cache_rows else {}

    results, max_steps = [], args.max_steps
    report = {
        "benchmark": "train_throughput",
        "command": "python " + " ".join(sys.argv),
        "smoke": args.smoke,
        "device": torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "target": target_path,
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        "cache_probe": cache_probe,
        "runs": results,
    }
    variants = [(a, c, r, b, w, e, g, lg) for a in args.algorithms for c in args.compile_draft_layers
                for r in args.loss_rows for b in args.batch_copy for w in args.intermediate_size
                for e in args.loss_chunk_elements for g in args.target_cuda_graphs
                for lg in args.loss_cuda_graphs]  # fmt: skip
    for index, (algorithm, compiled_layers, loss_rows, batch_copy, width, chunk, graphs, loss_graphs) in enumerate(
        variants
    ):
        name = algorithm + ("-compiled-layers" if compiled_layers == "on" else "") + f"-{loss_rows}-rows"
        name += "-copy-wait" if batch_copy == "wait" else ""
        name += "-target-graphs" if graphs == "on" else ""
        name += "-loss-graphs" if loss_graphs == "on" else ""
        name += f"-mlp{width}" if width else ""
        name += f"-chunk{chunk}" if chunk else ""
        output_dir = str(Path(args.output_dir) / name) if len(variants) > 1 else args.output_dir
        result = train_one(args, algorithm, max_steps, target, tokenizer, train_rows, eval_rows, output_dir, cuda,
                           compile_draft_layers=compiled_layers == "on", loss_rows=loss_rows,
                           batch_copy=batch_copy, intermediate_size=width, loss_chunk_elements=chunk,
                           target_cuda_graphs=graphs == "on", loss_cuda_graphs=loss_graphs == "on")  # fmt: skip
        result["setup_s"] = setup_s
        results.append(result)
        if index == 0 and args.same_steps:
            max_steps = result["steps"]  # later runs: the same number of optimizer steps
        if args.output:  # after every run: a run stopped later keeps the finished ones
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2)
    print_table(results)
    for dtype, info in cache_probe.items():
        print(f"cache probe {dtype}: {info['bytes_per_token']:.0f} bytes/token over {info['tokens']} tokens "
              f"(DeepSpec layout: {info['deepspec_bytes_per_token']}); build {info['build_s']:.1f} s")
    return report


def probe_cache_sizes(args, target, tokenizer, eval_rows) -> dict:
    """Bytes per token of real target caches (bf16 and fp8) built from a few held-out rows."""
    from hf_dspark.models.target import TargetSpec, default_target_layer_ids

    layers = default_target_layer_ids(TargetSpec.from_model(target).num_hidden_layers)
    rows = eval_rows.select(range(min(args.probe_cache_rows, len(eval_rows))))
    probe = {}
    for dtype in ("bf16", "fp8"):
        start = time.perf_counter()
        path = build_target_cache(
            target, rows, Path(args.cache_dir) / f"probe-{dtype}", target_layer_ids=layers, tokenizer=tokenizer,
            max_length=args.max_length, batch_size=16, dtype=dtype, process_index=0, num_processes=1,
        )  # fmt: skip
        manifest = load_target_cache(path).metadata
        probe[dtype] = {
            "bytes_per_token": manifest.get("bytes_per_token"),
            "deepspec_bytes_per_token": manifest.get("deepspec_bytes_per_token"),
            "tokens": manifest.get("total_tokens"),
            "build_s": time.perf_counter() - start,
            "target_layer_ids": layers,
        }
    return probe


def train_one(args, algorithm, max_steps, target, tokenizer, train_rows, eval_rows, output_dir, cuda,
              compile_draft_layers=False, loss_rows="host", batch_copy="async", intermediate_size=None,
              loss_chunk_elements=None, target_cuda_graphs=False, loss_cuda_graphs=False) -> dict:
    """Train one drafter (online or from a cache) and measure it."""
    training_args = bench_training_args(
        args, algorithm, output_dir, cuda,
        compile_draft_layers=compile_draft_layers,
        target_cuda_graphs=target_cuda_graphs,
        loss_cuda_graphs=loss_cuda_graphs,
        accelerator_config={"non_blocking": batch_copy == "async"},
        intermediate_size=intermediate_size,
        loss_chunk_elements=loss_chunk_elements,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=max_steps,
        logging_steps=50 if not args.smoke else 1,
        disable_tqdm=False,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    draft = build_draft(target, training_args)
    draft.block_mask_kind = args.attention

    cache_info = {}
    online_target = target
    train_data, eval_data = train_rows, eval_rows
    if args.mode == "cached":
        start = time.perf_counter()
        paths = {}
        for name, part in (("train", train_rows), ("eval", eval_rows)):
            paths[name] = build_target_cache(
                target, part, Path(args.cache_dir) / name, target_layer_ids=draft.config.target_layer_ids,
                tokenizer=tokenizer, max_length=args.max_length, batch_size=16, dtype=args.cache_dtype,
                process_index=0, num_processes=1,
            )  # fmt: skip
        train_data = load_target_cache(paths["train"], draft_config=draft.config, target=target)
        eval_data = load_target_cache(paths["eval"], draft_config=draft.config, target=target)
        manifest = train_data.metadata
        cache_info = {
            "cache_build_or_reuse_s": time.perf_counter() - start,
            "cache_dtype": args.cache_dtype,
            "cache_bytes_per_token": manifest.get("bytes_per_token"),
            "cache_total_tokens": manifest.get("total_tokens"),
            "cache_total_gib": (manifest.get("total_bytes") or 0) / 2**30,
            "deepspec_bytes_per_token": manifest.get("deepspec_bytes_per_token"),
        }
        online_target = None

    trainer_ref = []
    meter = Throughput(trainer_ref, args.warmup_steps_excluded, args.time_budget, cuda)
    trainer = DraftTrainer(
        model=draft, args=training_args, train_dataset=train_data, eval_dataset=eval_data,
        target_model=online_target, callbacks=[meter],
    )  # fmt: skip
    if loss_rows == "device":  # the loss counts its rows on the device: one wait a step (the trainer's way before)
        trainer.data_collator = dataclasses.replace(trainer.data_collator, loss_rows_bound=False)
    trainer_ref.append(trainer)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    trainer.save_model(output_dir)
    metrics = trainer.evaluate()

    measured = meter.start_time is not None and meter.end_time > meter.start_time
    seconds = (meter.end_time - meter.start_time) if measured else float("nan")
    tokens = (meter.end_tokens - meter.start_tokens) if measured else float("nan")
    slots = [metrics.get(f"eval_accept@{k}") for k in range(1, args.block_size + 1)]
    return {
        "algorithm": algorithm,
        "mode": args.mode,
        "draft": {"layers": draft.config.num_hidden_layers, "intermediate_size": draft.config.intermediate_size,
                  "block_size": args.block_size,
                  "anchors": None if algorithm == "eagle3" else args.num_anchors,
                  "target_layer_ids": draft.config.target_layer_ids,
                  "trainable_params": sum(p.numel() for p in draft.parameters() if p.requires_grad)},  # fmt: skip
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "learning_rate": args.learning_rate,
        "lr_scheduler": f"{args.lr_scheduler_type}, {args.warmup_steps} warm-up steps",
        "steps": meter.steps,
        "train_s": train_s,
        "measured_steps": meter.steps - args.warmup_steps_excluded,
        "measured_s": seconds,
        "median_step_ms": 1000 * meter.median_step_s(),
        "supervised_block_tokens": tokens,
        "supervised_block_tokens_per_s": tokens / seconds if measured else float("nan"),
        "peak_memory_gib": peak,
        "peak_memory_kind": "torch.cuda.max_memory_allocated (after warm-up)" if cuda else "process max RSS",
        "heldout": {
            "loss": metrics.get("eval_loss"),
            "tau_prob": metrics.get("eval_tau_prob"),
            "tau_greedy": metrics.get("eval_tau_greedy"),
            "accept_at_k": slots,
        },
        "attention": args.attention,
        "compile_loss": args.compile_loss,
        "compile_draft_layers": compile_draft_layers,
        "loss_rows_counted_on": loss_rows,
        "batch_copy": "async" if training_args.accelerator_config.non_blocking else "wait",  # as the trainer ran
        "target_cuda_graphs": target_cuda_graphs,
        # the trainer's record: None where no graphs were asked for, else why they were given up (None: they ran)
        "target_graphs_failed": (trainer._target_graphs.failed if trainer._target_graphs is not None else None),
        "loss_cuda_graphs": loss_cuda_graphs,
        # the same for the loss's graphs, and how many were captured
        "loss_graphs_failed": (trainer._loss_graphs.failed if trainer._loss_graphs is not None else None),
        "loss_graphs_captured": trainer._loss_graphs.captures if trainer._loss_graphs is not None else 0,
        "loss_chunk_elements": training_args.loss_chunk_elements or DEFAULT_CHUNK_ELEMENTS,  # as the trainer ran
        "draft_dir": output_dir,
        **cache_info,
    }


def print_table(results: list[dict]) -> None:
    fmt = lambda x, spec: "n/a" if x is None or x != x else format(x, spec)  # noqa: E731
    print("\n| drafter | steps | measured s | median step ms | supervised tokens/s | peak GiB "
          "| held-out tau_prob / tau_greedy | accept@1..K | cache B/token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        h = r["heldout"]
        compiled = ", compiled layers" if r.get("compile_draft_layers") else ""
        compiled += ", rows counted on the device" if r.get("loss_rows_counted_on") == "device" else ""
        compiled += ", waiting for each batch's copy" if r.get("batch_copy") == "wait" else ""
        compiled += ", target from CUDA graphs" if r.get("target_cuda_graphs") else ""
        compiled += ", loss from CUDA graphs" if r.get("loss_cuda_graphs") else ""
        if r.get("loss_chunk_elements", DEFAULT_CHUNK_ELEMENTS) != DEFAULT_CHUNK_ELEMENTS:
            compiled += f", loss chunks of {r['loss_chunk_elements']:,} elements"
        shape = f"{r['draft']['layers']} layers, MLP {r['draft']['intermediate_size']}"
        print(f"| {r['algorithm']} ({shape}{compiled}) | {r['steps']} "
              f"| {fmt(r['measured_s'], '.1f')} | {fmt(r.get('median_step_ms'), '.1f')} "
              f"| {fmt(r['supervised_block_tokens_per_s'], ',.0f')} | {r['peak_memory_gib']:.2f} "
              f"| {fmt(h['tau_prob'], '.3f')} / {fmt(h['tau_greedy'], '.3f')} "
              f"| {' '.join(fmt(x, '.2f') for x in h['accept_at_k'])} "
              f"| {fmt(r.get('cache_bytes_per_token'), '.0f')} |")
    print(f"drafts saved under: {', '.join(r['draft_dir'] for r in results)}")


if __name__ == "__main__":
    main()
