"""The `spool.toml` the enqueue benchmarks run: one dataset, a server that is never asked
(or `url`), no metrics endpoint, no self-check."""
import os


def write_config(d, name, prompts, *, url="http://127.0.0.1:9", budget_zero=True, run="",
                 tail=""):
    """Writes `d/spool.toml` for dataset `name` read from `prompts`; `run` adds lines to
    `[run]`, `tail` whole sections (e.g. `[sampling]`, `[tokenizer]`). Returns its path."""
    cfg = os.path.join(d, "spool.toml")
    with open(cfg, "w") as f:
        f.write(f'''data_dir = "data"
output_dir = "out"
[server]
api = "sglang"
urls = ["{url}"]
self_check = false
[run]
metrics_addr = ""
{run}
{tail}
[[dataset]]
name = "{name}"
path = "{prompts}"
{"token_budget = 0" if budget_zero else ""}
''')
    return cfg
