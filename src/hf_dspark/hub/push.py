"""Publishing drafts and target caches on the Hub.

`push_draft(draft_or_dir, repo_id)` uploads, in one commit: the weights and config (as `save_pretrained` writes
them), a model card (cards.py), the evaluation JSON and its acceptance plot when given, and a small
remote-code shim. `push_target_cache(cache_dir, repo_id)` publishes a target cache as a `datasets` dataset.

Remote code. The draft classes live in the `hf_dspark` package, whose modules import each other with nested
relative imports (`from ..backbone import ...`, `from ...sampling import ...`); transformers' dynamic
module loader only resolves same-folder `from .x import` files, so the package cannot be shipped as is, and a
flattened copy generated at push time would fork the code (fixes would never reach published drafts) while
still being useless without the package: `generate(assistant_model=draft)` needs hf_dspark's decoding loop.
So the repo gets `hf_dspark_remote.py`, which subclasses the installed package's classes, plus an `auto_map`
in config.json: `AutoModel.from_pretrained(repo, trust_remote_code=True)` works wherever `hf_dspark` is
installed, and where it is not, transformers stops with "requires ... hf_dspark. Run `pip install hf_dspark`".
With `import hf_dspark` first, no remote code runs at all (local classes win). The card says so.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..models import DRAFTERS, DraftPreTrainedModel
from .cards import PLOT_FILE, generate_model_card, load_eval_rows, render_acceptance_plot, rows_for_drafter
from .peft_utils import refuse_attached_lora

REMOTE_CODE_FILE = "hf_dspark_remote.py"
EVAL_RESULTS_FILE = "eval_results.json"
CACHE_MANIFEST_FILE = "hf_dspark_target_cache.json"

REMOTE_CODE = '''"""Lets `AutoModel.from_pretrained(<this repo>, trust_remote_code=True)` load this hf_dspark draft.

The model code is the installed `hf_dspark` package (pip install hf_dspark); this file only subclasses its
classes so transformers can find them through config.json's auto_map. After `import hf_dspark`, AutoModel
loads the draft without remote code.
"""

from hf_dspark.models import {config_class} as _Config
from hf_dspark.models import {model_class} as _Model


class {config_class}(_Config):
    pass


class {model_class}(_Model):
    config_class = {config_class}
'''

# Files of a saved draft folder that belong in its Hub repo (Trainer outputs also hold optimizer states,
# RNG states and a pickled training_args.bin, which stay local).
_DRAFT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def stage_draft(
    draft_or_dir,
    folder: str | os.PathLike,
    *,
    card: bool = True,
    eval_results=None,
    training_args=None,
    remote_code: bool = True,
    repo_id: str | None = None,
    max_shard_size: int | str | None = None,
    **card_kwargs,
) -> Path:
    """Write everything a draft's Hub repo holds into `folder` (an empty directory); returns the folder.

    draft_or_dir: a draft model or a saved draft folder (copied byte for byte: only config, generation config
    and safetensors files). card: write a fresh README.md model card (False: keep the folder's own README.md,
    if any). eval_results: the evaluation JSON (path, dict or rows): copied as eval_results.json, plotted into
    assets/, tabulated in the card. remote_code: add the hf_dspark_remote.py shim and config.json's auto_map.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty: stage_draft writes into an empty folder")
    if isinstance(draft_or_dir, DraftPreTrainedModel):
        refuse_attached_lora(draft_or_dir, "publish it")
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
        draft_or_dir.save_pretrained(folder, **kwargs)
        source = None
    else:
        source = Path(draft_or_dir)
        config_file = source / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{source} has no config.json: pass a folder written by draft.save_pretrained")
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
        if model_type not in DRAFTERS:
            raise ValueError(
                f"{source} holds a {model_type!r} model, not an hf_dspark draft; convert foreign checkpoints first: "
                "hf_dspark.hub.load_draft(path).save_pretrained(dir)"
            )
        weights = sorted(source.glob("*.safetensors"))
        if not weights:
            raise FileNotFoundError(f"{source} has no .safetensors weights: save the draft with save_pretrained")
        for file in [source / name for name in _DRAFT_FILES] + weights:
            if file.exists():
                shutil.copy2(file, folder / file.name)
        if not card and (source / "README.md").exists():
            shutil.copy2(source / "README.md", folder / "README.md")
            if (source / "assets").is_dir():
                shutil.copytree(source / "assets", folder / "assets")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    model_type = config["model_type"]

    if eval_results is not None:
        rows, _ = load_eval_rows(eval_results)
        data = eval_results
        if isinstance(eval_results, (str, os.PathLike)):
            data = json.loads(Path(eval_results).read_text(encoding="utf-8"))
        (folder / EVAL_RESULTS_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        mine = rows_for_drafter(rows, model_type)
        if card is False and any(r.get("accept_rate_by_position") for r in mine):
            render_acceptance_plot(mine, folder / PLOT_FILE, f"{model_type} draft: acceptance by position")

    if remote_code:
        spec = DRAFTERS[model_type]
        config_class, model_class = spec.config_class.__name__, spec.model_class.__name__
        (folder / REMOTE_CODE_FILE).write_text(
            REMOTE_CODE.format(config_class=config_class, model_class=model_class), encoding="utf-8"
        )
        module = REMOTE_CODE_FILE.removesuffix(".py")
        config["auto_map"] = {"AutoConfig": f"{module}.{config_class}", "AutoModel": f"{module}.{model_class}"}
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    if card:
        text = generate_model_card(
            folder,
            training_args=training_args,
            eval_results=eval_results,
            repo_id=repo_id,
            remote_code=REMOTE_CODE_FILE if remote_code else None,
            **card_kwargs,
        )
        (folder / "README.md").write_text(text, encoding="utf-8")
    return folder


def push_draft(
    draft_or_dir,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    create_pr: bool = False,
    card: bool = True,
    eval_results=None,
    training_args=None,
    remote_code: bool = True,
    max_shard_size: int | str | None = None,
    tags: list[str] | None = None,
    **card_kwargs,
):
    """Create (or reuse) the model repo `repo_id` and upload the draft, its card, eval JSON/plot and shim.

    Accepts the arguments of `PreTrainedModel.push_to_hub` (commit_message, private, token, revision,
    create_pr, max_shard_size, tags) plus card inputs (training_args, eval_results, base_model, license,
    datasets). Returns the `CommitInfo` of the upload.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="hf_dspark-push-") as tmp:
        # Stage first: a bad folder or eval file fails before anything is created on the Hub.
        stage_draft(
            draft_or_dir,
            tmp,
            card=card,
            eval_results=eval_results,
            training_args=training_args,
            remote_code=remote_code,
            repo_id=repo_id,
            max_shard_size=max_shard_size,
            tags=tags,
            **card_kwargs,
        )
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            commit_message=commit_message or "Upload hf_dspark draft",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


def push_target_cache(
    cache_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    max_shard_size: int | str | None = "500MB",
    verify: str = "full",
):
    """Publish a target cache as a Hub dataset: its rows through `datasets`' `push_to_hub` (Parquet shards) and
    its manifest as `hf_dspark_target_cache.json`, which records how the columns are encoded (bf16 stored as
    uint16 bit patterns, fp8 scales, ...) and which target/layers produced them.

    The cache is checked first (`load_target_cache(verify="full")` by default): an incomplete or corrupt cache
    is never published. Returns the `CommitInfo` of the manifest upload (the last commit).
    """
    from huggingface_hub import HfApi

    from ..data import load_target_cache

    cache = load_target_cache(cache_dir, verify=verify)
    cache.hf_dataset.push_to_hub(
        repo_id,
        private=private,
        token=token,
        revision=revision,
        commit_message=commit_message or "Upload hf_dspark target cache",
        max_shard_size=max_shard_size,
    )
    manifest = json.dumps(cache.metadata, indent=2, sort_keys=True).encode()
    return HfApi(token=token).upload_file(
        path_or_fileobj=manifest,
        path_in_repo=CACHE_MANIFEST_FILE,
        repo_id=repo_id,
        repo_type="dataset",
        revision=revision,
        commit_message="Add hf_dspark target-cache manifest",
    )


__all__ = ["push_draft", "push_target_cache", "stage_draft", "REMOTE_CODE_FILE", "EVAL_RESULTS_FILE"]
