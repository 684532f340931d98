"""`hf-dspark card | export | import | push`: thin wrappers over hf_dspark.hub."""

from __future__ import annotations

import sys


def _card_inputs(parser) -> None:
    parser.add_argument("--eval_results", default=None, help="evaluation JSON (`hf-dspark eval` results.json)")
    parser.add_argument("--training_args", default=None, help="training arguments as JSON, or Trainer's training_args.bin")
    parser.add_argument("--base_model", default=None, help="Hub id of the target (default: from the draft config)")
    parser.add_argument("--license", default=None, help="licence id for the card metadata (default: the target's, if known)")
    parser.add_argument("--datasets", nargs="*", default=None, help="Hub ids of the training datasets")
    parser.add_argument("--tags", nargs="*", default=None, help="extra tags")


def _card_kwargs(args) -> dict:
    return {
        "training_args": args.training_args,
        "eval_results": args.eval_results,
        "base_model": args.base_model,
        "license": args.license,
        "datasets": args.datasets,
        "tags": args.tags,
    }


def register(subparsers) -> None:
    from .formats import FORMATS

    card = subparsers.add_parser(
        "card",
        help="write the model card (README.md) of a saved draft",
        description="Fill model_cards/draft_card.md.jinja from the draft config, training arguments and evaluation "
        "JSON; writes DIR/README.md (and assets/acceptance_by_position.png when per-position rates are given).",
    )
    card.add_argument("--draft", required=True, help="saved draft folder")
    card.add_argument("--repo_id", default=None, help="name shown in the usage snippet (default: the folder)")
    _card_inputs(card)
    card.set_defaults(func=run_card)

    export = subparsers.add_parser(
        "export",
        help="write a draft in vLLM / SGLang / speculators / DeepSpec layout",
        description="Convert a draft for another engine. Every key the engine loads is checked; a draft the "
        "format cannot represent is refused with the reason. The output folder's README.md states the "
        "target-layer index convention and the serve command.",
    )
    export.add_argument("--draft", required=True, help="draft folder or Hub id (hf_dspark or an importable layout)")
    export.add_argument("--format", required=True, choices=tuple(FORMATS))
    export.add_argument("--output_dir", required=True)
    export.add_argument("--dtype", default=None, help="cast weights (bf16, fp16, fp32); default keeps them")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output_dir")
    export.add_argument("--num_speculative_tokens", type=int, default=None, help="default: the draft's block / TTT length")
    export.add_argument("--verifier", default=None, help="speculators: Hub id of the target model")
    export.set_defaults(func=run_export)

    imp = subparsers.add_parser(
        "import",
        help="convert a DeepSpec / vLLM / SGLang / speculators draft into an hf_dspark draft folder",
        description="Load a draft checkpoint written by another tool (local folder or Hub id) and save it with "
        "save_pretrained.",
    )
    imp.add_argument("--checkpoint", required=True, help="folder or Hub id")
    imp.add_argument("--output_dir", required=True)
    imp.add_argument("--target", default=None, help="target model folder/Hub id, when the checkpoint omits embeddings/lm_head")
    imp.add_argument("--dtype", default=None, help="cast weights (bf16, fp16, fp32)")
    imp.set_defaults(func=run_import)

    push = subparsers.add_parser(
        "push",
        help="upload a draft (weights, config, card, eval results) or a target cache to the Hub",
        description="Drafts: one commit with the weights, config, a model card, eval_results.json and its plot, and "
        "the remote-code shim. Target caches (--cache): a datasets dataset plus the cache manifest.",
    )
    source = push.add_mutually_exclusive_group(required=True)
    source.add_argument("--draft", default=None, help="saved draft folder")
    source.add_argument("--cache", default=None, help="target cache folder (hf-dspark build-cache output)")
    push.add_argument("--repo_id", required=True)
    push.add_argument("--private", action="store_true")
    push.add_argument("--token", default=None, help="default: HF_TOKEN or the stored login")
    push.add_argument("--revision", default=None, help="branch to push to")
    push.add_argument("--commit_message", default=None)
    push.add_argument("--no_card", action="store_true", help="keep the folder's own README.md instead of generating one")
    push.add_argument("--no_remote_code", action="store_true", help="do not add the auto_map remote-code shim")
    _card_inputs(push)
    push.set_defaults(func=run_push)


def run_card(args) -> int:
    from .cards import write_model_card

    path = write_model_card(args.draft, repo_id=args.repo_id, **_card_kwargs(args))
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
            **_card_kwargs(args),
        )
    print(f"pushed: {getattr(info, 'commit_url', info)}")
    return 0


__all__ = ["register"]
