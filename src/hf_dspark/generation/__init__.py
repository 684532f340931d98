"""Speculative decoding with hf_dspark drafts through `target.generate(..., assistant_model=draft)`.

    import hf_dspark  # a draft, once built or loaded, routes generate(assistant_model=draft) (integration.py)
    out = target.generate(**inputs, assistant_model=draft, max_new_tokens=256, do_sample=True)
    draft.last_generation_stats  # tau, per-position acceptance, verified tokens, draft/verify time

Generation-config fields (generate() keywords or attributes of a GenerationConfig): `dspark_schedule`
("none" | "threshold" | "prefix"), `dspark_threshold` (0.5), `dspark_sps_table` (None: profile and cache),
`dspark_block_size` (or `num_assistant_tokens`), `dspark_candidates` (1: first-slot candidates a round, verified
as a tree); see `SpeculativeConfig`. Modules, in the order a round uses
them: sampling (processed distributions), speculative (the loop), scheduler (verified prefix lengths, SPS
tables), rejection (the one acceptance routine), stats; calibration fits STS temperatures; cli adds
`hf-dspark calibrate` and `hf-dspark profile-sps`.
"""

from .._lazy import lazy_attributes

# name -> defining module, imported on first use (keeps `import hf_dspark.<stage>.cli` light for --help).
_EXPORTS = {
    **dict.fromkeys(["CalibrationReport", "calibrate_confidence"], ".calibration"),
    **dict.fromkeys(["install", "is_installed", "uninstall"], ".integration"),
    **dict.fromkeys(["CandidatesResult", "VerifyResult", "verify_block", "verify_candidates"], ".rejection"),
    **dict.fromkeys(["TokenSampler", "sample_from"], "..sampling"),
    **dict.fromkeys(["SPSTable", "load_or_profile_sps", "prefix_schedule", "profile_sps", "threshold_schedule"], ".scheduler"),
    **dict.fromkeys(["SpeculativeConfig", "check_draft_for_target", "speculative_generate"], ".speculative"),
    **dict.fromkeys(["SpeculativeStats"], ".stats"),
}  # fmt: skip
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())

__all__ = [
    "TokenSampler",
    "sample_from",
    "verify_block",
    "VerifyResult",
    "verify_candidates",
    "CandidatesResult",
    "SpeculativeConfig",
    "SpeculativeStats",
    "speculative_generate",
    "check_draft_for_target",
    "SPSTable",
    "profile_sps",
    "load_or_profile_sps",
    "prefix_schedule",
    "threshold_schedule",
    "calibrate_confidence",
    "CalibrationReport",
    "install",
    "uninstall",
    "is_installed",
]
