"""Run plans: what ``python -m mllm_rl.run --plan`` executes, phase by phase."""
