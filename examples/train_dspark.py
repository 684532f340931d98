"""Train a DSpark (or DFlash / Eagle3) draft for a target model.

One process, CPU or GPU:

    python examples/train_dspark.py --train_file ../shared/data/responses/smollm2-135m-instruct.jsonl.gz \
        --algorithm dspark --num_hidden_layers 2 --block_size 7 --max_length 1024 \
        --output_dir runs/dspark-smollm2 --max_steps 2000 --per_device_train_batch_size 8 \
        --learning_rate 6e-4 --warmup_steps 0.04 --bf16 --logging_steps 50 --report_to tensorboard

--train_file takes several files or a quoted glob ('data/*.jsonl.gz'). --seed fixes the draft's initialization and
--data_seed the data order: the same flags give the same run, and `--resume_from_checkpoint true` continues a
killed run from its newest complete checkpoint. SIGTERM or SIGUSR1 (preemption, a scheduler's time limit) saves
a checkpoint at the next step end and exits with 128 + the signal's number.

Several processes (same flags): `accelerate launch --num_processes 8 examples/train_dspark.py ...`, or with
`--config_file examples/configs/deepspeed_zero3.yaml` for DeepSpeed ZeRO-3.

Without --cache_dir the frozen target runs inside every training step (online). With --cache_dir DIR the
target's features are computed once into an Arrow cache in DIR (reused and resumed on later runs) and the
target is freed before training. --target_model defaults to the embedded SmolLM2-135M-Instruct.
The final draft is saved to --output_dir and loads with `AutoModel.from_pretrained(output_dir)`.
"""

from hf_dspark.training import train_draft, training_argument_parser


def main():
    parser = training_argument_parser()  # transformers' HfArgumentParser over the script's and the Trainer's flags
    script_args, training_args = parser.parse_args_into_dataclasses()
    # train_draft: tokenize conversations -> (build/reuse the target cache) -> DraftTrainer.train() -> save.
    trainer = train_draft(script_args, training_args)
    if trainer.stopped_by_signal is not None:  # SIGTERM / SIGUSR1: a checkpoint was saved, resume from it
        raise SystemExit(128 + trainer.stopped_by_signal)
    if trainer.is_world_process_zero():
        print(f"draft saved to {training_args.output_dir}")


if __name__ == "__main__":
    main()
