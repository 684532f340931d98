"""Model-card templates (installed as the package `hf_dspark.model_cards`; see README.md)."""
