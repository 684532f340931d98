"""Writing an evaluation: results.json, results.md and PNG plots in one output folder.

results.json: top-level `target`, `hardware`, `command`, `settings`, `baselines` (target alone per dataset and
temperature) and `results`, one row per (drafter, dataset, temperature) with at least the keys in `ROW_KEYS`.
NaN (e.g. acceptance at a position never reached) is written as null, so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..metrics import tau_difference_interval, tau_interval
from .calibration import mean_over_slots

ROW_KEYS = ("drafter", "dataset", "temperature", "tau", "accept_rate_by_position", "tokens_per_s", "speedup")


def temperature_tag(temperature: float) -> str:
    return f"T{temperature:g}"


def _strict(value):
    """NaN/inf -> None, tuples -> lists, recursively (json.dumps would write the non-standard NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _strict(value.item())
    return value


def results_json(results) -> str:
    return json.dumps(_strict(results.to_dict()), indent=2, ensure_ascii=False)


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def _times(value) -> str:
    """A speedup: "2.10x", or "–" where there is none."""
    text = _fmt(value)
    return text + "x" if text != "–" else text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _interval(bounds) -> str:
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}" if bounds else "–"


def _step_and_fill(baseline: dict) -> str:
    step, fill = baseline.get("ms_per_longest_row_token"), baseline.get("row_fill")
    if step is None or fill is None or not (math.isfinite(step) and math.isfinite(fill)):
        return "–"
    return f"{step:.1f} / {fill:.2f}"


def _timing_notes(results) -> list[str]:
    """Bullets naming the timings that were taken twice (their first run compiled or captured a graph) and any that
    still hold such one-time work; none when every timed call was warm."""
    labelled = [(f"target alone, {b['dataset']}, T = {b['temperature']:g}", b) for b in results.baselines]
    labelled += [(f"target alone (static cache), {b['dataset']}, T = {b['temperature']:g}", b["static_cache"])
                 for b in results.baselines if b.get("static_cache")]  # fmt: skip
    labelled += [(f"{r['drafter']}, {r['dataset']}, T = {r['temperature']:g}", r) for r in results.rows]
    retimed = [f"{name} ({m['retimed_calls']})" for name, m in labelled if m.get("retimed_calls")]
    dirty = [f"{name} ({m.get('compile_s_in_timing') or 0:.1f} s compiling, {m.get('graph_captures_in_timing') or 0} "
             "graphs captured)" for name, m in labelled
             if m.get("compile_s_in_timing") or m.get("graph_captures_in_timing")]  # fmt: skip
    out = []
    if retimed:
        out.append("- timed again (the first timing compiled or captured a CUDA graph the warm-up had not reached; "
                   "the call was rerun with the same seed and its warm timing kept), calls: " + "; ".join(retimed))
    if dirty:
        out.append("- **timings that still hold one-time work** (their speed is understated): " + "; ".join(dirty))
    return out


def per_prompt_counts(row: dict | None) -> tuple[list[int], list[int]] | None:
    """A draft row's (rounds, committed tokens) per prompt, or None (no row, or a row saved without them)."""
    counts = (row or {}).get("tau_by_request")
    return (counts["rounds"], counts["committed"]) if counts else None


def _paired_differences(drafters, datasets, temperatures, lookup) -> list[str]:
    """Each drafter's mean τ against the first one's, on the same prompts: the difference and its 95% interval from
    a paired bootstrap over prompts (`metrics.tau_difference_interval`); none with a single drafter."""
    table = []
    for temp in temperatures:
        for drafter in drafters[1:]:
            pairs = []
            for d in datasets:
                a, b = lookup.get((drafter, d, temp)), lookup.get((drafters[0], d, temp))
                if per_prompt_counts(a) and per_prompt_counts(b):
                    pairs.append((per_prompt_counts(a), per_prompt_counts(b)))
            paired = tau_difference_interval(pairs) if len(pairs) == len(datasets) else None
            if paired is not None:
                lo, hi = paired["ci95"]
                verdict = "no (the interval holds 0)" if lo <= 0 <= hi else "yes"
                table.append([f"{drafter} - {drafters[0]}", f"{temp:g}", f"{paired['difference']:+.2f}",
                              f"{lo:+.2f} to {hi:+.2f}", verdict])  # fmt: skip
    if not table:
        return []
    return ["", f"## Mean tau against {drafters[0]} (paired bootstrap over the same prompts, 95%)", ""] + _table(
        ["drafters", "T", "difference in mean tau", "95% interval", "a difference?"], table
    )


def results_markdown(results) -> str:
    rows, settings = results.rows, results.settings
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    lookup = {(r["drafter"], r["dataset"], r["temperature"]): r for r in rows}
    base = {(b["dataset"], b["temperature"]): b for b in results.baselines}
    counts = ", ".join(f"{k} {v}" for k, v in settings.get("num_prompts", {}).items())
    top = []
    if settings.get("top_k"):
        top.append(f"top-k {settings['top_k']}")
    if settings.get("top_p") is not None and settings.get("top_p") < 1:
        top.append(f"top-p {settings['top_p']}")
    out = [
        "# Draft evaluation",
        "",
        f"- target: `{results.target}`; hardware: {results.hardware}; dtype {settings.get('dtype')}",
        f"- prompts: {settings.get('prompt_subset')} ({counts})",
        f"- max_new_tokens {settings.get('max_new_tokens')}, batch size {settings.get('batch_size')}, seed "
        f"{settings.get('seed')}" + (", " + ", ".join(top) if top else "") + "; temperature 0 = greedy",
        "- tau = committed tokens per verification round (accepted + 1 bonus); speedup = wall-clock tokens/s with "
        "the draft / tokens/s of the target alone on the same prompts and settings",
    ]
    if any(r.get("teacher_forced") for r in rows):
        out.append(
            "- teacher-forced rows: tau as training estimates it on the target-alone answers to the same prompts "
            "(tau_greedy at T = 0; otherwise tau_prob, which assumes sampling at T = 1 without top-k/top-p), "
            "averaged over blocks at every position; 'walked as decoding': the same blocks, rounds counted as "
            "decoding runs them (each starts where the previous one ended, so easy stretches count once, not at "
            "every position). The walked value close to the decoded tau: the decoding path delivers what the draft "
            "predicts"
        )
    if any(r.get("target_graphs") for r in rows):
        compared = (
            "the rows 'vs static target' compare with the target's own compiled static-cache decoding"
            if settings.get("static_baseline") else "--static_baseline true adds the target's own compiled "
            "static-cache decoding as a second baseline"
        )
        how = ("each whole round as one CUDA graph (dspark_fused_round; draft s is then inside verify s)"
               if all(r.get("fused_round") for r in rows) else "the target's verify forward as a CUDA graph")
        if settings.get("eager_baseline", True):
            out.append(
                f"- the drafts verified through the static path ({how}, generate()'s default on CUDA); the target "
                f"alone ran eagerly, so part of the speedup is the graphs ({compared})"
            )
    if not settings.get("eager_baseline", True):
        out.append("- the target alone ran on its static cache only (--eager_baseline false): speedups are against "
                   "that baseline, the teacher-forced rows read its answers")  # fmt: skip
    with_fill = any("row_fill" in b for b in results.baselines)  # results saved before it was measured have none
    if with_fill:
        out.append(
            "- target alone, ms a step / row fill: wall time per step of each batch's longest row, and the share of "
            "the batch's row-steps that produced a counted token (a batch steps until its longest row stops, so "
            "rows ending early lower tokens/s without making a step dearer; greedy rows that loop to the token cap "
            "often do)"
        )
    if settings.get("static_cache_len"):
        out.append(
            f"- static-cache target: one StaticCache length ({settings['static_cache_len']} tokens) for every call of "
            "the run, generate()'s compiled step warmed up once per batch shape, untimed"
        )
    if settings.get("draft_calls_rehearsed"):
        out.append("- each draft call ran once untimed before its timed run, with the same seed (a batch's first "
                   "prefill pays for one-time work: 0.82 s against 0.07 s on an H200)")  # fmt: skip
    out += _timing_notes(results)
    if settings.get("generate_kwargs"):
        out.append(f"- draft generate() options: `{json.dumps(settings['generate_kwargs'])}`")
    for name, kwargs in (settings.get("draft_generate_kwargs") or {}).items():
        out.append(f"- {name}'s generate() options: `{json.dumps(kwargs)}`")
    if results.command:
        out.append(f"- command: `{results.command}`")
    for temp in temperatures:
        out += ["", f"## tau and speedup, temperature {temp:g}", ""]
        header = ["drafter"] + [f"{d} tau" for d in datasets] + [f"{d} speedup" for d in datasets] + ["mean tau"]
        table = []
        for drafter in drafters:
            cells = [lookup.get((drafter, d, temp)) for d in datasets]
            taus = [c["tau"] for c in cells if c is not None and math.isfinite(c["tau"])]
            table.append(
                [drafter]
                + [_fmt(c["tau"]) if c else "–" for c in cells]
                + [_times(c["speedup"]) if c else "–" for c in cells]
                + [_fmt(sum(taus) / len(taus)) if taus else "–"]
            )
        if any(c and c.get("tau_ci95") for d in drafters for c in [lookup.get((d, x, temp)) for x in datasets]):
            for drafter in drafters:
                cells = [lookup.get((drafter, d, temp)) for d in datasets]
                groups = [per_prompt_counts(c) for c in cells if per_prompt_counts(c)]
                mean = tau_interval(groups) if len(groups) == len(cells) else None
                table.append(
                    [f"{drafter}, 95% interval (bootstrap over prompts)"]
                    + [_interval(c.get("tau_ci95")) if c else "–" for c in cells]
                    + ["" for _ in datasets]
                    + [_interval(mean)]
                )
        table.append(
            ["target alone, tokens/s"]
            + [_fmt(base[(d, temp)]["tokens_per_s"], 1) if (d, temp) in base else "–" for d in datasets]
            + ["" for _ in datasets]
            + [""]
        )
        if with_fill:
            table.append(
                ["target alone, ms a step / row fill"]
                + [_step_and_fill(base.get((d, temp), {})) for d in datasets]
                + ["" for _ in datasets]
                + [""]
            )
        if any("static_cache" in b for b in results.baselines):
            table.append(
                ["target alone, static cache, tokens/s"]
                + [_fmt(base[(d, temp)]["static_cache"]["tokens_per_s"], 1) if "static_cache" in base.get((d, temp), {})
                   else "–" for d in datasets]  # fmt: skip
                + ["" for _ in datasets]
                + [""]
            )
            for drafter in drafters:
                cells = [lookup.get((drafter, d, temp)) for d in datasets]
                table.append(
                    [f"{drafter} vs static target"]
                    + ["" for _ in datasets]
                    + [_times(c.get("speedup_vs_static_target")) if c else "–" for c in cells]
                    + [""]
                )
        if any(c and c.get("teacher_forced") for d in drafters for c in [lookup.get((d, x, temp)) for x in datasets]):
            for drafter in drafters:
                cells = [lookup.get((drafter, d, temp)) for d in datasets]
                kind = "greedy" if temp == 0 else "prob"
                forced = ((", teacher-forced on the target's answers", f"tau_{kind}"),
                          (", the same walked as decoding", f"tau_walk_{kind}"))  # fmt: skip
                for label, key in forced:
                    table.append(
                        [drafter + label]
                        + [_fmt(c["teacher_forced"][key]) if c and key in (c.get("teacher_forced") or {}) else "–"
                           for c in cells]
                        + ["" for _ in datasets]
                        + [""]
                    )
        out += _table(header, table)

    out += _paired_differences(drafters, datasets, temperatures, lookup)
    width = max((len(r["accept_rate_by_position"]) for r in rows), default=0)
    out += ["", "## Acceptance rate by position (conditional: slot k accepted given slots 1..k-1 accepted)", ""]
    out += _table(
        ["drafter", "dataset", "T"] + [f"@{k + 1}" for k in range(width)],
        [
            [r["drafter"], r["dataset"], f"{r['temperature']:g}"]
            + [_fmt(v) for v in r["accept_rate_by_position"]]
            + ["" for _ in range(width - len(r["accept_rate_by_position"]))]
            for r in rows
        ],
    )

    out += ["", "## Speed and verification", ""]
    out += _table(
        ["drafter", "dataset", "T", "tokens/s", "target tokens/s", "speedup", "verify efficiency", "tokens verified",
         "rounds", "draft s", "verify s", "wall s"],
        [
            [r["drafter"], r["dataset"], f"{r['temperature']:g}", _fmt(r["tokens_per_s"], 1),
             _fmt(r["target_tokens_per_s"], 1), _times(r["speedup"]), _fmt(r.get("verify_efficiency"), 3),
             str(r.get("verified_tokens", "–")), str(r.get("rounds", "–")), _fmt(r.get("draft_time_s")),
             _fmt(r.get("verify_time_s")), _fmt(r.get("wall_time_s"))]
            for r in rows
        ],
    )

    calibrated = [r for r in rows if r.get("calibration")]
    if calibrated:
        out += _calibration_markdown(calibrated)
    return "\n".join(out) + "\n"


def _calibration_markdown(rows: list[dict]) -> list[str]:
    out = [
        "",
        "## Confidence calibration",
        "",
        "Count-weighted means over slots. conditional: c_k against slot k accepted (given slots < k accepted); "
        "survival: prod_{i<=k} c_i against slots 1..k all accepted (what STS calibrates). held-out: STS fitted on "
        "half of the generate() calls, scored on the other half.",
        "",
    ]
    header = ["drafter", "dataset", "T", "rounds", "cond ECE", "cond AUROC", "cond Brier", "surv ECE raw",
              "surv ECE stored STS", "held-out surv ECE raw -> STS", "held-out fit-half ECE raw -> STS"]
    table = []
    for r in rows:
        cal = r["calibration"]
        held = cal.get("held_out")
        stored = cal.get("stored_sts")
        table.append([
            r["drafter"], r["dataset"], f"{r['temperature']:g}", str(cal["num_rounds"]),
            _fmt(mean_over_slots(cal["raw"]["conditional"], "ece"), 3),
            _fmt(mean_over_slots(cal["raw"]["conditional"], "auroc"), 3),
            _fmt(mean_over_slots(cal["raw"]["conditional"], "brier"), 3),
            _fmt(mean_over_slots(cal["raw"]["survival"], "ece"), 3),
            _fmt(mean_over_slots(stored["survival"], "ece"), 3) if stored else "–",
            (f"{_fmt(mean_over_slots(held['eval_half']['raw']['survival'], 'ece'), 3)} -> "
             f"{_fmt(mean_over_slots(held['eval_half']['sts']['survival'], 'ece'), 3)}") if held else "–",
            (f"{_fmt(mean_over_slots(held['fit_half']['raw']['survival'], 'ece'), 3)} -> "
             f"{_fmt(mean_over_slots(held['fit_half']['sts']['survival'], 'ece'), 3)}") if held else "–",
        ])
    out += _table(header, table)
    for r in rows:
        cal = r["calibration"]
        held = cal.get("held_out")
        stored = cal.get("stored_sts")
        out += ["", f"### {r['drafter']} / {r['dataset']} / T={r['temperature']:g}: per slot", ""]
        if cal.get("stored_temperatures"):
            out.append(f"stored STS temperatures: {', '.join(f'{t:.3g}' for t in cal['stored_temperatures'])}  ")
        if held:
            out.append(f"held-out STS temperatures: {', '.join(f'{t:.3g}' for t in held['temperatures'])}")
        out.append("")
        header = ["slot", "n cond", "cond ECE", "cond AUROC", "cond Brier", "n surv", "surv ECE", "surv AUROC",
                  "surv Brier", "surv ECE stored STS", "held-out surv ECE raw -> STS"]
        table = []
        for k in range(cal["num_slots"]):
            cond, surv = cal["raw"]["conditional"][k], cal["raw"]["survival"][k]
            table.append([
                str(k + 1), str(cond["count"]), _fmt(cond["ece"], 3), _fmt(cond["auroc"], 3), _fmt(cond["brier"], 3),
                str(surv["count"]), _fmt(surv["ece"], 3), _fmt(surv["auroc"], 3), _fmt(surv["brier"], 3),
                _fmt(stored["survival"][k]["ece"], 3) if stored else "–",
                (f"{_fmt(held['eval_half']['raw']['survival'][k]['ece'], 3)} -> "
                 f"{_fmt(held['eval_half']['sts']['survival'][k]['ece'], 3)}") if held else "–",
            ])
        out += _table(header, table)
    return out


def save_results(results, output_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write results.json, results.md, reliability.json and (plots=True) PNG plots; returns {name: path}."""
    from .plots import plot_acceptance_by_position, plot_reliability

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    written["results.json"] = output_dir / "results.json"
    written["results.json"].write_text(results_json(results) + "\n", encoding="utf-8")
    written["results.md"] = output_dir / "results.md"
    written["results.md"].write_text(results_markdown(results), encoding="utf-8")
    if results.reliability:
        curves = [
            {"drafter": d, "dataset": s, "temperature": t, "curves": c} for (d, s, t), c in results.reliability.items()
        ]
        written["reliability.json"] = output_dir / "reliability.json"
        written["reliability.json"].write_text(json.dumps(_strict(curves), indent=1) + "\n", encoding="utf-8")
    if plots:
        for temp in dict.fromkeys(r["temperature"] for r in results.rows):
            name = f"acceptance_by_position_{temperature_tag(temp)}.png"
            written[name] = plot_acceptance_by_position(
                [r for r in results.rows if r["temperature"] == temp], output_dir / name,
                title=f"{Path(results.target).name}: acceptance by position, temperature {temp:g}",
            )
        for (drafter, data, temp), curves in results.reliability.items():
            name = f"reliability_{drafter}_{data}_{temperature_tag(temp)}.png"
            written[name] = plot_reliability(curves, output_dir / name, title=f"{drafter} / {data} / T={temp:g}")
    return written


__all__ = ["ROW_KEYS", "per_prompt_counts", "results_json", "results_markdown", "save_results", "temperature_tag"]
