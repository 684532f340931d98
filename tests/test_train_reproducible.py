"""Reproducible training: the same seed gives the same run, and a run killed (SIGKILL) right after a checkpoint
resumes into the same run, online and from a target cache. CPU, bit for bit.

Each run is examples/train_dspark.py in its own process on a tiny random Llama and 48 tiny conversations.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_train_example import EXAMPLE, write_chats, write_tiny_target

MAX_STEPS, SAVE_STEPS = 8, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproducible")
    write_tiny_target(root / "target")
    write_chats(root / "chats.jsonl", 48)
    yield root
    shutil.rmtree(root, ignore_errors=True)  # ~3 GB of checkpoints (the Markov head spans the vocabulary)


def flags(root: Path, output: str, seed: int = 0, *extra: str) -> list[str]:
    return [
        "--target_model", str(root / "target"), "--train_file", str(root / "chats.jsonl"), "--algorithm", "dspark",
        "--num_hidden_layers", "1", "--block_size", "4", "--num_anchors", "4", "--max_length", "128",
        "--output_dir", str(root / output), "--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS),
        "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--logging_steps", "1",
        "--report_to", "none", "--use_cpu", "--seed", str(seed), "--disable_tqdm", "true", *extra,
    ]  # fmt: skip


def start(root: Path, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(root / "hf_datasets"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    with open(log, "w") as out:  # a file, not a pipe: an unread pipe could stall the run
        return subprocess.Popen([sys.executable, str(EXAMPLE), *args], env=env, stdout=out, stderr=subprocess.STDOUT)


def run(root: Path, args: list[str]) -> str:
    log = root / "run.log"
    process = start(root, args, log)
    process.wait(timeout=300)
    out = log.read_text()
    assert process.returncode == 0, out[-6000:]
    return out


def run_killed_after_first_checkpoint(root: Path, args: list[str]) -> str:
    """Start a run and SIGKILL it as soon as its first checkpoint is complete (its trainer_state.json, written
    last, parses); then the newest complete checkpoint is where a resume starts: returns its folder."""
    from hf_dspark.training.checkpoints import last_complete_checkpoint

    output_dir = Path(args[args.index("--output_dir") + 1])
    state_file = output_dir / f"checkpoint-{SAVE_STEPS}" / "trainer_state.json"
    log = root / "killed.log"
    process = start(root, args, log)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            try:
                json.loads(state_file.read_text())
                break
            except (OSError, ValueError):
                time.sleep(0.002)
        assert process.poll() is None, "the run ended before it could be killed:\n" + log.read_text()[-4000:]
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not (output_dir / "model.safetensors").exists()  # killed before the end, not after
    resume_from = last_complete_checkpoint(output_dir)
    assert resume_from is not None and not resume_from.endswith(f"checkpoint-{MAX_STEPS}")
    return resume_from


def steps_logged(out: str) -> int:
    return sum(line.startswith("{'loss'") for line in out.splitlines())


def logged_losses(output_dir: Path) -> list[dict]:
    """Every per-step training log (loss, grad_norm, learning rate, the objective's terms) of the final
    checkpoint's trainer_state.json: a resumed run's history carries over from its checkpoint. Wall-clock entries
    (elapsed_s) are left out: they are the one thing a repeated run does not repeat."""
    state = json.loads((output_dir / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    logs = [{k: v for k, v in entry.items() if k != "elapsed_s"} for entry in state["log_history"] if "loss" in entry]
    assert [entry["step"] for entry in logs] == list(range(1, MAX_STEPS + 1))
    return logs


def assert_same_weights(a: Path, b: Path) -> None:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert first.keys() == second.keys()
    differing = [name for name in first if not first[name].equal(second[name])]
    assert not differing, f"weights differ: {differing}"


@pytest.fixture(scope="module")
def uninterrupted(setup):
    run(setup, flags(setup, "uninterrupted"))
    return setup / "uninterrupted"


@pytest.mark.slow
def test_the_same_seed_gives_the_same_run_bit_for_bit(setup, uninterrupted):
    run(setup, flags(setup, "again"))
    assert logged_losses(setup / "again") == logged_losses(uninterrupted)
    assert_same_weights(setup / "again", uninterrupted)
    losses = [entry["loss"] for entry in logged_losses(uninterrupted)]
    assert len(set(losses)) > 1  # it trained

    # And the seed matters: another one gives another draft and other losses from the first step on.
    other = flags(setup, "other_seed", 1)
    other[other.index("--max_steps") + 1] = str(SAVE_STEPS)
    run(setup, other)
    state = json.loads((setup / "other_seed" / f"checkpoint-{SAVE_STEPS}" / "trainer_state.json").read_text())
    assert state["log_history"][0]["loss"] != logged_losses(uninterrupted)[0]["loss"]
    assert not load_file(setup / "other_seed" / "model.safetensors")["fc.weight"].equal(
        load_file(uninterrupted / f"checkpoint-{SAVE_STEPS}" / "model.safetensors")["fc.weight"]
    )


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_into_the_same_run(setup, uninterrupted):
    args = flags(setup, "killed")
    resume_from = run_killed_after_first_checkpoint(setup, args)
    # The next save cut off while writing its weights (unless the kill already left one like it).
    cut = setup / "killed" / f"checkpoint-{MAX_STEPS}"
    if not cut.exists():
        cut.mkdir()
        weights = (Path(resume_from) / "model.safetensors").read_bytes()
        (cut / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    out = run(setup, [*args, "--resume_from_checkpoint", "true"])
    assert "draft saved to" in out
    assert f"skipping {cut}: " in out  # says which folder it did not trust
    assert steps_logged(out) == MAX_STEPS - int(resume_from.rsplit("-", 1)[1])  # it resumed, it did not restart
    assert logged_losses(setup / "killed") == logged_losses(uninterrupted)
    assert_same_weights(setup / "killed", uninterrupted)


@pytest.mark.slow
def test_a_run_from_a_target_cache_killed_after_a_checkpoint_resumes_into_the_same_run(setup):
    cache = ["--cache_dir", str(setup / "cache")]
    run(setup, flags(setup, "cached", 0, *cache))
    assert json.loads((setup / "cache" / "train" / "manifest.json").read_text())["complete"]
    args = flags(setup, "cached_killed", 0, *cache)
    resume_from = run_killed_after_first_checkpoint(setup, args)
    out = run(setup, [*args, "--resume_from_checkpoint", "true"])
    assert steps_logged(out) == MAX_STEPS - int(resume_from.rsplit("-", 1)[1])
    assert logged_losses(setup / "cached_killed") == logged_losses(setup / "cached")
    assert_same_weights(setup / "cached_killed", setup / "cached")


# -- interrupted checkpoint saves ---------------------------------------------------------------------------------


def damage(folder: Path, how: str) -> None:
    """Leave `folder` as a save cut off at some point would."""
    if how == "no_state":  # killed before trainer_state.json, the last file of a save
        (folder / "trainer_state.json").unlink()
    elif how == "cut_state":
        text = (folder / "trainer_state.json").read_text()
        (folder / "trainer_state.json").unlink()  # the copy is hard-linked: never write through it
        (folder / "trainer_state.json").write_text(text[: len(text) // 2])
    else:  # a save over an older complete folder, killed while rewriting one of its files
        name = {"cut_weights": "model.safetensors", "cut_optimizer": "optimizer.pt", "cut_rng": "rng_state.pth"}[how]
        data = (folder / name).read_bytes()
        (folder / name).unlink()
        (folder / name).write_bytes(data[: len(data) // 2])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["no_state", "cut_state", "cut_weights", "cut_optimizer", "cut_rng"])
def test_resume_never_takes_an_interrupted_checkpoint_for_a_complete_one(uninterrupted, tmp_path, caplog, how):
    from transformers.trainer_utils import get_last_checkpoint

    from hf_dspark.training.checkpoints import checkpoint_problem, resolve_resume_checkpoint

    output_dir = tmp_path / "run"
    for step in (SAVE_STEPS, MAX_STEPS):  # hard links: the copies cost no disk
        shutil.copytree(uninterrupted / f"checkpoint-{step}", output_dir / f"checkpoint-{step}", copy_function=os.link)
    older, newest = output_dir / f"checkpoint-{SAVE_STEPS}", output_dir / f"checkpoint-{MAX_STEPS}"
    assert checkpoint_problem(newest) is None
    damage(newest, how)
    expected = {"no_state": "no trainer_state.json", "cut_state": "trainer_state.json does not parse",
                "cut_weights": "model.safetensors is cut off", "cut_optimizer": "optimizer.pt is cut off",
                "cut_rng": "rng_state.pth is cut off"}[how]  # fmt: skip
    assert expected in checkpoint_problem(newest)
    # Trainer alone would resume from the highest step whatever it holds.
    assert get_last_checkpoint(str(output_dir)) == str(newest)

    with caplog.at_level(logging.WARNING, logger="hf_dspark.training.checkpoints"):
        assert resolve_resume_checkpoint("true", output_dir) == str(older)
    assert f"skipping {newest}: " in caplog.text and expected in caplog.text
    with pytest.raises(ValueError, match=f"cannot resume from {newest}: .*--resume_from_checkpoint true"):
        resolve_resume_checkpoint(str(newest), output_dir)

    damage(older, how)
    only_incomplete = "no complete checkpoint-.* \\(only incomplete ones: checkpoint-8, checkpoint-4\\)"
    with pytest.raises(ValueError, match=only_incomplete):
        resolve_resume_checkpoint(True, output_dir)


@pytest.mark.slow
def test_a_checkpoint_without_optimizer_or_scheduler_state_is_incomplete(uninterrupted, tmp_path):
    from hf_dspark.training.checkpoints import checkpoint_problem

    folder = tmp_path / f"checkpoint-{SAVE_STEPS}"
    shutil.copytree(uninterrupted / folder.name, folder, copy_function=os.link)
    (folder / "scheduler.pt").unlink()
    assert checkpoint_problem(folder) == "it has no scheduler state"
    (folder / "optimizer.pt").unlink()
    assert checkpoint_problem(folder) == "it has no optimizer state"
    assert checkpoint_problem(folder, needs_optimizer=False) is None  # save_only_model checkpoints
    (folder / "model.safetensors").unlink()
    assert checkpoint_problem(folder, needs_optimizer=False) == "it has no model weights"


# -- seed vs data_seed --------------------------------------------------------------------------------------------


def test_seed_fixes_the_draft_and_data_seed_the_data_order_and_anchors(tmp_path):
    import torch
    from conftest import make_tiny_target
    from test_trainer import make_args, tokenized_rows, trainable_state

    from hf_dspark.training import DraftTrainer

    target, rows = make_tiny_target("llama"), tokenized_rows(16)

    def trainer(seed, data_seed):
        args = make_args(tmp_path / f"{seed}-{data_seed}", seed=seed, data_seed=data_seed)
        return DraftTrainer(args=args, train_dataset=rows, target_model=target)

    def data_order(t):
        return [batch["input_ids"].tolist() for batch in t.get_train_dataloader()]

    def anchor_draws(t):
        return torch.randint(0, 1000, (8,), generator=t._anchor_generator()).tolist()

    base, other_seed, other_data = trainer(1, 5), trainer(2, 5), trainer(1, 6)
    assert data_order(base) == data_order(other_seed) != data_order(other_data)
    assert anchor_draws(base) == anchor_draws(other_seed) != anchor_draws(other_data)
    first, second, third = (trainable_state(t.model) for t in (base, other_seed, other_data))
    assert all(first[name].equal(third[name]) for name in first)
    assert not all(first[name].equal(second[name]) for name in first)


def test_resuming_from_a_missing_folder_says_so(tmp_path):
    from hf_dspark.training.checkpoints import resolve_resume_checkpoint

    with pytest.raises(FileNotFoundError, match="checkpoint-3: it does not exist"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-3"), tmp_path)
    assert resolve_resume_checkpoint(None, tmp_path) is None and resolve_resume_checkpoint(False, tmp_path) is None
