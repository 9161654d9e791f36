"""`pagellm plan`: memory and capacity from a model's config, with the engine's own arithmetic.

Modules: model_spec (config -> ModelSpec), weights (bytes per rank), devices (targets and
estimates), planner (RankPlan per rank), recommend (fixes, traffic advice), traffic (logs and
/metrics), report (tables), cli. Nothing is imported here: the CLI parser imports
``pagellm.planning.cli`` on every command, so this package stays cheap to import.
"""
