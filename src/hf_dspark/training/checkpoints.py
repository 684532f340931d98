"""Which checkpoint a run resumes from: never one whose writing was interrupted.

`Trainer` (transformers 5.17 to 5.24) writes `checkpoint-N` in place: weights, then optimizer, scheduler and RNG
state, then `trainer_state.json` last, each with a plain open/write. `get_last_checkpoint` returns the
highest-numbered `checkpoint-*` folder whatever it holds, and on resume a missing optimizer, scheduler or RNG
file is skipped with an info log. So a run killed while saving leaves a folder that a plain resume either
crashes on or, worse, silently resumes from with a fresh optimizer. Here a checkpoint counts as complete only
when its `trainer_state.json` (written last) reads back for the folder's own step, its weights, optimizer and
scheduler state are there, and no safetensors or torch.save file in it is cut off.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "adapter_model.safetensors", "adapter_model.bin",
)  # fmt: skip


def checkpoint_problem(folder: str | os.PathLike, needs_optimizer: bool = True) -> str | None:
    """Why `folder` cannot be resumed from (an interrupted or foreign save), or None when it is complete.

    `needs_optimizer=False` accepts checkpoints written with `save_only_model=True` (weights and state only).
    """
    folder = Path(folder)
    if not folder.exists():
        return "it does not exist"
    if not folder.is_dir():
        return "it is not a folder"
    match = _CHECKPOINT_RE.match(folder.name)
    state_file = folder / "trainer_state.json"
    if not state_file.is_file():
        return "it has no trainer_state.json (Trainer writes it last, so the save did not finish)"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"its trainer_state.json does not parse ({err}): the save was cut off"
    if match and state.get("global_step") != int(match.group(1)):
        return f"its trainer_state.json is for step {state.get('global_step')}, not {match.group(1)}"
    names = set(os.listdir(folder))
    deepspeed = any(name.startswith("global_step") and (folder / name).is_dir() for name in names)
    fsdp = any(name.startswith("pytorch_model_fsdp") for name in names)
    if not (deepspeed or fsdp) and not names.intersection(_WEIGHT_FILES):
        return "it has no model weights"
    if needs_optimizer:
        has_optimizer = (
            deepspeed
            or names.intersection({"optimizer.pt", "optimizer.bin"})
            or any("optimizer" in name and (folder / name).is_dir() for name in names)
        )
        if not has_optimizer:
            return "it has no optimizer state"
        if "scheduler.pt" not in names:
            return "it has no scheduler state"
    for name in sorted(names):
        problem = _truncated(folder / name)
        if problem:
            return f"{name} {problem}"
    return None


def _truncated(path: Path) -> str | None:
    """A reason when a safetensors or torch.save file ends before its own header says it should."""
    if not path.is_file():
        return None
    if path.suffix == ".safetensors":
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "is cut off (no safetensors header)"
            (header_len,) = struct.unpack("<Q", head)
            if 8 + header_len > size:
                return "is cut off inside its safetensors header"
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return "has an unreadable safetensors header"
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if size < 8 + header_len + end:
            return f"is cut off ({size} of {8 + header_len + end} bytes)"
    elif path.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(path):
        # torch.save writes a zip archive whose directory sits at the end: a cut-off file has none.
        return "is cut off (no zip directory at its end)"
    return None


def checkpoints_newest_first(output_dir: str | os.PathLike) -> list[Path]:
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT_RE.match(p.name).group(1)), reverse=True)


def last_complete_checkpoint(output_dir: str | os.PathLike, needs_optimizer: bool = True) -> str | None:
    """The newest complete `checkpoint-*` folder in `output_dir` (None if there is none); newer folders whose
    save was interrupted are skipped with a warning naming them."""
    for folder in checkpoints_newest_first(output_dir):
        problem = checkpoint_problem(folder, needs_optimizer=needs_optimizer)
        if problem is None:
            return str(folder)
        logger.warning(f"skipping {folder}: {problem}; resuming from an older checkpoint")
    return None


def resolve_resume_checkpoint(
    resume: str | bool | None, output_dir: str | os.PathLike, needs_optimizer: bool = True
) -> str | None:
    """What `Trainer.train(resume_from_checkpoint=...)` should load.

    True (or the command-line strings "true" / "latest") is the newest complete checkpoint in `output_dir`; an
    explicit folder must be complete. Both raise a ValueError that names the fix.
    """
    if resume is None or resume is False:
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "latest")):
        found = last_complete_checkpoint(output_dir, needs_optimizer=needs_optimizer)
        if found is None:
            incomplete = [p.name for p in checkpoints_newest_first(output_dir)]
            detail = f" (only incomplete ones: {', '.join(incomplete)})" if incomplete else ""
            raise ValueError(
                f"resume_from_checkpoint={resume}: there is no complete checkpoint-* folder in {output_dir} to "
                f"resume from{detail}; drop the flag to start a new run"
            )
        return found
    problem = checkpoint_problem(resume, needs_optimizer=needs_optimizer)
    if problem == "it does not exist":
        raise FileNotFoundError(f"cannot resume from {resume}: it does not exist (check the path)")
    if problem is not None:
        raise ValueError(
            f"cannot resume from {resume}: {problem}. Its save was interrupted or it is not a Trainer checkpoint: "
            "pass an older checkpoint-* folder, or `--resume_from_checkpoint true` to take the newest complete one "
            "(and delete the broken folder)"
        )
    return str(resume)


__all__ = ["checkpoint_problem", "last_complete_checkpoint", "resolve_resume_checkpoint"]
