"""`hf-dspark card | export | import | push`: thin wrappers over hf_dspark.hub."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..cli_args import add_command, field

# The names of hub.formats.FORMATS, spelled out so that `--help` imports no torch (a test keeps them equal).
EXPORT_FORMATS = ("vllm", "sglang", "speculators", "deepspec", "dflash")


@dataclass
class CardInputs:
    """What a model card is filled from (shared by `card` and `push`)."""

    eval_results: str | None = field(None, help="evaluation JSON (`hf-dspark eval` results.json)")
    training_args: str | None = field(None, help="training arguments as JSON, or Trainer's training_args.bin")
    base_model: str | None = field(None, help="Hub id of the target (default: from the draft config)")
    license: str | None = field(None, help="licence id for the card metadata (default: the target's, if known)")
    datasets: list[str] | None = field(None, help="Hub ids of the training datasets")
    tags: list[str] | None = field(None, help="extra tags")

    def card_kwargs(self) -> dict:
        return {
            "training_args": self.training_args,
            "eval_results": self.eval_results,
            "base_model": self.base_model,
            "license": self.license,
            "datasets": self.datasets,
            "tags": self.tags,
        }


@dataclass
class CardArguments(CardInputs):
    draft: str = field(None, help="saved draft folder (required)")
    repo_id: str | None = field(None, help="name shown in the usage snippet (default: the folder)")

    def __post_init__(self):
        if not self.draft:
            raise ValueError("--draft FOLDER is required")


@dataclass
class ExportArguments:
    draft: str = field(help="draft folder or Hub id (hf_dspark or an importable layout)")
    format: str = field(help="target layout", choices=EXPORT_FORMATS)
    output_dir: str = field(help="folder to write")
    dtype: str | None = field(None, help="cast the draft's weights (bf16, fp16, fp32); default keeps them")
    overwrite: bool = field(False, help="replace a non-empty output_dir")
    num_speculative_tokens: int | None = field(None, help="default: the draft's block / TTT length")
    verifier: str | None = field(None, help="speculators: Hub id of the target model")


@dataclass
class ImportArguments:
    checkpoint: str = field(help="folder or Hub id of the foreign draft checkpoint")
    output_dir: str = field(help="folder for the hf_dspark draft")
    target: str | None = field(None, help="target model folder, when the checkpoint omits embeddings/lm_head")
    dtype: str | None = field(None, help="cast the draft's weights (bf16, fp16, fp32)")


@dataclass
class PushArguments(CardInputs):
    repo_id: str = field(None, help="Hub repository (required)")
    draft: str | None = field(None, help="saved draft folder (or --cache)")
    cache: str | None = field(None, help="target cache folder (hf-dspark build-cache output; or --draft)")
    private: bool = field(False, help="create the repository private")
    token: str | None = field(None, help="default: HF_TOKEN or the stored login")
    revision: str | None = field(None, help="branch to push to")
    commit_message: str | None = field(None, help="commit message")
    no_card: bool = field(False, help="keep the folder's own README.md instead of generating one")
    no_remote_code: bool = field(False, help="do not add the auto_map remote-code shim")

    def __post_init__(self):
        if not self.repo_id:
            raise ValueError("--repo_id is required")
        if (self.draft is None) == (self.cache is None):
            raise ValueError("give exactly one of --draft FOLDER and --cache FOLDER")


def register(subparsers) -> None:
    add_command(
        subparsers, "card", CardArguments, run_card,
        help="write the model card (README.md) of a saved draft",
        description="Fill model_cards/draft_card.md.jinja from the draft config, training arguments and evaluation "
        "JSON; writes DIR/README.md (and assets/acceptance_by_position.png when per-position rates are given).",
    )  # fmt: skip
    add_command(
        subparsers, "export", ExportArguments, run_export,
        help="write a draft in vLLM / SGLang / speculators / DeepSpec layout",
        description="Convert a draft for another engine. Every key the engine loads is checked; a draft the "
        "format cannot represent is refused with the reason. The output folder's README.md states the "
        "target-layer index convention and the serve command.",
    )  # fmt: skip
    add_command(
        subparsers, "import", ImportArguments, run_import,
        help="convert a DeepSpec / vLLM / SGLang / speculators draft into an hf_dspark draft folder",
        description="Load a draft checkpoint written by another tool (local folder or Hub id) and save it with "
        "save_pretrained.",
    )  # fmt: skip
    add_command(
        subparsers, "push", PushArguments, run_push,
        help="upload a draft (weights, config, card, eval results) or a target cache to the Hub",
        description="Drafts: one commit with the weights, config, a model card, eval_results.json and its plot, and "
        "the remote-code shim. Target caches (--cache): a datasets dataset plus the cache manifest.",
    )  # fmt: skip


def run_card(args) -> int:
    from .cards import write_model_card

    path = write_model_card(args.draft, repo_id=args.repo_id, **args.card_kwargs())
    print(f"wrote {path}")
    return 0


def _refused(err: Exception) -> int:
    print(f"hf-dspark: error: {err}", file=sys.stderr)
    return 2


def run_export(args) -> int:
    from .convert import export_draft
    from .formats import ExportError, ForeignCheckpointError

    options = {}
    if args.num_speculative_tokens is not None:
        options["num_speculative_tokens"] = args.num_speculative_tokens
    if args.verifier is not None:
        options["verifier"] = args.verifier
    try:
        result = export_draft(
            args.draft, args.format, args.output_dir, dtype=args.dtype, overwrite=args.overwrite, **options
        )
    except (ExportError, ForeignCheckpointError, FileExistsError) as err:
        return _refused(err)
    print(f"wrote {result.output_dir} ({result.format}: {result.architecture})")
    print(f"target-layer ids: {result.layer_id_convention}")
    if result.serve_command:
        print(f"serve: {result.serve_command}")
    return 0


def run_import(args) -> int:
    from .convert import load_draft
    from .formats import ForeignCheckpointError

    try:
        draft = load_draft(args.checkpoint, target=args.target, **({"dtype": args.dtype} if args.dtype else {}))
    except (ForeignCheckpointError, ValueError) as err:
        return _refused(err)
    draft.save_pretrained(args.output_dir)
    print(f"wrote {args.output_dir} ({draft.config.model_type} draft)")
    return 0


def run_push(args) -> int:
    if args.cache:
        from .push import push_target_cache

        info = push_target_cache(
            args.cache, args.repo_id, private=args.private or None, token=args.token, revision=args.revision,
            commit_message=args.commit_message,
        )
    else:
        from .push import push_draft

        info = push_draft(
            args.draft, args.repo_id, private=args.private or None, token=args.token, revision=args.revision,
            commit_message=args.commit_message, card=not args.no_card, remote_code=not args.no_remote_code,
            **args.card_kwargs(),
        )
    print(f"pushed: {getattr(info, 'commit_url', info)}")
    return 0


__all__ = ["register"]
