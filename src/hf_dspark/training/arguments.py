"""`DraftTrainingArguments`: `TrainingArguments` plus the draft and data fields of draft training."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class DraftTrainingArguments(TrainingArguments):
    r"""
    [`TrainingArguments`] for [`DraftTrainer`]. The draft fields are used when the trainer (or `train_draft`)
    builds the draft from a target; the data fields shape batches and the chunked loss.
    """

    # -- the tested recipe (benchmarks/README.md): defaults a user gets without flags --------------------------
    learning_rate: float = field(default=6e-4, metadata={"help": "Peak learning rate (AdamW)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule after warm-up."})
    warmup_steps: float = field(
        default=0.04, metadata={"help": "Warm-up steps (a value below 1 is a fraction of the training steps)."}
    )
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Conversations per device and step."})
    per_device_eval_batch_size: int | None = field(
        default=None,
        metadata={"help": "Held-out conversations per device and step (default: the training batch, whose compiled "
                  "graphs the evaluation then reuses)."},
    )  # fmt: skip
    train_sampling_strategy: str = field(
        default="group_by_length",
        metadata={"help": "Batches of similar lengths (little padding: ~2x fewer tokens per step on chat data)."},
    )
    bf16: bool | None = field(
        default=None, metadata={"help": "bfloat16 mixed precision (default: on where the GPU supports it)."}
    )
    dataloader_drop_last: bool = field(
        default=True,
        metadata={"help": "Skip each epoch's last, smaller training batch: a new batch shape recompiles the compiled "
                  "kernels (the order changes every epoch, so no row is always skipped). Evaluation keeps every row."},
    )  # fmt: skip
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={"help": "Log a NaN/inf step loss as the running average instead (transformers' default, True, "
                  "reads every step's loss back to the host: a synchronization that leaves the GPU idle while the "
                  "host prepares the next step). Off, a NaN loss shows in the log as it is."},
    )  # fmt: skip

    # -- draft ---------------------------------------------------------------------------------------------------
    algorithm: str = field(default="dspark", metadata={"help": "Drafter to train: dspark, dflash or eagle3."})
    num_hidden_layers: int | None = field(
        default=None, metadata={"help": "Draft decoder layers (default: the recipe's, 2 for DSpark/DFlash, 1 for Eagle3)."}
    )
    intermediate_size: int | None = field(
        default=None,
        metadata={"help": "Draft MLP width (default: the target's); wider costs little where a step is launch-bound."},
    )
    block_size: int | None = field(
        default=None, metadata={"help": "Draft tokens per round: block size (DSpark/DFlash) or TTT length (Eagle3)."}
    )
    num_anchors: int | None = field(
        default=None, metadata={"help": "Anchor blocks sampled per sequence (DSpark/DFlash; default 512)."}
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers feeding the draft (default: 5 evenly spaced non-final ones)."}
    )
    markov_rank: int | None = field(
        default=None, metadata={"help": "Rank of DSpark's Markov head (default 256; DSpark only)."}
    )
    ce_loss_alpha: float | None = field(
        default=None,
        metadata={"help": "Weight of the cross-entropy against the data's token in the block drafters' loss "
                  "(default: DSpark 0, DFlash 1)."},
    )  # fmt: skip
    l1_loss_alpha: float | None = field(
        default=None,
        metadata={"help": "Weight of the L1 (total variation) term against the target distribution (default: DSpark "
                  "0.5, DFlash 0). CE drives the argmax (greedy acceptance), L1 the overlap min(p_d, p_t) that "
                  "sampled acceptance counts."},
    )  # fmt: skip
    soft_ce_loss_alpha: float | None = field(
        default=None,
        metadata={"help": "Weight of the soft cross-entropy against the target distribution (default: DSpark 0.5, "
                  "DFlash 0): the label's CE in expectation, without its sampling noise."},
    )  # fmt: skip
    use_qk_norm: bool | None = field(
        default=None,
        metadata={
            "help": "Query/key RMSNorm in the draft's attention (default: follow the target). True gives Llama/Qwen2 "
            "targets the Qwen3-style attention that vLLM, SGLang and DeepSpec block drafters expect."
        },
    )

    # -- data ----------------------------------------------------------------------------------------------------
    max_length: int = field(default=1024, metadata={"help": "Longest tokenized conversation; longer ones are cut."})
    min_loss_tokens: int = field(
        default=14, metadata={"help": "Drop conversations with fewer supervised (assistant) tokens than this."}
    )
    max_loop_repeats: int = field(
        default=2,
        metadata={"help": "Answers cut at the length limit (finish == 'length') that end in a repetition loop keep at "
                  "most this many repeats of it (0: whole loops). 2 against whole loops in 6-minute ablations: "
                  "+0.12 decoded τ greedy, +0.08 at T = 1."},
    )  # fmt: skip
    pad_to_multiple_of: int = field(
        default=256, metadata={"help": "Pad batch lengths to a multiple of this (fewer shapes for compiled kernels)."}
    )
    loss_chunk_elements: int | None = field(
        default=None,
        metadata={"help": "Elements of one [rows, vocab] fp32 loss buffer (default 2**26): bounds the loss memory."},
    )
    compile_loss: bool | None = field(
        default=None,
        metadata={"help": "torch.compile the loss's vocabulary-wide math (default: on CUDA; falls back to eager)."},
    )
    compile_target: bool | None = field(
        default=None,
        metadata={"help": "torch.compile the online target's decoder layers for its no-grad forward (fused kernels, "
                  "fewer launches; one layer's compilation serves all). Default: on CUDA (SmolLM2 on an H200: "
                  "the target's forward 33.9 -> 18.4 ms of an 89 -> 71 ms step)."},
    )
    target_cuda_graphs: bool | None = field(
        default=None,
        metadata={"help": "Replay the online target's no-grad forward from CUDA graphs, one per batch shape "
                  "(captured when a shape comes a second time, after the compiled layers warm up; the host issues "
                  "one graph launch instead of every layer's kernels). Default: on CUDA, quietly off for targets "
                  "that take no explicit 4-D mask (flash/flex attention, sliding windows). A failed capture falls "
                  "back to the plain forward with a warning. The captured shapes (at most 8) share one memory pool "
                  "for the forward's transient memory."},
    )  # fmt: skip
    loss_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "Replay the PyTorch loss's row chunks from CUDA graphs, one per chunk index: one launch "
                  "a chunk for the host instead of its kernels; ~1.1 GB of static buffers and graph memory at "
                  "SmolLM2's shapes. Opt-in until timed; ignored off CUDA, with DeepSpeed / FSDP or another "
                  "loss_backend."},
    )  # fmt: skip
    compile_draft_layers: bool | None = field(
        default=None,
        metadata={"help": "torch.compile the draft's layer methods for training (fused norms, rotary, residuals and "
                  "casts around the matrix products; one compilation per padded length). Default: on CUDA without "
                  "gradient checkpointing, DeepSpeed or FSDP (asked for with them, it is ignored with a warning). "
                  "On an H200: SmolLM2 2-layer DSpark step 95.5 -> 81.3 ms, 6.54 -> 5.31 GiB; production shapes "
                  "80.7 -> 67.6 ms, 9.24 -> 8.19 GiB."},
    )  # fmt: skip
    loss_backend: str = field(
        default="torch",
        metadata={
            "help": "Vocabulary-wide loss: torch (row chunks, compiled; the fastest measured), triton (fused kernels: "
            "~4x less loss memory, ~3% slower at SmolLM2 shapes on an H200) or auto (Triton on CUDA)."
        },
    )
    loss_normalization: str = field(
        default="token",
        metadata={"help": "Average the loss over supervised tokens (token) or per sequence, then over sequences "
                  "(sequence, as the reference implementation)."},
    )
    anchor_weighting: str = field(
        default="uniform",
        metadata={"help": "Weight of each anchor block in the loss: uniform, or walk (1 / the draft's own expected "
                  "tokens a round from that anchor, from its confidence head: decoding starts a round where the last "
                  "one ended, so hard anchors are visited more often than uniform sampling draws them; DSpark only)."},
    )  # fmt: skip
    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Stop training after this many minutes (then save and evaluate as at the last step). The "
            "learning-rate schedule is fitted to the budget (see fit_schedule_to_budget); max_steps or "
            "num_train_epochs still cap the run."
        },
    )
    checkpoint_on_signal: bool = field(
        default=True,
        metadata={
            "help": "On SIGTERM or SIGUSR1 (preemption, a scheduler's time limit): finish the step, save a "
            "resumable checkpoint (even with save_strategy no) and stop; --resume_from_checkpoint true continues."
        },
    )
    fit_schedule_to_budget: bool = field(
        default=True,
        metadata={
            "help": "With max_train_minutes: measure the step rate during the run and plan the schedule's total "
            "steps (warm-up and decay included) so it ends at the deadline. Off: the schedule spans max_steps and "
            "the deadline may cut it mid-way."
        },
    )
    # Rows carry only what the collator reads; keep dataset columns as they are.
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Drop dataset columns the draft's forward does not take (off for drafts)."}
    )

    def __post_init__(self):
        _check_launch(self)
        if self.bf16 is None:
            self.bf16 = _bf16_available() and not self.fp16 and not self.use_cpu
        on_cuda = _cuda_available() and not self.use_cpu
        if self.compile_loss is None:
            self.compile_loss = on_cuda
        if self.compile_target is None:
            self.compile_target = on_cuda
        self._target_cuda_graphs_defaulted = self.target_cuda_graphs is None  # quiet where the target cannot
        if self.target_cuda_graphs is None:
            self.target_cuda_graphs = on_cuda
        # Defaulted, the setting stays quiet where the trainer turns it off (the trainer reads this mark).
        self._compile_draft_layers_defaulted = self.compile_draft_layers is None
        if self.compile_draft_layers is None:
            blocker = draft_layer_compile_blocker(self.gradient_checkpointing, bool(self.deepspeed), bool(self.fsdp))
            self.compile_draft_layers = on_cuda and blocker is None
        if self.per_device_eval_batch_size is None:  # another batch shape would compile every kernel again
            self.per_device_eval_batch_size = self.per_device_train_batch_size
        copy_async = _non_blocking_unset(self.accelerator_config)
        if self.ddp_find_unused_parameters is None:
            # The objectives give every trainable parameter a gradient: skip DDP's extra graph traversal.
            self.ddp_find_unused_parameters = False
        super().__post_init__()
        if copy_async and self.dataloader_pin_memory:  # transformers turns pinning off for use_cpu
            self.accelerator_config.non_blocking = True
        from .losses import ANCHOR_WEIGHTINGS, NORMALIZATIONS

        if self.loss_normalization not in NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {', '.join(NORMALIZATIONS)}, got "
                             f"{self.loss_normalization!r}")  # fmt: skip
        if self.anchor_weighting not in ANCHOR_WEIGHTINGS:
            raise ValueError(f"anchor_weighting must be one of {', '.join(ANCHOR_WEIGHTINGS)}, got "
                             f"{self.anchor_weighting!r}")  # fmt: skip
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")
        if self.max_train_minutes is not None and self.max_train_minutes <= 0:
            raise ValueError(f"max_train_minutes must be > 0, got {self.max_train_minutes}")
        if self.max_loop_repeats is not None and self.max_loop_repeats < 0:
            raise ValueError(f"max_loop_repeats must be >= 0 (0 keeps loops whole), got {self.max_loop_repeats}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")


def _non_blocking_unset(config) -> bool:
    """Whether the caller's `accelerator_config` leaves `non_blocking` unset (None, or a dict or JSON text without
    it); then batches are copied to the GPU asynchronously from pinned memory. A blocking copy waits for everything
    queued on the GPU: a synchronization every step, which leaves the GPU idle while the host launches the next
    step. A JSON file or an `AcceleratorConfig` is taken as given."""
    if isinstance(config, str) and config.lstrip().startswith("{"):
        config = json.loads(config)
    return config is None or (isinstance(config, dict) and "non_blocking" not in config)


def _check_launch(args) -> None:
    """Fail at once, naming the change, on a launch that cannot run as asked (before any model is loaded).

    `accelerate launch` passes its config's choices through the environment: ACCELERATE_MIXED_PRECISION,
    ACCELERATE_USE_DEEPSPEED, and LOCAL_WORLD_SIZE (processes on this machine)."""
    import importlib.util
    import os

    launch = os.environ.get("ACCELERATE_MIXED_PRECISION")
    asked = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if launch in ("bf16", "fp16") and asked is not None and asked != launch:
        raise ValueError(
            f"the accelerate config launches with mixed_precision: {launch} but the training flags ask for {asked} "
            f"(--{asked}): make them agree, either mixed_precision: {asked} in the config or --{launch} instead"
        )
    if launch in ("bf16", "fp16") and args.bf16 is None and not args.fp16:
        args.bf16, args.fp16 = launch == "bf16", launch == "fp16"  # no flag given: the launcher's choice
    deepspeed = args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise ImportError(
            "this launch uses DeepSpeed (a deepspeed accelerate config or --deepspeed) but deepspeed is not installed: "
            "pip install 'hf_dspark[deepspeed]', or launch with examples/configs/multi_gpu.yaml for plain DDP"
        )
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and not args.use_cpu and _cuda_available():
        import torch

        gpus = torch.cuda.device_count()
        if int(local) > gpus:
            raise ValueError(
                f"{local} processes were launched on this machine but it has {gpus} GPU(s): launch with "
                f"--num_processes {gpus} (or num_processes: {gpus} in the accelerate config), one process per GPU"
            )


def draft_layer_compile_blocker(gradient_checkpointing: bool, deepspeed: bool, fsdp: bool) -> str | None:
    """Why the draft's layers cannot be compiled for training (`compile_draft_layers`), or None. Gradient
    checkpointing re-runs the layers' forward in backward, and DeepSpeed / FSDP wrap and shard the modules whose
    methods the compilation replaces: each of these runs them uncompiled."""
    if gradient_checkpointing:
        return "gradient checkpointing"
    return "DeepSpeed" if deepspeed else "FSDP" if fsdp else None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _bf16_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


__all__ = ["DraftTrainingArguments"]
