"""examples/train_dspark.py under `accelerate launch` (1 process, and 2 gloo processes), and `hf-dspark train`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, load_script, require_default_target, tiny_target_config
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_dspark import DSparkModel, Eagle3Model
from hf_dspark.training.trainer import TrainingDeadline

EXAMPLE = REPO / "examples" / "train_dspark.py"


def write_tiny_target(folder: Path) -> None:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved like any Hub model."""
    require_default_target()
    from hf_dspark.resources import default_target_path

    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    config = tiny_target_config("llama", vocab_size=len(tokenizer))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = (
        tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_chats(path: Path, count: int, start: int = 0) -> Path:
    """`count` short arithmetic conversations in the {'messages': [...]} JSONL format."""
    with open(path, "w") as f:
        for i in range(start, start + count):
            answer = f"The answer is {2 * i}. Adding {i} to itself doubles it, so {i} + {i} = {2 * i}."
            messages = [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny random Llama target plus 12 conversations."""
    root = tmp_path_factory.mktemp("example")
    write_tiny_target(root / "target")
    write_chats(root / "chats.jsonl", 12)
    return root


def common_flags(root: Path, output: str, algorithm: str) -> list[str]:
    return [
        "--target_model", str(root / "target"), "--train_file", str(root / "chats.jsonl"),
        "--algorithm", algorithm, "--output_dir", str(root / output), "--block_size", "4", "--max_length", "128",
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--logging_steps", "1", "--report_to", "none",
        "--save_strategy", "no", "--use_cpu", "--seed", "3",
    ]  # fmt: skip


def launch_command(root: Path, num_processes: int, flags: list[str], config: Path | None = None):
    """(command, environment) of `accelerate launch` of the example; `config`: an accelerate config file to place
    the processes instead."""
    accelerate = Path(sys.executable).parent / "accelerate"
    if config is not None:
        placement = ["--config_file", str(config), "--num_processes", str(num_processes)]
    elif num_processes > 1:  # torchrun-style processes; on CPU they talk through gloo
        placement = ["--multi_gpu", "--num_processes", str(num_processes)]
    else:
        placement = ["--cpu", "--num_processes", "1"]
    cmd = [str(accelerate), "launch", *placement, "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0", str(EXAMPLE), *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(root / "hf_datasets"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    return cmd, env


def launch(root: Path, num_processes: int, flags: list[str], config: Path | None = None) -> str:
    """Run `launch_command` to its successful end; its output."""
    cmd, env = launch_command(root, num_processes, flags, config)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_example_trains_online_in_one_process(tiny_setup):
    out = launch(tiny_setup, 1, common_flags(tiny_setup, "online", "dspark") + ["--num_hidden_layers", "1"])
    assert "draft saved to" in out
    draft = AutoModel.from_pretrained(tiny_setup / "online")
    assert isinstance(draft, DSparkModel) and draft.config.block_size == 4
    assert not (tiny_setup / "cache").exists()


@pytest.mark.slow
def test_example_builds_a_cache_and_trains_from_it_in_two_gloo_processes(tiny_setup):
    flags = common_flags(tiny_setup, "cached", "dspark")
    # 4 anchors a row: the held-out rows (about 30 answer positions) are walked in passes, as many on both processes.
    flags += ["--cache_dir", str(tiny_setup / "cache"), "--eval_rows", "2", "--num_anchors", "4"]
    out = launch(tiny_setup, 2, flags)
    manifest = json.loads((tiny_setup / "cache" / "train" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_rows"] == 10
    assert "eval_tau_prob" in out and "eval_tau_walk_prob" in out and "draft saved to" in out
    assert "walk_rows_skipped" not in out
    assert "loss_conf" in out  # the DSpark objective ran under DDP (Markov W2 gets its gradient outside forward)
    draft = AutoModel.from_pretrained(tiny_setup / "cached")
    assert isinstance(draft, DSparkModel)


@pytest.mark.slow
def test_example_trains_under_deepspeed_zero3_as_under_ddp_and_resumes(tiny_setup):
    """examples/configs/deepspeed_zero3.yaml, the README's ZeRO-3 command, in two gloo processes: the frozen target
    loads whole on each process, and the draft's weights, sharded, follow the same steps as under DDP. The Markov
    head's W2, read by the loss outside any module forward, must get its gradient: Adam moves a trained weight by
    about the learning rate (6e-4) a step, so a W2 left behind would miss the tolerance by 10x. A run resumed from
    its ZeRO-3 checkpoint (sharded optimizer states) ends where the uninterrupted run does. The final held-out
    evaluation runs in anchor passes (4 anchors, rows of about 30 answer positions): the sharded weights gather in
    every pass, as many on both processes."""
    pytest.importorskip("deepspeed")
    zero3_config = REPO / "examples" / "configs" / "deepspeed_zero3.yaml"
    flags = common_flags(tiny_setup, "zero3", "dspark") + ["--num_hidden_layers", "1", "--warmup_steps", "0",
                                                           "--eval_rows", "2", "--num_anchors", "4"]  # fmt: skip
    flags[flags.index("--max_steps") + 1] = "3"

    def with_flags(output: str, **changes) -> list[str]:
        out = list(flags)
        out[out.index("--output_dir") + 1] = str(tiny_setup / output)
        for name, value in changes.items():
            if f"--{name}" in out:
                out[out.index(f"--{name}") + 1] = value
            else:
                out += [f"--{name}", value]
        return out

    zero3 = launch(tiny_setup, 2, with_flags("zero3", save_strategy="steps", save_steps="2"), config=zero3_config)
    ddp = launch(tiny_setup, 2, with_flags("zero3_ddp"))
    shutil.copytree(tiny_setup / "zero3" / "checkpoint-2", tiny_setup / "zero3_resumed" / "checkpoint-2")
    resumed = launch(tiny_setup, 2, with_flags("zero3_resumed", resume_from_checkpoint="true"), config=zero3_config)

    def losses(out: str) -> list[float]:
        return [float(v) for v in re.findall(r"'loss': '([0-9.]+)'", out)]

    assert len(losses(zero3)) == 3 and losses(zero3) == pytest.approx(losses(ddp), abs=2e-3)
    assert "eval_tau_walk_prob" in zero3 and "walk_rows_skipped" not in zero3
    assert losses(resumed) == losses(zero3)[2:]  # only step 3 ran again
    sharded = AutoModel.from_pretrained(tiny_setup / "zero3").state_dict()
    for name, other in [("DDP", "zero3_ddp"), ("resumed", "zero3_resumed")]:
        weights = AutoModel.from_pretrained(tiny_setup / other).state_dict()
        assert sharded.keys() == weights.keys()
        for key in sharded:
            torch.testing.assert_close(sharded[key], weights[key], rtol=0, atol=1e-4, msg=f"{other}: {key}")


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_a_checkpoint_on_both_processes_and_the_run_resumes(tiny_setup):
    """A preempted job: SIGTERM to `accelerate launch` reaches both gloo processes (torchrun passes it on, and kills
    them 30 s later); they agree on the step, save a complete checkpoint there although the run saves none otherwise,
    and exit with 143 (128 + SIGTERM) instead of being killed with the work lost. The same command with
    --resume_from_checkpoint true ends the run."""
    flags = common_flags(tiny_setup, "preempted", "dspark") + ["--num_hidden_layers", "1"]
    flags[flags.index("--max_steps") + 1] = "12"
    cmd, env = launch_command(tiny_setup, 2, flags)
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in job.stdout:  # the first step's log: training runs; the stop comes at the first agreement
        seen.append(line)
        if "'loss'" in line:
            job.send_signal(signal.SIGTERM)
            break
    seen.append(job.stdout.read())
    assert job.wait(timeout=600) == 128 + signal.SIGTERM, "".join(seen)[-4000:]
    out = "".join(seen)
    stops = re.findall(r"SIGTERM: saving a checkpoint at step (\d+)", out)
    assert len(stops) == 2 and stops[0] == stops[1] and int(stops[0]) < 12, out[-4000:]  # both, at the same step
    assert "draft saved to" not in out
    checkpoint = tiny_setup / "preempted" / f"checkpoint-{stops[0]}"
    assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "trainer_state.json").exists()

    resumed = launch(tiny_setup, 2, flags + ["--resume_from_checkpoint", "true"])
    assert "draft saved to" in resumed
    assert json.loads((tiny_setup / "preempted" / "trainer_state.json").read_text())["global_step"] == 12


@pytest.mark.slow
def test_time_budget_stops_both_gloo_processes_at_the_same_step(tiny_setup):
    """A time-budgeted run under DDP: rank 0's clock decides the stop and the fitted schedule for both processes
    (exchanged at every step end, read a step later), so both leave the training loop at the same step and the run
    ends with a saved draft. A process stopping alone would leave the other waiting in its next gradient all-reduce
    (the launch would time out)."""
    flags = common_flags(tiny_setup, "budgeted", "dspark") + ["--num_hidden_layers", "1", "--max_train_minutes", "0.75"]
    flags[flags.index("--max_steps") + 1] = "1000000"
    out = launch(tiny_setup, 2, flags)
    assert "draft saved to" in out
    state = json.loads((tiny_setup / "budgeted" / "trainer_state.json").read_text())
    planned = [entry["planned_steps"] for entry in state["log_history"] if "planned_steps" in entry]
    assert planned and TrainingDeadline.PLAN_EVERY < state["global_step"] < 1_000_000, state["log_history"][-1]


def test_cli_train_runs_the_example_code_path(tiny_setup, monkeypatch):
    from hf_dspark.cli import main

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tiny_setup / "hf_datasets"))
    flags = common_flags(tiny_setup, "cli", "eagle3")
    flags[flags.index("--max_steps") + 1] = "1"
    assert main(["train", *flags]) == 0
    draft = AutoModel.from_pretrained(tiny_setup / "cli")
    assert isinstance(draft, Eagle3Model) and draft.config.ttt_length == 4


def test_recipe_defaults_reach_a_run_and_flags_restore_the_earlier_ones(tiny_setup, monkeypatch):
    """The recipe's data and anchor defaults (loops cut to 2 repeats; DSpark 256 anchors, DFlash its config's 512)
    reach a run started with no such flags; --max_loop_repeats 0 and --num_anchors 512 give the earlier recipe."""
    import hf_dspark.data as data
    from hf_dspark.cli import main

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tiny_setup / "hf_datasets"))
    seen = []
    tokenize = data.tokenize_conversations
    monkeypatch.setattr(data, "tokenize_conversations",
                        lambda *a, **kw: seen.append(kw["max_loop_repeats"]) or tokenize(*a, **kw))  # fmt: skip

    def run(output, algorithm, extra=()):
        flags = common_flags(tiny_setup, output, algorithm)
        flags[flags.index("--max_steps") + 1] = "1"
        assert main(["train", *flags, *extra]) == 0
        return AutoModel.from_pretrained(tiny_setup / output).config

    assert run("recipe_dspark", "dspark").num_anchors == 256 and seen == [2]
    assert run("recipe_dflash", "dflash").num_anchors == 512
    earlier = run("earlier_dspark", "dspark", ["--max_loop_repeats", "0", "--num_anchors", "512"])
    assert earlier.num_anchors == 512 and seen[-1] == 0


def test_eval_file_replaces_the_held_out_split(tiny_setup, tmp_path, monkeypatch):
    """--eval_file: the held-out rows come from that file (its first --eval_rows), every training row trains; runs
    on different data can then be compared on the same held-out rows."""
    from hf_dspark.cli import main
    from hf_dspark.training import script

    seen = {}

    class Recording(script.DraftTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["train"], seen["eval"] = len(self.train_dataset), len(self.eval_dataset)
            seen["first_eval_ids"] = self.eval_dataset[0]["input_ids"]

    monkeypatch.setattr(script, "DraftTrainer", Recording)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tiny_setup / "hf_datasets"))
    held = write_chats(tmp_path / "held_out.jsonl", 5, start=100)
    flags = common_flags(tiny_setup, "eval_file", "dspark") + [
        "--eval_file", str(held), "--eval_rows", "3", "--eval_strategy", "steps", "--eval_steps", "1"]  # fmt: skip
    assert main(["train", *flags]) == 0
    assert (seen["train"], seen["eval"]) == (12, 3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_setup / "target")
    assert "What is 100 plus 100?" in tokenizer.decode(seen["first_eval_ids"])  # the file's first row, in order
    state = json.loads((tiny_setup / "eval_file" / "trainer_state.json").read_text())
    assert any("eval_tau_prob" in h for h in state["log_history"])


def test_named_eval_files_are_separate_sets_with_their_own_metrics(tiny_setup, tmp_path, monkeypatch):
    """--eval_file NAME=FILE ...: one held-out set per name (e.g. the target's greedy and T = 1 answers), each
    evaluated and logged as eval_NAME_*; a mix of named and plain entries is refused."""
    from hf_dspark.cli import main
    from hf_dspark.training.script import eval_file_sets

    assert eval_file_sets(["a.jsonl", "b/*.jsonl"]) == {"": ["a.jsonl", "b/*.jsonl"]}
    assert eval_file_sets(["greedy=a.jsonl", "t1=b.jsonl", "t1=c.jsonl"]) == {"greedy": ["a.jsonl"],
                                                                              "t1": ["b.jsonl", "c.jsonl"]}
    assert eval_file_sets(["runs/x=1/a.jsonl"]) == {"": ["runs/x=1/a.jsonl"]}  # a path, not a name
    with pytest.raises(ValueError, match="name every set"):
        eval_file_sets(["greedy=a.jsonl", "b.jsonl"])
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tiny_setup / "hf_datasets"))
    greedy = write_chats(tmp_path / "greedy.jsonl", 3, start=100)
    sampled = write_chats(tmp_path / "sampled.jsonl", 2, start=200)
    flags = common_flags(tiny_setup, "named_eval", "dspark") + [
        "--eval_file", f"greedy={greedy}", f"t1={sampled}", "--eval_strategy", "steps", "--eval_steps", "1"]  # fmt: skip
    assert main(["train", *flags]) == 0
    logs = json.loads((tiny_setup / "named_eval" / "trainer_state.json").read_text())["log_history"]
    for name in ("greedy", "t1"):
        points = [h for h in logs if f"eval_{name}_tau_prob" in h]
        assert points and all(h[f"eval_{name}_tau_greedy"] >= 1.0 and f"eval_{name}_loss" in h for h in points)
    assert not any("eval_tau_prob" in h for h in logs)  # no unnamed metrics mixed in
    # From a target cache: each named set gets its own.
    cached = common_flags(tiny_setup, "named_eval_cached", "dspark") + [
        "--cache_dir", str(tmp_path / "cache"), "--eval_file", f"greedy={greedy}", f"t1={sampled}"]  # fmt: skip
    cached[cached.index("--max_steps") + 1] = "1"
    assert main(["train", *cached]) == 0
    assert {p.name for p in (tmp_path / "cache").iterdir()} == {"train", "eval_greedy", "eval_t1"}
    logs = json.loads((tiny_setup / "named_eval_cached" / "trainer_state.json").read_text())["log_history"]
    assert any("eval_greedy_tau_prob" in h for h in logs) and any("eval_t1_tau_prob" in h for h in logs)


def test_cli_train_help_lists_the_draft_and_data_flags(capsys):
    from hf_dspark.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target_model", "--train_file", "--algorithm", "--cache_dir", "--num_hidden_layers",
                 "--block_size", "--max_length", "--max_steps", "--learning_rate", "--target"):  # fmt: skip
        assert flag in text, flag
    assert "{dspark,dflash,eagle3}" in text  # --algorithm lists its choices
    # The rest is behind --help_all (778 lines): the short help is the draft's flags and a few Trainer ones.
    assert "--adam_beta1" not in text and len(text.splitlines()) < 300
    with pytest.raises(SystemExit):
        main(["train", "--help_all"])
    assert "--adam_beta1" in capsys.readouterr().out


def test_cli_train_typo_in_algorithm_names_the_choices(tiny_setup, capsys):
    from hf_dspark.cli import main

    flags = common_flags(tiny_setup, "typo", "dspork")
    with pytest.raises(SystemExit) as exit_info:  # the parser's own choices check
        main(["train", *flags])
    assert exit_info.value.code == 2
    assert "choose from" in capsys.readouterr().err


def test_accelerate_configs_load_and_point_to_the_deepspeed_json():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    multi = load_config_from_file(str(REPO / "examples" / "configs" / "multi_gpu.yaml"))
    assert multi.distributed_type == DistributedType.MULTI_GPU and multi.mixed_precision == "bf16"
    zero3 = load_config_from_file(str(REPO / "examples" / "configs" / "deepspeed_zero3.yaml"))
    assert zero3.distributed_type == DistributedType.DEEPSPEED
    ds_json = json.loads((REPO / zero3.deepspeed_config["deepspeed_config_file"]).read_text())
    assert ds_json["zero_optimization"]["stage"] == 3
    assert ds_json["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]  # checkpoints stay drafts
    assert zero3.deepspeed_config["zero3_init_flag"] is False  # the frozen target must load whole


def test_resume_true_means_the_newest_checkpoint_and_fails_clearly_without_one(tmp_path):
    from hf_dspark.training.checkpoints import resolve_resume_checkpoint

    with pytest.raises(ValueError, match="no complete checkpoint-\\* folder"):
        resolve_resume_checkpoint("true", tmp_path)
    (tmp_path / "checkpoint-5").mkdir()
    with pytest.raises(ValueError, match="only incomplete ones: checkpoint-5"):
        resolve_resume_checkpoint("latest", tmp_path)


def test_ablations_variants_combine_with_plus_and_unknown_names_are_refused(capsys):
    ablations = load_script("benchmarks/ablations.py")
    args = ablations.parse_args(["--output_dir", "x", "--variants", "baseline", "mlp_2x+soft_ce"])
    assert args.variants == ["baseline", "mlp_2x+soft_ce"]
    assert ablations.variant_flags("mlp_2x+soft_ce") == ablations.VARIANTS["mlp_2x"] + ablations.VARIANTS["soft_ce"]
    assert ablations.variant_flags("baseline") == []
    with pytest.raises(SystemExit):
        ablations.parse_args(["--output_dir", "x", "--variants", "mlp_2x+wide"])
    assert "unknown variant(s) ['wide']" in capsys.readouterr().err


def test_ablations_step_rate_leaves_out_evaluations_and_compilation(tmp_path):
    """The reported seconds a step come from the intervals between training logs, each started after its step's
    evaluation; the first log's time (compilation included) is reported apart."""
    ablations = load_script("benchmarks/ablations.py")
    history = [{"loss": 3.0, "step": 100, "elapsed_s": 60.0}, {"eval_tau_prob": 1.2, "step": 100, "elapsed_s": 70.0},
               {"loss": 2.5, "step": 200, "elapsed_s": 80.0}, {"eval_tau_prob": 1.3, "step": 200, "elapsed_s": 90.0},
               {"loss": 2.4, "step": 300, "elapsed_s": 102.0}]  # fmt: skip
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    rate = ablations.step_rate(tmp_path)
    assert rate["first_log"] == {"step": 100, "elapsed_s": 60.0}
    assert rate["seconds_per_step"] == pytest.approx(0.11)  # median of 0.10 and 0.12; evaluations left out
    assert rate["compile_s"] is None  # logs from before compile_s was logged
    assert ablations.step_rate(tmp_path / "missing") == {"first_log": None, "seconds_per_step": None, "compile_s": None,
                                                          "startup_s": None, "first_step_s": None,
                                                          "startup_phases": {}}


def test_every_ablation_variant_is_flags_the_training_script_takes(tmp_path):
    """Each variant's flags parse with the training script's own parser and change what they name."""
    from hf_dspark.training import training_argument_parser

    ablations = load_script("benchmarks/ablations.py")
    parser = training_argument_parser()
    base = ["--output_dir", str(tmp_path), "--train_file", "x.jsonl", "--use_cpu", "true"]

    def parsed(flags):  # every field of the script's and the trainer's arguments, by name
        return {k: v for part in parser.parse_args_into_dataclasses(base + flags) for k, v in vars(part).items()}

    defaults = parsed([])
    assert set(ablations.NOW_DEFAULTS) <= set(ablations.VARIANTS)
    for name, flags in ablations.VARIANTS.items():
        if name in ablations.NOW_DEFAULTS:  # the recipe since: they repeat the defaults on purpose
            continue
        values = parsed(flags)
        for field in (f[2:] for f in flags if f.startswith("--")):
            assert values[field] != defaults[field], (name, field)


def test_ablations_runs_compile_into_their_own_caches_unless_shared(tmp_path):
    """--compile_cache per_run (default): each run gets its own empty torch.compile and Triton caches, so a run's
    budget does not depend on what earlier runs compiled; shared: the machine's caches, untouched."""
    ablations = load_script("benchmarks/ablations.py")
    args = ablations.parse_args(["--output_dir", str(tmp_path), "--data", "x.jsonl"])
    assert args.compile_cache == "per_run"
    envs = {name: ablations.run_env(args, name, "1", tmp_path / "caches") for name in ("baseline", "eagle3")}
    assert envs["baseline"]["CUDA_VISIBLE_DEVICES"] == "1"
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        dirs = {envs[name][key] for name in envs}
        assert len(dirs) == 2 and all(d.startswith(str(tmp_path / "caches")) for d in dirs)
    args = ablations.parse_args(["--output_dir", str(tmp_path), "--data", "x.jsonl", "--compile_cache", "shared"])
    env = ablations.run_env(args, "baseline", "0", tmp_path / "caches")
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env.get(key) == os.environ.get(key)


def test_ablations_curve_merges_the_named_held_out_sets_of_a_step(tmp_path):
    """--eval_file NAME=FILE: transformers logs each held-out set apart at the same step; a curve point holds all."""
    ablations = load_script("benchmarks/ablations.py")
    history = [{"loss": 3.0, "step": 100, "elapsed_s": 60.0},
               {"eval_greedy_loss": 2.0, "eval_greedy_tau_prob": 1.5, "eval_greedy_tau_greedy": 1.7,
                "eval_greedy_loss_ce": 2.5, "step": 100, "elapsed_s": 61.0},
               {"eval_t1_loss": 2.2, "eval_t1_tau_prob": 1.3, "eval_t1_tau_greedy": 1.4, "step": 100, "elapsed_s": 62.0}]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))  # fmt: skip
    points = ablations.curve(tmp_path)
    assert points == [{"step": 100, "elapsed_s": 61.0, "eval_greedy_loss": 2.0, "eval_greedy_tau_prob": 1.5,
                       "eval_greedy_tau_greedy": 1.7, "eval_t1_loss": 2.2, "eval_t1_tau_prob": 1.3,
                       "eval_t1_tau_greedy": 1.4}]  # fmt: skip
    assert ablations.held_out_sets(points[0]) == ["eval_greedy_", "eval_t1_"]


def test_ablations_driver_writes_curves_against_time_and_a_plot(tiny_setup, tmp_path):
    """benchmarks/ablations.py --smoke: each variant is its own train_dspark.py run; the report holds every run's
    held-out τ by step and by training time and each draft's decoding τ (--eval_data); the plot is written."""
    ablations = load_script("benchmarks/ablations.py")
    out = tmp_path / "abl"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"What is {i} plus {i}?"]}) + "\n" for i in range(3)))
    more = tmp_path / "more_chats.jsonl"
    write_chats(more, 6, start=12)
    both = f"{tiny_setup / 'chats.jsonl'},{more}"
    held_out = write_chats(tmp_path / "held_out.jsonl", 4, start=50)
    report = ablations.main(["--smoke", "--target", str(tiny_setup / "target"), "--data", str(tiny_setup / "chats.jsonl"),
                             "--output_dir", str(out), "--variants", "baseline", "--data_variant", f"more_data={both}",
                             "--eval_file", str(held_out),
                             "--eval_data", str(prompts), "--eval_prompts", "2", "--eval_max_new_tokens", "8",
                             "--eval_batch_size", "2", "--eval_baselines", "static"])  # fmt: skip
    assert set(report["variants"]) == {"baseline", "more_data"}
    # The data variant trained on its own files (12 + 6 conversations), the baseline on --data's 12.
    assert report["variants"]["more_data"]["flags"] == ["--train_file", str(tiny_setup / "chats.jsonl"), str(more)]
    # With --eval_file both evaluate on its 4 rows and train on all of their data: 12 and 18 conversations.
    epochs = {name: ablations.log_history(out / name)[-1]["epoch"] for name in report["variants"]}
    assert epochs == {"baseline": pytest.approx(4 * 2 / 12), "more_data": pytest.approx(4 * 2 / 18)}  # 4 steps of 2
    for name, run in report["variants"].items():
        assert run["returncode"] == 0, (out / f"{name}.log").read_text()[-2000:]
        assert run["held_out"] and all(p["elapsed_s"] > 0 and p["eval_tau_prob"] >= 1.0 for p in run["held_out"])
        assert all(p["eval_tau_walk_greedy"] >= 1.0 for p in run["held_out"])  # walked as decoding, too
        assert [p["elapsed_s"] for p in run["held_out"]] == sorted(p["elapsed_s"] for p in run["held_out"])
        assert run["first_log"]["elapsed_s"] > 0 and run["seconds_per_step"] > 0  # speed apart from compilation
        assert run["compile_s"] == 0.0  # CPU smoke runs compile nothing (their logs say so)
        assert run["startup_s"] > 0 and run["first_step_s"] > 0  # the wait for the first step, in two parts
        assert set(run["startup_phases"]) == {"process", "target", "data", "draft", "trainer"}  # the first part, split
    assert json.loads((out / "ablations.json").read_text())["variants"].keys() == report["variants"].keys()
    assert (out / "ablations.png").stat().st_size > 1000
    assert report["compile_cache"] == "per_run" and not list(out.glob("compile_caches_*"))  # scratch caches removed
    # Every variant's draft decoded on the same prompts, greedy and T = 1.
    decoding = report["decoding_eval"]
    assert decoding["returncode"] == 0, (out / "eval.log").read_text()[-2000:]
    assert "--static_baseline true --eager_baseline false" in decoding["command"]  # --eval_baselines static
    assert set(decoding["tau"]) == {"baseline", "more_data"}
    assert all(set(t) == {"prompts@T0", "prompts@T1"} and min(t.values()) >= 1.0 for t in decoding["tau"].values())
    assert decoding["mean_tau"]["baseline"] == {"T0": decoding["tau"]["baseline"]["prompts@T0"],
                                                "T1": decoding["tau"]["baseline"]["prompts@T1"]}  # fmt: skip
    # The eval compares each draft with the first variant named (not the first to finish), paired over prompts.
    assert "| more_data - baseline |" in (out / "eval" / "results.md").read_text()
    means = ablations.decoded_mean_tau({"a": {"gsm8k@T0": 2.0, "mt-bench@T0": 1.0, "gsm8k@T1": 1.5}})
    assert means == {"a": {"T0": 1.5, "T1": 1.5}}


def test_first_step_benchmark_times_fresh_processes_per_package_and_a_warm_one(tiny_setup, tmp_path):
    """benchmarks/first_step.py --smoke: a tokenizing run, cold runs alternating between two package sources, one
    warm run each; every row has the wait split into startup and first step, and the summary names both packages."""
    first_step = load_script("benchmarks/first_step.py")
    with pytest.raises(SystemExit, match="holds no hf_dspark package"):
        first_step.packages_of([f"x={tmp_path}"])
    report = first_step.main(["--smoke", "--target", str(tiny_setup / "target"), "--data", str(tiny_setup / "chats.jsonl"),
                              "--packages", f"a={REPO / 'src'}", f"b={REPO / 'src'}", "--runs", "1",
                              "--work_dir", str(tmp_path / "w"), "--output", str(tmp_path / "fs.json")])  # fmt: skip
    assert [(r["package"], r["role"]) for r in report["runs"]] == [
        ("a", "tokenizes"), ("a", "cold1"), ("b", "cold1"), ("a", "warm"), ("b", "warm")]
    for row in report["runs"]:
        assert row["returncode"] == 0 and row["startup_s"] > 0 and row["first_step_s"] > 0
        assert row["to_first_step_s"] == pytest.approx(row["startup_s"] + row["first_step_s"], abs=0.11)
        assert set(row["startup_phases"]) == {"process", "target", "data", "draft", "trainer"}
    assert set(report["summary"]) == {"a", "b"} and report["summary"]["a"]["warm_s"] > 0
    assert json.loads((tmp_path / "fs.json").read_text())["runs"] == report["runs"]


def test_data_prep_benchmark_times_every_phase_per_package_in_fresh_processes(tiny_setup, tmp_path):
    """benchmarks/data_prep.py: rounds alternate between package sources; each run reports every phase and the
    rows `tokenize_conversations` kept, the same for both sources (the same code here)."""
    data_prep = load_script("benchmarks/data_prep.py")
    looping = {"messages": [{"role": "user", "content": "Go on."},
                            {"role": "assistant", "content": "Start. " + "Again and again. " * 30}], "finish": "length"}  # fmt: skip
    chats = tmp_path / "chats.jsonl"
    chats.write_text((tiny_setup / "chats.jsonl").read_text() + json.dumps(looping) + "\n")
    report = data_prep.main(["--data", str(chats), "--packages", f"a={REPO / 'src'}", f"b={REPO / 'src'}",
                             "--runs", "2", "--output", str(tmp_path / "dp.json")])  # fmt: skip
    assert [row["package"] for row in report["runs"]] == ["a", "b", "b", "a"]
    for row in report["runs"]:
        assert row["conversations"] == 13 and row["rows"] == 13 and row["tokens"] > 13 * 20
        assert all(row[phase] >= 0 for phase in data_prep.PHASES) and row["end_to_end"] > 0
    assert set(report["summary"]) == {"a", "b"} and set(report["summary"]["a"]) == set(data_prep.PHASES)
    assert json.loads((tmp_path / "dp.json").read_text())["summary"] == report["summary"]
