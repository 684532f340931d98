"""`DraftTrainer`: a `Trainer` whose loss is the drafter's objective, fed from a target cache or a live target.

    trainer = DraftTrainer(model=draft, args=DraftTrainingArguments(...), train_dataset=cache)          # cached
    trainer = DraftTrainer(model=draft, args=..., train_dataset=tokenized, target_model=target)        # online

Only `compute_loss` (plus collation, evaluation through the same loss, and metric logging) differs from
`Trainer`: checkpoints are `save_pretrained` folders of the draft, resuming works as for any Trainer run, and
`accelerate launch` / DeepSpeed place it.

Online mode: the frozen target is kept out of the optimizer and out of DDP/DeepSpeed wrapping; inside
`compute_loss` it runs under no_grad on the training device and yields the same context features and final
hidden states a cache stores.

Anchors are sampled here, not inside the draft, from a generator on the training device seeded by (data_seed or
seed, global step, micro-step, process index): a run resumed from a checkpoint, and online vs cached training on
the same data, see the same anchors. The number of blocks per row is min(num_anchors, T - 1), a function of the
padded length only, so compiled attention kernels see few distinct shapes; the collator counts on the host how
many loss rows a batch has at most (`loss_rows_bound_fn`) and batches reach the GPU by asynchronous copies
(`DraftTrainingArguments` turns accelerate's `non_blocking` on), so a step has no host synchronization.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import statistics
import time
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function
from transformers import Trainer, TrainerCallback, enable_full_determinism, set_seed
from transformers.trainer_callback import ExportableState, ProgressCallback

from ..compilation import compile_mark, compile_report, compile_seconds_since, keep_compilation_records
from ..models import DRAFTERS, DraftPreTrainedModel, drafter_classes, drafter_spec
from ..metrics import decoding_walk_estimates
from ..models.anchors import anchor_candidates, covering_anchor_passes, covering_pass_count, sample_anchors
from ..target import decoder_layers, target_features
from .arguments import DraftTrainingArguments, draft_layer_compile_blocker
from .checkpoints import resolve_resume_checkpoint
from .collator import LOSS_ROWS_BOUND, DraftDataCollator
from .compiled_layers import CompiledLayers, compiled_draft_layers
from .loss_graphs import LossGraphs
from .losses import draft_loss
from .step_agreement import StepAgreement
from .stop_signals import StopOnSignal
from .target_graphs import CapturedTargetFeatures
from .zero3 import gathered, refuse_partitioned, zero3_loss_weights

logger = logging.getLogger(__name__)

# torch.profiler ranges around the step's phases ("hf_dspark:target", ":draft", ":loss"): a trace shows them, and
# the profiling benchmarks charge GPU idle time to them.
PROFILE_RANGE = "hf_dspark:"


# Training flags that set a field of some drafters' configs, with what a drafter without the field does instead.
DRAFT_FIELDS = {
    "num_anchors": "they train on every position",
    "markov_rank": "only DSpark drafts have a Markov head",
    "ce_loss_alpha": "Eagle3 trains on the soft cross-entropy against the target distribution",
    "l1_loss_alpha": "Eagle3 trains on the soft cross-entropy against the target distribution",
    "soft_ce_loss_alpha": "Eagle3 trains on the soft cross-entropy alone",
}


def build_draft(target: nn.Module, args: DraftTrainingArguments) -> DraftPreTrainedModel:
    """A fresh draft of `args.algorithm` for `target`, shaped by the draft fields of `args`."""
    config_cls, model_cls = drafter_classes(args.algorithm)
    spec = drafter_spec(args.algorithm)
    overrides = {} if spec.recipe_anchors is None else {"num_anchors": spec.recipe_anchors}
    for name in DRAFT_FIELDS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if not hasattr(config_cls, name):
            raise ValueError(f"{name} does not apply to {args.algorithm} drafts ({DRAFT_FIELDS[name]})")
        overrides[name] = value
    for name in ("use_qk_norm", "intermediate_size"):  # fields every drafter has
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    layers = getattr(args, "num_hidden_layers", None)
    if layers is None:
        layers = spec.recipe_layers
    return model_cls.from_target(
        target,
        target_layer_ids=getattr(args, "target_layer_ids", None),
        num_hidden_layers=layers,
        block_size=getattr(args, "block_size", None),
        **overrides,
    )


def seed_run(args) -> None:
    """Seed python, numpy and torch from `args.seed` as Trainer does (`full_determinism` also makes kernels
    deterministic); called before a draft is built so that the same seed gives the same initial draft."""
    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)


def data_seed(args) -> int:
    """The seed of data sampling (order, held-out split, anchor positions): `data_seed`, else `seed`."""
    return args.data_seed if args.data_seed is not None else args.seed


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; deterministic across runs and processes."""
    seed = 0x9E3779B97F4A7C15
    for part in parts:
        seed = (seed ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
    return seed & 0x7FFFFFFFFFFFFFFF


def _first_row(dataset) -> dict[str, Any] | None:
    try:
        return dataset[0] if len(dataset) else None
    except TypeError:  # an IterableDataset
        return None


class DraftTrainer(Trainer):
    """[`Trainer`] for speculative-decoding drafts (DSpark, DFlash, Eagle3).

    Args:
        model ([`DraftPreTrainedModel`], *optional*): the draft to train. When omitted it is built from
            `target_model` with the draft fields of `args` (`algorithm`, `num_hidden_layers`, `block_size`, ...).
        args ([`DraftTrainingArguments`]): training arguments.
        train_dataset / eval_dataset: a target cache (`load_target_cache`: rows with `context_features` and
            `target_last_hidden`) or a tokenized dataset (`tokenize_conversations`: `input_ids`, `loss_mask`),
            which needs `target_model`.
        target_model (`PreTrainedModel`, *optional*): the frozen target. Required for online training; with a
            cache it only serves to validate that the cache belongs to it.
    """

    _tag_names = ["hf_dspark", "speculative-decoding"]
    _held_whole: list = []  # weights `training_step` holds gathered under ZeRO-3 (see there)

    def __init__(
        self,
        model: DraftPreTrainedModel | None = None,
        args: DraftTrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        target_model: nn.Module | None = None,
        **kwargs,
    ):
        if args is None:
            args = DraftTrainingArguments(output_dir="draft-trainer-output")
        if target_model is not None:
            refuse_partitioned(target_model)
        if model is None:
            if target_model is None:
                raise ValueError("DraftTrainer needs a draft `model`, or a `target_model` to build one from")
            seed_run(args)  # as Trainer does before model_init: the same seed gives the same draft
            model = build_draft(target_model, args)
        if not isinstance(model, DraftPreTrainedModel):
            raise TypeError(
                f"DraftTrainer trains hf_dspark drafts ({', '.join(s.model_class.__name__ for s in DRAFTERS.values())}), "
                f"got {type(model).__name__}"
            )
        if target_model is not None:
            model.check_target(target_model)
        if getattr(args, "anchor_weighting", "uniform") == "walk" and not getattr(
            model.config, "enable_confidence_head", False
        ):
            raise ValueError(
                f"anchor_weighting='walk' weights anchor blocks by the draft's confidence head, and this "
                f"{model.config.model_type} draft has none: train DSpark (with its confidence head), or keep "
                "anchor_weighting='uniform'"
            )
        datasets_ = {"train_dataset": train_dataset}
        if isinstance(eval_dataset, dict):
            datasets_.update({f"eval_dataset[{k}]": v for k, v in eval_dataset.items()})
        elif eval_dataset is not None:
            datasets_["eval_dataset"] = eval_dataset
        for name, dataset in datasets_.items():
            if dataset is not None:
                _check_dataset(name, dataset, model, target_model)
        if data_collator is None:
            pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
            multiple = getattr(args, "pad_to_multiple_of", 8)
            data_collator = DraftDataCollator(pad_token_id=pad, pad_to_multiple_of=multiple)
        if isinstance(data_collator, DraftDataCollator) and data_collator.loss_rows_bound is None:
            # the loss rows counted on the host: a training step then never waits for the device
            data_collator = dataclasses.replace(data_collator, loss_rows_bound=model.loss_rows_bound_fn())
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        # The objective normalizes itself; Trainer only divides by the gradient-accumulation steps.
        self.model_accepts_loss_kwargs = False
        self.deadline = None
        if getattr(self.args, "max_train_minutes", None):
            self.deadline = TrainingDeadline(
                self.args.max_train_minutes,
                show_progress=not self.args.disable_tqdm,
                fit_schedule=getattr(self.args, "fit_schedule_to_budget", True),
            )
            if self.deadline.show_progress:
                self.remove_callback(ProgressCallback)  # a step bar would show max_steps and its ETA
            self.add_callback(self.deadline)
        self.stop_signal = StopOnSignal() if getattr(self.args, "checkpoint_on_signal", True) else None
        if self.stop_signal is not None:
            self.add_callback(self.stop_signal)
        self.target_model = None
        self._compiled_target_layers = None
        self._target_graphs: CapturedTargetFeatures | None = None
        self._unwrapped: dict[int, tuple] = {}  # `_unwrap`'s memo
        self._evaluate_in_grad_mode = True  # until a grad-mode evaluation fails (prediction_step)
        if target_model is not None:
            self.target_model = target_model.to(self.args.device).eval().requires_grad_(False)
            if getattr(self.args, "compile_target", False):
                self._compiled_target_layers = CompiledLayers(decoder_layers(self.target_model))
            if getattr(self.args, "target_cuda_graphs", False) and self.args.device.type == "cuda":
                self._target_graphs = CapturedTargetFeatures(
                    self.target_model, self._compiled_target_layers,
                    quiet=getattr(self.args, "_target_cuda_graphs_defaulted", False),
                )
        self._compiled_draft_layers = self._draft_layer_compiler()
        self._loss_graphs = self._loss_graph_runner()
        self._metrics: dict[str, dict[str, torch.Tensor]] = {"train": defaultdict(float), "eval": defaultdict(float)}
        self._anchor_step, self._anchor_micro = -1, 0
        self.supervised_tokens_seen = torch.zeros((), device=self.args.device)  # this process, no host sync
        self._train_started: float | None = None
        self._compile_mark: dict = {}
        # Time to the first step, as a user waits for it: the process's start to train(), then to step 1's end.
        self.startup_s: float | None = None
        self.startup_phases: dict[str, float] = {}  # what the caller did before this trainer (`train_draft` fills it)
        self.first_step_s: float | None = None
        self.add_callback(_FirstStepTimer(self))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints: True (or "true"/"latest") takes the newest
        complete one in output_dir, and an interrupted folder is an error (see `resolve_resume_checkpoint`)."""
        resume = resolve_resume_checkpoint(
            resume_from_checkpoint, self.args.output_dir, needs_optimizer=not self.args.save_only_model
        )
        if resume is not None and self.deadline is not None:
            self._resume_deadline(Path(resume))
        self._train_started = time.monotonic()  # logs carry elapsed_s: held-out tau against training time
        self.startup_s, self.first_step_s = process_age_s(), None
        self._compile_mark = compile_mark()  # and compile_s: how much of it went to torch.compile
        since_us = keep_compilation_records()
        try:
            result = super().train(resume, *args, **kwargs)
        finally:
            for callback in (self.stop_signal, self.deadline):
                if callback is not None:
                    callback.close()  # handlers back and process groups gone, even on errors
        if self.is_world_process_zero():  # which functions compiled, when, how often and why: compile_report.json
            report = compile_report(since_us)
            output_dir = Path(self.args.output_dir)
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / "compile_report.json").write_text(json.dumps(report, indent=1) + "\n")
            if report["frames"]:
                top = ", ".join(f"{f['function']} {f['seconds']:.1f} s x{f['count']}" for f in report["frames"][:3])
                logger.info("torch.compile took %.1f s of this run in %d compilations (%s); compile_report.json "
                            "says which and why", report["total_s"], report["compilations"], top)  # fmt: skip
        return result

    def _resume_deadline(self, checkpoint: Path) -> None:
        """The time budget's remainder and its planned schedule, as the checkpoint recorded them."""
        stored = json.loads((checkpoint / "trainer_state.json").read_text()).get("stateful_callbacks", {})
        saved = stored.get(type(self.deadline).__name__)
        if saved is None:
            logger.warning("%s records no time-budget state (an older checkpoint): the resumed run gets the whole "
                           "max_train_minutes again and plans its schedule anew", checkpoint.name)  # fmt: skip
            return
        self.deadline.resume(saved["attributes"])

    def _load_callback_state(self) -> None:
        """Trainer's restoring of callback states (restore_callback_states_from_checkpoint), except the deadline's:
        it would replace the deadline this trainer's schedule reads; `_resume_deadline` restores it in place."""
        name = type(self.deadline).__name__ if self.deadline is not None else None
        stored = self.state.stateful_callbacks
        kept = stored.pop(name, None) if name else None
        try:
            super()._load_callback_state()
        finally:
            if kept is not None:
                stored[name] = kept

    @property
    def stopped_by_signal(self) -> int | None:
        """The signal number that stopped the last train() early with a checkpoint (`checkpoint_on_signal`), or
        None when it ran its course. SIGTERM's number where another process was the one signalled."""
        if self.stop_signal is None or self.stop_signal.stopped_at is None:
            return None
        return self.stop_signal.received or signal.SIGTERM

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Trainer's scheduler, or under a time budget with fit_schedule_to_budget the same schedule over the
        number of steps the budget holds (planned by the deadline during the run; see `TrainingDeadline`)."""
        if self.lr_scheduler is None and self.deadline is not None and self.deadline.fit_schedule:
            kind = str(getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type))
            if kind not in FITTED_SCHEDULES:
                raise ValueError(
                    f"a schedule fitted to max_train_minutes supports lr_scheduler_type {', '.join(FITTED_SCHEDULES)}, "
                    f"got {kind!r}: use one of them, or --fit_schedule_to_budget false with --max_steps"
                )
            deadline, args = self.deadline, self.args
            floor = min_lr_rate(kind, args.lr_scheduler_kwargs, args.learning_rate)

            def factor(step: int) -> float:
                total = deadline.schedule_steps(num_training_steps)
                return fitted_lr_factor(kind, step, total, args.get_warmup_steps(total), floor)

            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    # -- data order ---------------------------------------------------------------------------------------------

    def _get_train_sampler(self, train_dataset=None):
        """Length-grouped batches (little padding) in an order fixed by `data_seed` and the epoch, so a run, its
        repetition and its resumption see the same batches; Trainer's own length-grouped sampler draws from the
        global RNG. Other strategies (and datasets without lengths) are Trainer's."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy == "group_by_length":
            lengths = _row_lengths(dataset)
            if lengths is not None:
                batch = self.args.train_batch_size * self.args.gradient_accumulation_steps
                return SeededLengthGroupedSampler(batch, lengths, data_seed(self.args))
        return super()._get_train_sampler(train_dataset)

    # -- the loss ---------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        draft = self._unwrap(model)
        inputs = dict(inputs)
        max_rows = inputs.pop(LOSS_ROWS_BOUND, None)
        if "context_features" not in inputs:
            with record_function(PROFILE_RANGE + "target"):
                inputs.update(self._target_features(draft, inputs))
        losses, walked = [], []
        for anchors, rows_bound in self._anchor_sets(draft, mode, inputs, max_rows):
            batch = {**inputs, **anchors}
            with record_function(PROFILE_RANGE + "draft"):
                outputs = self._run_compiled("_compiled_draft_layers", lambda: model(**batch), "draft layers",
                                             "compile_draft_layers")  # fmt: skip
            loss_range = record_function(PROFILE_RANGE + "loss")
            with self._gathered_output_weights(draft), self._mixed_precision(), loss_range:
                result = draft_loss(
                    draft,
                    outputs,
                    chunk_elements=getattr(self.args, "loss_chunk_elements", None),
                    compile=getattr(self.args, "compile_loss", False),
                    backend=getattr(self.args, "loss_backend", "auto"),
                    normalization=getattr(self.args, "loss_normalization", "token"),
                    anchor_weighting=getattr(self.args, "anchor_weighting", "uniform"),
                    max_rows=rows_bound,
                    graphs=self._loss_graphs,
                )
            self._record(mode, result)
            if mode == "train":
                losses.append(result.loss)
                continue
            losses.append(result.loss.detach())  # a held-out pass's graph is not kept for the next one
            if result.blocks:
                walked.append((batch, {name: block.detach() for name, block in result.blocks.items()}))
        if walked:
            self._record_decoding_walk(*merge_anchor_passes(walked))
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        return (loss, outputs) if return_outputs else loss

    def _anchor_sets(self, draft, mode: str, inputs, max_rows: int | None) -> list[tuple[dict, int | None]]:
        """The anchor blocks of a batch, as (forward inputs, the loss's row bound): training samples `num_anchors`
        per row at random; a held-out batch takes every candidate, in passes of the training step's shape
        (`covering_anchor_passes`), so the walk sees every row and held-out τ averages over every position (one
        forward a pass: up to T / num_anchors a batch). A drafter without anchors (Eagle3) has one set with none."""
        if not hasattr(draft.config, "num_anchors"):
            return [({}, max_rows)]
        loss_mask = inputs["loss_mask"] * inputs["attention_mask"]
        num_anchors = draft.config.num_anchors
        if mode == "train":
            positions, valid = sample_anchors(loss_mask, num_anchors, self._anchor_generator(), fixed_count=True)
            return [({"anchor_positions": positions, "anchor_mask": valid}, max_rows)]
        count = covering_pass_count(loss_mask, num_anchors)
        if self.args.world_size > 1:  # sharded weights gather in every forward: the same count on every process
            count = int(self.accelerator.reduce(torch.tensor([count], device=self.args.device), reduction="max").item())
        passes = covering_anchor_passes(loss_mask, num_anchors, passes=count)
        # A pass holds a share of each row's anchors: its own bound (anchors x slots) is the tighter one.
        anchors = torch.stack([valid.sum() for _, valid in passes]).tolist()
        bounds = [None if max_rows is None else min(max_rows, n * draft.config.block_size) for n in anchors]
        return [({"anchor_positions": p, "anchor_mask": v}, bound) for (p, v), bound in zip(passes, bounds)]

    def _target_features(self, draft, inputs) -> dict[str, torch.Tensor]:
        if self.target_model is None:
            raise ValueError(
                "the batch has no target features: pass target_model=... to DraftTrainer (online training) or "
                "train from a target cache (build_target_cache + load_target_cache)"
            )
        args = (inputs["input_ids"], draft.config.target_layer_ids, inputs["attention_mask"])
        captured = self._target_graphs(*args) if self._target_graphs is not None else None
        if captured is not None:
            context, last = captured
        else:
            run = lambda: target_features(self.target_model, *args)  # noqa: E731
            context, last = self._run_compiled("_compiled_target_layers", run, "target forward", "compile_target")
        return {"context_features": context, "target_last_hidden": last}

    def _run_compiled(self, attribute: str, run, what: str, flag: str):
        """`run()` with the compiled layers in `self.<attribute>` swapped in. Compilation is an optimization: if
        it fails, the same call reruns uncompiled (same result), a warning says so once, and later calls skip it.
        (A failure in a compiled backward surfaces in the step's backward instead.)"""
        compiled = getattr(self, attribute)
        if compiled is not None:
            try:
                with compiled:
                    return run()
            except Exception as err:  # noqa: BLE001 - the uncompiled methods compute the same values
                logger.warning("compiled %s failed (%s: %s); running uncompiled from now on (%s=False avoids the "
                               "attempt)", what, type(err).__name__, err, flag)  # fmt: skip
                setattr(self, attribute, None)
        return run()

    def _loss_graph_runner(self) -> LossGraphs | None:
        """`loss_cuda_graphs`: the runner that replays the loss's forward, or None where it cannot serve."""
        if not getattr(self.args, "loss_cuda_graphs", False):
            return None
        reason = None
        if self.args.device.type != "cuda":
            reason = "off CUDA"
        elif getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            reason = "DeepSpeed or FSDP (the loss's weights are gathered anew every step)"
        elif getattr(self.args, "loss_backend", "auto") != "torch":
            reason = f"loss_backend={self.args.loss_backend!r} (the graphs hold the PyTorch backend)"
        if reason is not None:
            logger.warning("loss_cuda_graphs is ignored %s: the loss runs uncaptured", reason)
            return None
        return LossGraphs()

    def _draft_layer_compiler(self) -> CompiledLayers | None:
        """`compile_draft_layers`, where the draft's layers are called directly (see `compiled_draft_layers`)."""
        if not getattr(self.args, "compile_draft_layers", False):
            return None
        # The accelerator knows of DeepSpeed / FSDP set up by an `accelerate launch` config alone.
        reason = draft_layer_compile_blocker(
            self.args.gradient_checkpointing,
            getattr(self, "is_deepspeed_enabled", False),
            getattr(self, "is_fsdp_enabled", False),
        )
        if reason is not None:
            asked = not getattr(self.args, "_compile_draft_layers_defaulted", False)
            level = logging.WARNING if asked else logging.INFO
            logger.log(level, "compile_draft_layers is ignored with %s: the draft's layers run uncompiled", reason)
            return None
        return compiled_draft_layers(self.accelerator.unwrap_model(self.model))

    def _anchor_generator(self) -> torch.Generator:
        """The training anchors' generator: seeded by the data seed, the step, the micro-step and the process, so a
        resumed run draws the anchors the uninterrupted one would. (Held-out batches take every position.)"""
        step = self.state.global_step
        if step != self._anchor_step:  # micro-steps of one optimizer step are counted from 0
            self._anchor_step, self._anchor_micro = step, 0
        seed = _mix_seed(data_seed(self.args), step, self._anchor_micro, self.args.process_index)
        self._anchor_micro += 1
        return torch.Generator(device=self.args.device).manual_seed(seed)

    def _mixed_precision(self):
        """The forward's autocast for the loss too. Accelerate autocasts only inside model.forward, and the loss
        runs after it: without this, its vocabulary-wide matmuls ran in float32 (the master weights' dtype), which
        profiled at ~60% of a bf16 step's GPU kernel time."""
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.args.device.type, dtype=dtype)

    def _zero3_output_weights(self, draft) -> list[nn.Parameter]:
        """lm_head and W2 under DeepSpeed ZeRO-3 (read by the loss outside a forward: see zero3.py), else none."""
        return zero3_loss_weights(draft) if getattr(self, "is_deepspeed_enabled", False) else []

    def _unwrap(self, model):
        """accelerate's `unwrap_model`, remembered per wrapper object: with DeepSpeed installed, accelerate 1.x reads
        its package metadata on every call (2 ms of host time a step in a CPU profile of the trainer)."""
        known = self._unwrapped
        if id(model) not in known:  # the entry holds the wrapper, so its id is not reused while it is kept
            if len(known) >= 2:  # training's wrapper and evaluation's model; older ones (a past trial's) let go
                del known[next(iter(known))]
            known[id(model)] = (model, self.accelerator.unwrap_model(model))
        return known[id(model)][1]

    def _gathered_output_weights(self, draft):
        """The loss's weights whole for its forward (ZeRO-3; the ones `training_step` already holds are left)."""
        return gathered([p for p in self._zero3_output_weights(draft) if all(p is not q for q in self._held_whole)])

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Under ZeRO-3 the trained weights the loss reads outside a forward (W2) stay whole through the backward
        too: their gradient accumulates into the whole weight, and ZeRO-3's gradient hook reduces and partitions it
        as for any weight (the engine's backward flushes those reductions before the step returns)."""
        if not getattr(self, "is_deepspeed_enabled", False):  # every other run: nothing more a step
            return super().training_step(model, inputs, num_items_in_batch)
        trained = [p for p in self._zero3_output_weights(self._unwrap(model)) if p.requires_grad]
        if not trained:
            return super().training_step(model, inputs, num_items_in_batch)
        with gathered(trained):
            self._held_whole = trained
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._held_whole = []

    def get_train_dataloader(self):
        """With fewer rows than one batch, skipping the smaller last batch (`dataloader_drop_last`) would skip
        every batch and train nothing: such a run keeps its one partial batch, with a warning."""
        rows = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None
        batch = self.args.train_batch_size * self.args.world_size
        if self.args.dataloader_drop_last and rows is not None and rows < batch:
            logger.warning("only %d training rows, fewer than one batch of %d: keeping the partial batch "
                           "(dataloader_drop_last=False)", rows, batch)  # fmt: skip
            self.args.dataloader_drop_last = False
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        """Every held-out row is evaluated: `dataloader_drop_last` (on by default) is for training batches only."""
        drop_last = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = False
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.args.dataloader_drop_last = drop_last

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        grad_mode = self._evaluation_grad_mode()
        try:
            with grad_mode, self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs)
        except Exception as err:  # noqa: BLE001 - grad mode is an optimization: evaluate without it from now on
            if not isinstance(grad_mode, torch.enable_grad):
                raise
            logger.warning("evaluation in grad mode failed (%s: %s); evaluating under no_grad from now on",
                           type(err).__name__, err)  # fmt: skip
            self._evaluate_in_grad_mode = False
            with torch.no_grad(), self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _evaluation_grad_mode(self):
        """Grad mode of the held-out forward. torch.compile keys its graphs on grad mode, so a no_grad evaluation
        compiled flex attention and the loss anew for each batch shape (about 5 s each on an H200, most of what
        the evaluations of a 12-minute run cost). Where those are compiled, the evaluation runs in the training
        step's grad mode and reuses its graphs; nothing is backpropagated and the graph is freed at once.
        DeepSpeed and FSDP keep no_grad (their sharding hooks expect a backward after a grad-mode forward)."""
        compiled = getattr(self.args, "compile_loss", False) or self.args.device.type == "cuda"
        sharded = getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
        if compiled and not sharded and self._evaluate_in_grad_mode:
            return torch.enable_grad()
        return torch.no_grad()

    # -- logging ----------------------------------------------------------------------------------------------

    def _record(self, mode: str, result) -> None:
        metrics = self._metrics[mode]
        metrics["_batches"] += 1
        for name, value in {**result.terms, **result.estimates}.items():
            metrics[name] = metrics[name] + value.detach().float()
        if mode == "train":
            self.supervised_tokens_seen += result.estimates["supervised_tokens"].detach()

    def _record_decoding_walk(self, inputs, blocks: dict[str, torch.Tensor]) -> None:
        """Held-out τ as decoding would walk the same text (`metrics.decoding_walk_estimates`; evaluation only: it
        reads the blocks on the host)."""
        if "anchor_positions" in inputs:
            positions, valid = inputs["anchor_positions"], inputs["anchor_mask"]
            candidates = anchor_candidates(inputs["loss_mask"] * inputs["attention_mask"])
        else:  # Eagle3: a block at every position t, whose step 0 predicts t + 2: anchored at t + 1
            valid = blocks["eval_mask"][..., 0].bool()
            rows, seq = valid.shape
            positions = torch.arange(1, seq + 1, device=valid.device).expand(rows, seq)
            candidates = torch.cat([torch.zeros_like(valid[:, :1]), valid], dim=1)
        walk = decoding_walk_estimates(blocks["accept_rate"], blocks["greedy_match"], blocks["eval_mask"],
                                       positions, valid, candidates)  # fmt: skip
        metrics = self._metrics["eval"]
        for name, value in walk.items():
            metrics[name] = metrics[name] + value

    def _summarize(self, mode: str) -> dict[str, float]:
        """Sum this window's metrics over processes (one all-reduce) and turn sums into means."""
        metrics = self._metrics[mode]
        batches = metrics.pop("_batches")
        names = sorted(metrics)
        flat = torch.cat([torch.as_tensor(metrics[n], device=self.args.device).reshape(-1) for n in names])
        flat = self.accelerator.reduce(flat, reduction="sum").cpu()
        sums, offset = {}, 0
        for n in names:
            size = torch.as_tensor(metrics[n]).numel()
            sums[n] = flat[offset : offset + size]
            offset += size
        metrics.clear()
        logs = {}
        for n in names:
            if n.startswith("loss_"):  # each process holds its share of the global term; mean over micro-batches
                logs[n] = float(sums[n]) / batches
        if "blocks" in sums and float(sums["blocks"]) > 0:
            logs["tau_prob"] = float(sums["tau_prob_sum"] / sums["blocks"])
            logs["tau_greedy"] = float(sums["tau_greedy_sum"] / sums["blocks"])
            for k, (hit, count) in enumerate(zip(sums["accept_sum"].tolist(), sums["accept_count"].tolist())):
                if count > 0:
                    logs[f"accept@{k + 1}"] = hit / count
        if "supervised_tokens" in sums:
            logs["supervised_tokens"] = float(sums["supervised_tokens"])
        if "walk_tokens" in sums and float(sums["walk_rounds_greedy"]) > 0:
            logs["tau_walk_greedy"] = float(sums["walk_tokens"] / sums["walk_rounds_greedy"])
            logs["tau_walk_prob"] = float(sums["walk_tokens"] / sums["walk_rounds_prob"])
        if float(sums.get("walk_rows_skipped", 0)) > 0:  # not expected: held-out batches anchor every position
            logs["walk_rows_skipped"] = float(sums["walk_rows_skipped"])
        return logs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        # Every process calls log() at the same points, so the all-reduce inside _summarize is collective.
        if self._metrics[mode].get("_batches", 0):
            prefix = _eval_prefix(logs) if mode == "eval" else ""
            # In place: evaluate() returns this very dict.
            logs.update({prefix + k: v for k, v in self._summarize(mode).items()})
        if mode == "train" and self.deadline is not None and self.deadline.planned_steps is not None:
            logs["planned_steps"] = self.deadline.planned_steps
        if self._train_started is not None:
            logs["elapsed_s"] = round(time.monotonic() - self._train_started, 1)  # since this train() call began
            logs["compile_s"] = round(compile_seconds_since(self._compile_mark), 1)  # new shapes compile mid-run
        if "train_runtime" in logs:  # the run's summary: how long the user waited for its first step
            waits = {"startup_s": self.startup_s, "first_step_s": self.first_step_s}
            waits.update({f"startup_{phase}_s": s for phase, s in self.startup_phases.items()})
            logs.update({k: round(v, 1) for k, v in waits.items() if v is not None})
        if "train_runtime" in logs and self.deadline is not None and logs["train_runtime"] > 0:
            # Trainer divides max_steps (a cap under a time budget) by the runtime: report the steps actually run.
            steps = self.state.global_step
            logs["train_steps_per_second"] = round(steps / logs["train_runtime"], 3)
            logs["train_samples_per_second"] = round(steps * self.args.train_batch_size * self.args.gradient_accumulation_steps
                                                     * self.args.world_size / logs["train_runtime"], 3)
        super().log(logs, start_time)


def merge_anchor_passes(passes: list[tuple[dict, dict]]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(inputs, blocks) of held-out passes over one batch -> one (inputs, blocks) holding every pass's blocks,
    sorted by anchor position in each row (dummy anchors last), as `metrics.decoding_walk_estimates` reads them.
    blocks: [B, N, K] tensors of each pass."""
    if len(passes) == 1:
        return passes[0]
    inputs = dict(passes[0][0])
    positions = torch.cat([batch["anchor_positions"] for batch, _ in passes], dim=1)
    valid = torch.cat([batch["anchor_mask"] for batch, _ in passes], dim=1).bool()
    past_end = torch.full_like(positions, inputs["loss_mask"].shape[1])
    order = torch.where(valid, positions, past_end).argsort(dim=1, stable=True)
    inputs.update(anchor_positions=positions.gather(1, order), anchor_mask=valid.gather(1, order))
    blocks = {}
    for name in passes[0][1]:
        parts = torch.cat([part[name] for _, part in passes], dim=1)
        blocks[name] = parts.gather(1, order[..., None].expand(-1, -1, parts.shape[2]))
    return inputs, blocks


class _FirstStepTimer(TrainerCallback):
    """Sets the trainer's `first_step_s` at the end of the first optimizer step of its train() call (loading a
    checkpoint, building the data loader and compiling the first shapes included; the step's last kernels may
    still be running on a GPU)."""

    def __init__(self, trainer: "DraftTrainer"):
        self.trainer = weakref.proxy(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.first_step_s is None and self.trainer._train_started is not None:
            self.trainer.first_step_s = time.monotonic() - self.trainer._train_started


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return time.time() - (boot + started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        return None


def _eval_prefix(logs: dict) -> str:
    """The metric prefix of an evaluation's logs: "eval_", or "eval_NAME_" for the named sets of a dict
    eval_dataset (transformers logs each as f"{metric_key_prefix}_loss")."""
    named = [k[: -len("loss")] for k in logs if k.startswith("eval_") and k.endswith("_loss")]
    return min(named, key=len) if named else "eval_"


class SeededLengthGroupedSampler(torch.utils.data.Sampler):
    """Trainer's length grouping (mega-batches of 50 batches sorted by length, the longest batch first) with a
    generator seeded by (seed, epoch) instead of the global RNG."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        self.batch_size, self.lengths, self.seed, self.epoch = batch_size, list(lengths), int(seed), 0

    def set_epoch(self, epoch: int) -> None:  # called by accelerate's data loader at every epoch
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator().manual_seed(_mix_seed(self.seed, self.epoch))
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


def _row_lengths(dataset) -> list[int] | None:
    """Token count of every row: a target cache knows them; a tokenized dataset has `input_ids`."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None and not callable(lengths):
        return list(lengths)
    try:
        if "input_ids" in (getattr(dataset, "column_names", None) or ()):
            if hasattr(dataset, "with_format"):  # a datasets.Dataset: from Arrow's offsets (17 k rows: 0.55 s -> 2 ms)
                import pyarrow.compute as pc

                return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
            return [len(ids) for ids in dataset["input_ids"]]
    except (TypeError, KeyError):
        pass
    return None


FITTED_SCHEDULES = ("cosine", "cosine_with_min_lr", "linear", "constant", "constant_with_warmup")


def min_lr_rate(kind: str, scheduler_kwargs: dict | None, learning_rate: float) -> float:
    """The floor of a fitted schedule as a fraction of the peak rate: 0, or for cosine_with_min_lr transformers'
    `lr_scheduler_kwargs` (`min_lr_rate`, or `min_lr` in absolute terms; exactly one of them, as transformers asks)."""
    if kind != "cosine_with_min_lr":
        return 0.0
    kwargs = dict(scheduler_kwargs or {})
    if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
        raise ValueError(
            "lr_scheduler_type cosine_with_min_lr needs exactly one of min_lr / min_lr_rate in lr_scheduler_kwargs, "
            f"got {kwargs}: e.g. --lr_scheduler_kwargs '{{\"min_lr_rate\": 0.1}}'"
        )
    rate = kwargs["min_lr_rate"] if "min_lr_rate" in kwargs else kwargs["min_lr"] / learning_rate
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"the minimum learning rate must lie between 0 and the peak rate, got {rate} of it")
    return float(rate)


def fitted_lr_factor(kind: str, step: int, total: int, warmup: int, floor: float = 0.0) -> float:
    """Learning-rate multiplier at `step` of a `total`-step schedule: linear warm-up, then `kind`, decaying to
    `floor` (a fraction of the peak; cosine_with_min_lr's, as transformers' schedule of that name)."""
    if step < warmup:
        return step / max(1, warmup)
    if kind.startswith("constant"):
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decayed = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind.startswith("cosine") else 1.0 - progress
    return floor + (1.0 - floor) * decayed


class TrainingDeadline(TrainerCallback, ExportableState):
    """Ends training once `minutes` of wall time have passed since train() began (checked at step ends, so the
    last step completes); the final save and evaluation then run as after the last planned step. Every process
    acts on the main process's decision, one step after it was made (`StepAgreement`: no device synchronization),
    so a distributed run stops at the same step everywhere.

    With `fit_schedule`, it also plans the learning-rate schedule's length: after step `MARK_STEP` (the first
    steps compile) it times every step and, every `PLAN_EVERY` steps, sets the total to the steps done plus the
    steps the remaining time holds (capped by the run's max_steps); training ends when the plan is done. A step's
    cost is the mean over the last `WINDOW` steps, each counted at most `CLIP` times their median: batches grouped
    by length take from one to several times the median step, so a median alone under-plans (a 9-minute run
    planned 3,739 steps and did 2,887), while a recompilation stays a few steps' worth (a mean over the whole run,
    compilations included, once planned ~1,000 steps for a ~4,200-step run: a 40-step warm-up and a diverging
    loss). Evaluations and checkpoint saves are timed apart and planned at the rate seen so far. Without a fitted
    schedule, a 3,090-step cosine stopped by a 7.5-minute budget at step 1,898 still had 40% of its peak rate. A
    planned run depends on the machine's speed: it logs `planned_steps`, and `--max_steps` with that number (no
    budget) gives a fixed schedule of about that shape.

    A checkpoint records the seconds spent and the plan (`state()`, in its trainer_state.json): a run resumed from it
    (`resume`) keeps the budget's remainder and the same schedule, instead of a new budget and a schedule restarted
    near its peak learning rate.

    With `show_progress`, the main process shows the budget in seconds (with the step, loss and training τ) in
    place of the Trainer's step bar: a time-budgeted run's step count is not known in advance."""

    MARK_STEP = 5
    PLAN_EVERY = 10
    WINDOW = 200
    CLIP = 8.0

    def __init__(self, minutes: float, show_progress: bool = False, fit_schedule: bool = False, clock=time.monotonic):
        self.clock = clock
        self.seconds = 60.0 * minutes
        self.show_progress = show_progress
        self.fit_schedule = fit_schedule
        self.planned_steps: int | None = None
        self.start = None
        self.mark: int | None = None  # the step after which steps are timed
        self.durations: collections.deque = collections.deque(maxlen=self.WINDOW)  # recent step times
        self.pause_seconds = 0.0  # evaluations and saves since the mark
        self._last_end = None
        self.bar = None
        self.last_log: dict = {}
        self._capped_warned = False
        self._resumed: dict | None = None  # what a checkpoint recorded, applied when train() begins
        self._agreement = StepAgreement()  # several processes: rank 0's stop and plan, for all

    def state(self) -> dict:
        """What a checkpoint records (transformers' ExportableState, saved in trainer_state.json)."""
        spent = self.clock() - self.start if self.start is not None else 0.0
        return {
            "args": {"minutes": self.seconds / 60, "show_progress": self.show_progress,
                     "fit_schedule": self.fit_schedule},
            "attributes": {"spent_seconds": spent, "planned_steps": self.planned_steps, "mark": self.mark,
                           "pause_seconds": self.pause_seconds, "durations": list(self.durations)},
        }  # fmt: skip

    def resume(self, attributes: dict) -> None:
        """Continue the budget and the plan a checkpoint recorded (`state()["attributes"]`) at the next train()."""
        self._resumed = dict(attributes)

    def schedule_steps(self, fallback: int) -> int:
        """The schedule's total: the plan once made, before that the run's own max_steps."""
        return self.planned_steps or fallback

    def on_train_begin(self, args, state, control, **kwargs):
        self._agreement.open()  # every process, here at the same point
        self.start = self.clock()
        self.mark, self.planned_steps, self._last_end = None, None, None
        self.durations.clear()
        self.pause_seconds = 0.0
        if self._resumed is not None:
            saved, self._resumed = self._resumed, None
            self.start -= saved["spent_seconds"]
            self.planned_steps, self.mark = saved["planned_steps"], saved["mark"]
            self.pause_seconds = saved["pause_seconds"]
            self.durations.extend(saved["durations"])
            logger.info("max_train_minutes=%g: resumed with %.0f s of the budget spent%s", self.seconds / 60,
                        saved["spent_seconds"], f", the schedule planned at {self.planned_steps} steps"
                        if self.planned_steps else "")  # fmt: skip
        if self.show_progress and state.is_local_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=round(self.seconds), unit="s", desc="training", dynamic_ncols=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s {postfix}")  # fmt: skip

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.last_log.update(logs or {})

    def _pause(self):
        """An evaluation or a save just ended: its time is a pause, not part of the next step's duration."""
        now = self.clock()
        if self.mark is not None and self._last_end is not None:
            self.pause_seconds += now - self._last_end
        self._last_end = now

    def on_evaluate(self, args, state, control, **kwargs):
        self._pause()

    def on_save(self, args, state, control, **kwargs):
        self._pause()

    def step_seconds(self, step: int) -> float | None:
        """A step's planned cost: the clipped mean of the recent steps plus the pauses per step seen so far."""
        if self.mark is None or len(self.durations) < self.PLAN_EVERY:
            return None
        cap = self.CLIP * statistics.median(self.durations)
        typical = sum(min(d, cap) for d in self.durations) / len(self.durations)
        return typical + self.pause_seconds / max(1, step - self.mark)

    def _plan(self, step: int, elapsed: float, cap: int) -> int | None:
        """The schedule's total from the steps timed since the mark (None until there are enough)."""
        per_step = self.step_seconds(step)
        if per_step is None:
            return self.planned_steps
        total = step + int(max(0.0, self.seconds - elapsed) / max(per_step, 1e-9))
        if cap > 0 and total > cap:
            if not self._capped_warned:
                logger.warning(
                    "the %g-minute budget holds about %d steps, but max_steps / num_train_epochs cap the run at %d: "
                    "raise --max_steps (or --num_train_epochs) to use the whole budget", self.seconds / 60, total, cap
                )
                self._capped_warned = True
            total = cap
        return max(step, total)

    def on_step_end(self, args, state, control, **kwargs):
        now = self.clock()
        elapsed = now - self.start if self.start is not None else 0.0
        step = state.global_step
        if self.mark is not None and self._last_end is not None:
            self.durations.append(now - self._last_end)
        self._last_end = now
        if self.bar is not None:
            self.bar.n = min(elapsed, self.seconds)
            postfix = f"step {step}"
            if "loss" in self.last_log:
                postfix += f", loss {self.last_log['loss']:.3f}"
            if "tau_greedy" in self.last_log:
                postfix += f", train tau {self.last_log['tau_greedy']:.2f}"
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()
        if self.fit_schedule and step == self.MARK_STEP:
            self.mark = step
        over = self.start is not None and elapsed >= self.seconds
        decide = step % self.PLAN_EVERY == 0
        plan = self._plan(step, elapsed, state.max_steps) if self.fit_schedule and decide else self.planned_steps
        if self._agreement.active:
            # Rank 0's clock decides for all: the same stop and the same schedule (learning rate) on every rank, a
            # step after rank 0 made the decision. The others send zeros (a max keeps rank 0's values); a plan is
            # sent only when made, and a zero plan means no news.
            mine = [float(over), float(plan or 0) if decide else 0.0] if state.is_world_process_zero else [0.0, 0.0]
            agreed = self._agreement.exchange(mine)
            if agreed is None:
                return control
            over, plan = bool(agreed[0]), int(agreed[1]) or None
        if plan != self.planned_steps and plan is not None:
            if self.planned_steps is None:
                logger.info("max_train_minutes=%g: the schedule is planned at %d steps", self.seconds / 60, plan)
            self.planned_steps = plan
        done = self.planned_steps is not None and step >= self.planned_steps
        if over or done:
            what = "the planned schedule is complete" if done and not over else "reached"
            logger.info("max_train_minutes=%g: %s at step %d: stopping", self.seconds / 60, what, step)
            control.should_training_stop = True
            # A resumable checkpoint at the stop when the run saves checkpoints at all (the model itself is saved
            # by whoever called train(), as after the last planned step).
            control.should_save = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._agreement.finish()
        self.close()

    def close(self) -> None:
        """The progress bar and the agreement's group gone (also after a failed run)."""
        self._agreement.close()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _check_dataset(name: str, dataset, draft: DraftPreTrainedModel, target: nn.Module | None) -> None:
    """Empty data, untokenized data, a missing target and a cache of another target or other layers."""
    try:
        size = len(dataset)
    except TypeError:
        size = None
    if size == 0:
        raise ValueError(
            f"{name} is empty: check the conversation file and the filters of tokenize_conversations "
            "(max_length, min_loss_tokens)"
        )
    settings = getattr(dataset, "settings", None)
    if settings is not None:  # a target cache: it must belong to this target and carry the draft's layers
        from ..data import TargetCacheError, validate_target_cache

        validate_target_cache(settings, draft_config=draft.config, target=target)
        carried = list(getattr(dataset, "target_layer_ids", settings["target_layer_ids"]))
        if carried != list(draft.config.target_layer_ids):
            raise TargetCacheError(
                f"{name} yields target layers {carried} but the draft reads {draft.config.target_layer_ids}: open "
                "the cache with load_target_cache(path, draft_config=draft.config)"
            )
        return
    row = _first_row(dataset)
    if row is None:
        return
    missing = [key for key in ("input_ids", "loss_mask") if key not in row]
    if missing:
        raise ValueError(
            f"{name} rows lack {missing} (they have {sorted(row)}): tokenize conversations with "
            "tokenize_conversations(dataset, tokenizer, max_length), or load a target cache"
        )
    if "context_features" not in row and target is None:
        raise ValueError(
            f"{name} has no target features (columns {sorted(row)}): pass target_model=... to train online, or "
            "build a target cache (build_target_cache) and train from load_target_cache(...)"
        )


__all__ = ["DraftTrainer", "build_draft"]
