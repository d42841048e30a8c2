"""`llmserve bench`: load generation against the public API, baselines, and a simulated worker.

- `workload`, `trace`, `prompts`: what to send (fixed shapes, Poisson, the Azure trace, scaled);
  `workload_args`: the workload the command's flags describe
- `loadgen`, `poller`, `served`: send it to a stack over gRPC and watch the scheduler's Status
- `hf_baseline`: the same prompts through transformers' `generate` / `generate_batch`
- `cost_model`, `calibrate`, `simulate`, `core_cost`: the real scheduler core on a virtual clock
- `records`, `stats`, `report`, `plots`, `sweep_plot`: one report format for every kind of run;
  `goodput`: the requests per second that meet a TTFT and a TPOT target (`--slo`)
- `budget_sweep`: token budgets against step-time budgets on the same arrivals, judged by goodput
- `cli` and `run_serve`, `run_sim`, `run_budget_sweep`, `run_core`: the `llmserve bench`
  subcommands (`cli` holds the parser; nothing below it imports it)
"""
