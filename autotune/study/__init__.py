"""Studies: the search over vLLM engine args (definition, space, measurement, Optuna wiring, outputs)."""
