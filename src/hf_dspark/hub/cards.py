"""Model cards for drafts: YAML metadata the Hub accepts, τ table, acceptance plot, usage and serving sections.

`generate_model_card(draft_or_dir, training_args=None, eval_results=None, plot_path=None)` fills
`model_cards/draft_card.md.jinja` and returns the card text; `write_model_card(draft_dir, ...)` writes it to
`DIR/README.md` (what `hf-dspark card --draft DIR` does).

Metadata choices:
- `library_name: transformers`. A published draft is a plain `save_pretrained` folder (config.json +
  safetensors) that `AutoModel.from_pretrained` loads once `hf_dspark` is imported (or with
  `trust_remote_code=True` through the shim `push_draft` adds), so the Hub's transformers snippet and download
  counting apply; `hf_dspark` is added as a tag and the card says `pip install hf_dspark`.
- `base_model` = the target, only when it is a Hub id (the Hub rejects anything else); the default target
  (recorded as "SmolLM2-135M-Instruct") maps to its Hub id. Pass `base_model=` for others.
- `pipeline_tag: text-generation`, tags `speculative-decoding`, `draft-model`, the drafter name, `hf_dspark`.
- `license`: given, else the known target's licence, else "other" (a draft contains copies of the target's
  embeddings and lm_head, so the target's licence applies; the training data may add terms).
The YAML is produced by `huggingface_hub.ModelCardData` and parsed back with `ModelCard` (no network) before the
card is returned.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

from ..models import DRAFTERS, DraftConfig, DraftPreTrainedModel
from .formats.base import known_target, target_for_commands, target_hub_id

CARD_TEMPLATE = "draft_card.md.jinja"
PLOT_FILE = "assets/acceptance_by_position.png"
PIPELINE_TAG = "text-generation"
LIBRARY_NAME = "transformers"

# Training settings worth a row in the card, in display order.
_TRAINING_KEYS = (
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "warmup_ratio",
    "warmup_steps",
    "weight_decay",
    "lr_scheduler_type",
    "max_grad_norm",
    "max_length",
    "bf16",
    "fp16",
    "seed",
)
_DATA_KEYS = ("train_file", "dataset_name", "train_dataset", "dataset", "data_files", "cache_dir", "target_cache")


# -- inputs -------------------------------------------------------------------------------------------------


def _load_config(draft_or_dir) -> tuple[DraftConfig, Path | None, DraftPreTrainedModel | None]:
    if isinstance(draft_or_dir, DraftPreTrainedModel):
        return draft_or_dir.config, None, draft_or_dir
    if isinstance(draft_or_dir, DraftConfig):
        return draft_or_dir, None, None
    folder = Path(draft_or_dir)
    file = folder / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{folder} has no config.json: pass a saved draft folder (save_pretrained output)")
    raw = json.loads(file.read_text(encoding="utf-8"))
    model_type = raw.get("model_type")
    if model_type not in DRAFTERS:
        raise ValueError(
            f"{folder} holds a {model_type!r} model, not an hf_dspark draft ({', '.join(DRAFTERS)}); convert foreign "
            "checkpoints first (hf_dspark.hub.load_draft(path).save_pretrained(dir))"
        )
    return DRAFTERS[model_type].config_class.from_pretrained(folder), folder, None


def _parameter_counts(folder: Path | None, model: DraftPreTrainedModel | None):
    """(trained, frozen) parameter counts; from the model, or from safetensors headers (no weights loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtype = None
    if model is not None:
        seen = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            shapes[name] = tuple(p.shape)
            dtype = dtype or str(p.dtype).removeprefix("torch.")
    elif folder is not None:
        from safetensors import safe_open

        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    shapes[key] = tuple(piece.get_shape())
                    stored = piece.get_dtype()
                    dtype = dtype or {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(stored, stored)
    if not shapes:
        return "unknown", "unknown", "unknown"
    frozen_names = {"embed_tokens.weight", "lm_head.weight"}
    frozen = sum(math.prod(s) for k, s in shapes.items() if k in frozen_names)  # tied lm_head: counted once
    trained = sum(math.prod(s) for k, s in shapes.items() if k not in frozen_names)
    return _human(trained), _human(frozen), dtype or "unknown"


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _as_dict(training_args) -> dict[str, Any]:
    """Training arguments from a TrainingArguments/dataclass, a dict, or a JSON (or torch-saved .bin) file."""
    if training_args is None:
        return {}
    if isinstance(training_args, (str, os.PathLike)):
        path = Path(training_args)
        if path.suffix == ".bin":
            import torch

            # training_args.bin is a pickle written by Trainer: only load files you produced yourself.
            training_args = torch.load(path, weights_only=False)
        else:
            training_args = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(training_args, dict):
        return dict(training_args)
    if hasattr(training_args, "to_dict"):
        return training_args.to_dict()
    if dataclasses.is_dataclass(training_args):
        return dataclasses.asdict(training_args)
    raise TypeError(
        f"training_args must be TrainingArguments, a dict or a JSON path, got {type(training_args).__name__}"
    )


def load_eval_rows(eval_results) -> tuple[list[dict], str | None]:
    """Evaluation rows from the `hf-dspark eval` JSON ({"results": [...], ...}), a list of rows, or a path."""
    if eval_results is None:
        return [], None
    source = None
    if isinstance(eval_results, (str, os.PathLike)):
        source = Path(eval_results).name
        eval_results = json.loads(Path(eval_results).read_text(encoding="utf-8"))
    if isinstance(eval_results, dict):
        if "target" in eval_results and source:
            hardware = eval_results.get("hardware", "unknown hardware")
            source = f"`{source}` (target `{eval_results['target']}`, {hardware})"
        eval_results = eval_results.get("results", eval_results.get("rows"))
    if not isinstance(eval_results, list) or not all(isinstance(r, dict) for r in eval_results):
        raise ValueError(
            "eval_results must be the evaluation JSON ({'results': [rows]}), a list of rows, or a path to it; rows "
            "are {drafter, dataset, temperature, tau, accept_rate_by_position, tokens_per_s, speedup}"
        )
    for row in eval_results:
        missing = [k for k in ("dataset", "tau") if k not in row]
        if missing:
            raise ValueError(f"evaluation row {row} lacks {', '.join(missing)}")
    return eval_results, source


def rows_for_drafter(rows: list[dict], drafter: str) -> list[dict]:
    """The rows about this drafter (rows without a `drafter` field are kept)."""
    if not rows:
        return rows
    mine = [r for r in rows if r.get("drafter", drafter) == drafter]
    if not mine:
        found = sorted({str(r.get("drafter")) for r in rows})
        raise ValueError(f"the evaluation results hold drafters {found}, none of them {drafter!r} (this draft)")
    return mine


# -- plot ---------------------------------------------------------------------------------------------------


def render_acceptance_plot(rows: list[dict], path: str | os.PathLike, title: str) -> Path:
    """The evaluation report's acceptance-by-position plot (one panel per dataset) for one drafter's rows.

    Lines are labelled by temperature, so rows of several temperatures share the panels.
    """
    from ..evaluation.plots import plot_acceptance_by_position

    def rate(value):
        return float("nan") if value is None else float(value)

    lines = [
        {
            "dataset": r["dataset"],
            "drafter": f"T={_fmt(r.get('temperature'), 1)}",
            "tau": rate(r.get("tau")),
            "accept_rate_by_position": [rate(v) for v in r["accept_rate_by_position"]],
        }
        for r in rows
        if r.get("accept_rate_by_position")
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return plot_acceptance_by_position(lines, path, title=title)


# -- card ---------------------------------------------------------------------------------------------------


def card_metadata(
    config: DraftConfig,
    *,
    base_model: str | None = None,
    license: str | None = None,
    datasets: Iterable[str] | None = None,
    tags: Iterable[str] | None = None,
):
    """`ModelCardData` for a draft (see the module docstring for the choices)."""
    from huggingface_hub import ModelCardData

    base_model = base_model or target_hub_id(config.target_name_or_path)
    if license is None:
        known = known_target(config.target_name_or_path)
        license = known[1] if known else "other"
    all_tags = ["hf_dspark", "speculative-decoding", "draft-model", config.model_type, *(tags or [])]
    return ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=base_model,
        license=license,
        pipeline_tag=PIPELINE_TAG,
        tags=list(dict.fromkeys(all_tags)),
        datasets=list(datasets) if datasets else None,
    )


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _accept_cells(rates, positions: int) -> list[str]:
    rates = list(rates or [])
    return [_fmt(rates[k] if k < len(rates) else None) for k in range(positions)]


def _serve_sections(config: DraftConfig, draft, repo_id: str):
    """(supported, refused) export formats with the serve command or the reason."""
    from .convert import unlisted_format_reason
    from .formats import FORMATS

    probe = draft if draft is not None else _ConfigOnly(config)
    supported, refused = [], []
    for name, fmt in FORMATS.items():
        reason = unlisted_format_reason(fmt, config) or fmt.why_not(probe)
        if name == "speculators" and reason is None and not target_hub_id(config.target_name_or_path):
            reason = "needs the target's Hub id: pass --verifier org/name to the export"
        if reason is not None:
            refused.append({"name": name, "reason": reason})
            continue
        out = f"{repo_id.rstrip('/').split('/')[-1]}-{name}"
        supported.append(
            {"name": name, "consumer": fmt.consumer, "output_dir": out, "command": _serve_command(name, config, out)}
        )
    return supported, refused


def _serve_command(name: str, config: DraftConfig, out: str) -> str:
    from .formats.vllm import vllm_serve_command

    target = target_for_commands(config)
    tokens = config.num_draft_tokens
    if name == "vllm":
        method = "eagle3" if config.model_type == "eagle3" else "dspark"
        return vllm_serve_command(target, method, out, tokens)
    if name == "sglang":
        return (
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {out} --speculative-num-steps {tokens} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {tokens + 1}"
        )
    if name == "speculators":
        return f"vllm serve {out}"
    return f"python eval.py --draft_name_or_path {out}  # in a DeepSpec checkout"


class _ConfigOnly:
    """Stands in for a draft when only its config is at hand (the format checks read the config only)."""

    def __init__(self, config):
        self.config = config


def generate_model_card(
    draft_or_dir,
    training_args=None,
    eval_results=None,
    plot_path: str | os.PathLike | None = None,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    datasets: Iterable[str] | None = None,
    tags: Iterable[str] | None = None,
    remote_code: str | None = None,
) -> str:
    """The model card (README.md text) of a draft.

    draft_or_dir: a draft model, a draft config, or a saved draft folder. training_args: TrainingArguments, a
    dict, or a JSON / training_args.bin path. eval_results: the evaluation JSON (path, dict with "results", or a
    list of rows {drafter, dataset, temperature, tau, accept_rate_by_position, tokens_per_s, speedup}); rows
    of other drafters are left out. plot_path: where to render the acceptance plot (default, when a folder is
    given and rows have per-position rates: DIR/assets/acceptance_by_position.png); the card links it relative
    to the folder. repo_id: the name used in the usage snippet (default: the folder path).
    """
    from huggingface_hub import ModelCard

    config, folder, model = _load_config(draft_or_dir)
    drafter = DRAFTERS[config.model_type]
    rows, source = load_eval_rows(eval_results)
    rows = rows_for_drafter(rows, config.model_type)
    args = _as_dict(training_args)
    repo_id = repo_id or (str(folder) if folder is not None else "path/to/draft")

    plot_file = None
    if rows and any(r.get("accept_rate_by_position") for r in rows):
        if plot_path is None and folder is not None:
            plot_path = folder / PLOT_FILE
        if plot_path is not None:
            title = f"{drafter.display_name} draft: acceptance by position"
            plot_path = render_acceptance_plot(rows, plot_path, title)
            plot_file = os.path.relpath(plot_path, folder) if folder is not None else Path(plot_path).name
            plot_file = Path(plot_file).as_posix()

    positions = max((len(r.get("accept_rate_by_position") or []) for r in rows), default=0)
    eval_rows = [
        {
            "dataset": r.get("dataset"),
            "temperature": _fmt(r.get("temperature"), 1),
            "tau": _fmt(r.get("tau")),
            "accept": _accept_cells(r.get("accept_rate_by_position"), positions),
            "tokens_per_s": _fmt(r.get("tokens_per_s"), 1),
            "speedup": _fmt(r.get("speedup")) + ("x" if r.get("speedup") is not None else ""),
        }
        for r in rows
    ]

    if datasets is None:
        datasets = [v for k in _DATA_KEYS if isinstance(v := args.get(k), str) and target_hub_id(v) == v] or None
    metadata = card_metadata(config, base_model=base_model, license=license, datasets=datasets, tags=tags)
    target_name = target_hub_id(config.target_name_or_path) or config.target_name_or_path or "the target model"
    target_link = (
        f"[`{target_name}`](https://huggingface.co/{target_name})"
        if target_hub_id(target_name)
        else f"`{target_name}`"
    )
    trained, frozen, dtype = _parameter_counts(folder, model)
    supported, refused = _serve_sections(config, model, repo_id)
    training_data = "; ".join(f"{k} = `{args[k]}`" for k in _DATA_KEYS if args.get(k)) or None
    training_rows = [(k, f"{args[k]:g}" if isinstance(args[k], float) else str(args[k]))
                     for k in _TRAINING_KEYS if args.get(k) not in (None, "", -1)]
    licence = metadata.license
    license_text = (
        f"`{licence}`. The draft contains copies of the target's embeddings and lm_head, so the target's licence "
        "applies; check the licences of the training data too."
        if licence != "other"
        else "Not stated: the draft contains copies of the target's embeddings and lm_head, so the target's licence "
        "applies, plus any terms of the training data."
    )
    context = {
        "card_data": metadata.to_yaml(),
        "title": f"{drafter.display_name} draft for {target_name}",
        "drafter_name": drafter.display_name,
        "drafter_article": "An" if drafter.display_name[0] in "AEIOU" else "A",
        "drafter_summary": drafter.summary,
        "target_link": target_link,
        "target_name": target_name,
        "target_model_type": config.target_model_type or "unknown type",
        "num_target_layers": config.num_target_layers or "?",
        "num_hidden_layers": config.num_hidden_layers,
        "block_label": f"{drafter.block_label} (draft tokens per round)",
        "block_size": config.num_draft_tokens,
        "target_layer_ids": list(config.target_layer_ids or []),
        "head_rows": config.card_rows(),
        "params_trainable": trained,
        "params_frozen": frozen,
        "weights_dtype": dtype,
        "eval_rows": eval_rows,
        "eval_source": source,
        "accept_positions": list(range(1, positions + 1)),
        "plot_file": plot_file,
        "repo_id": repo_id,
        "remote_code": remote_code,
        "serve_formats": supported,
        "refused_formats": refused,
        "training_data": training_data,
        "training_rows": training_rows,
        "license_text": license_text,
    }
    text = render_template(CARD_TEMPLATE, context)
    parsed = ModelCard(text, ignore_metadata_errors=False)  # raises on YAML the Hub would reject
    if parsed.data.to_dict() != metadata.to_dict():
        raise RuntimeError("the rendered card's metadata does not round-trip through huggingface_hub.ModelCard")
    return text


def write_model_card(draft_dir: str | os.PathLike, **kwargs) -> Path:
    """Write DIR/README.md (and the acceptance plot) for a saved draft folder; returns the README path."""
    text = generate_model_card(draft_dir, **kwargs)
    path = Path(draft_dir) / "README.md"
    path.write_text(text, encoding="utf-8")
    return path


# -- template -----------------------------------------------------------------------------------------------


def template_dir() -> Path:
    """Folder holding the card templates: the installed `hf_dspark.model_cards` package, else the source tree."""
    try:
        from importlib.resources import files

        installed = Path(str(files("hf_dspark.model_cards")))
        if (installed / CARD_TEMPLATE).exists():
            return installed
    except ModuleNotFoundError:
        pass
    source = Path(__file__).resolve().parents[3] / "model_cards"
    if (source / CARD_TEMPLATE).exists():
        return source
    raise FileNotFoundError(
        f"cannot find the model-card template {CARD_TEMPLATE}: reinstall hf_dspark (it ships as the package data "
        "hf_dspark.model_cards) or run from a source checkout"
    )


def render_template(name: str, context: dict) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    return env.get_template(name).render(**context)


__all__ = [
    "card_metadata",
    "generate_model_card",
    "load_eval_rows",
    "render_acceptance_plot",
    "render_template",
    "write_model_card",
]
