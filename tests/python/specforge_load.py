"""Loads a spool export with SpecForge's own data code and prints what it gives, as JSON.

    specforge_load.py ids PATH
        `specforge` export -> specforge.data.prompt_builder.prepare_prompt_tasks (its
        pre-tokenized path, as training loads `data.prompts_path`/`train_data_path`).
    specforge_load.py chat PATH TOKENIZER_DIR TEMPLATE TRAIN_ONLY_LAST_TURN [JINJA]
        `specforge-chat` export -> datasets.load_dataset("json") -> SpecForge's
        preprocess_conversations (what build_eagle3_dataset maps over the rows, without its
        shuffle, so rows stay in file order) with the registered chat template TEMPLATE.
        JINJA, when given, is the tokenizer's chat template instead of its own (what a model
        folder with that template would give).

stdout: {"rows": [{"id", "input_ids", "loss_mask"}, ...]} in file order.
"""

import json
import sys


def fail(msg):
    print(msg, file=sys.stderr)
    sys.exit(2)


def file_ids(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l)["id"] for l in f if l.strip()]


def load_ids(path):
    try:
        from specforge.data.prompt_builder import prepare_prompt_tasks
    except ImportError as e:
        fail(f"specforge is not installed (pip install specforge==0.2.0 --no-deps): {e}")
    tasks = prepare_prompt_tasks(
        path,
        None,
        chat_template=None,
        max_length=1 << 30,
        is_preformatted=False,
        train_only_last_turn=False,
        cache_dir=None,
        cache_key=None,
        num_proc=None,
        min_loss_tokens=0,
    )
    ids = file_ids(path)
    if len(ids) != len(tasks):
        fail(f"{len(ids)} lines but SpecForge loaded {len(tasks)}")
    return [
        {"id": i, "input_ids": t["payload"]["input_ids"], "loss_mask": t["payload"]["loss_mask"]}
        for i, t in zip(ids, tasks)
    ]


def load_chat(path, tokenizer_dir, template_name, last_turn, jinja=None):
    try:
        from datasets import load_dataset
        from transformers import AutoTokenizer
        from specforge.data.preprocessing import preprocess_conversations
        from specforge.data.template import TEMPLATE_REGISTRY
    except ImportError as e:
        fail(f"specforge, datasets or transformers is not installed: {e}")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if jinja:
        with open(jinja, encoding="utf-8") as f:
            tok.chat_template = f.read()
    template = TEMPLATE_REGISTRY.get(template_name)
    ds = load_dataset("json", data_files=path, split="train")
    rows = []
    for i in range(len(ds)):
        ex = ds[i]
        tools = ex.get("tools") or []
        if isinstance(tools, str):
            tools = json.loads(tools)
        out = preprocess_conversations(
            tok,
            [ex["conversations"]],
            template,
            max_length=1 << 30,
            is_preformatted=False,
            train_only_last_turn=last_turn,
            tools=[tools],
        )
        rows.append(
            {
                "id": ex["id"],
                "input_ids": out["input_ids"][0][0].tolist(),
                "loss_mask": out["loss_mask"][0][0].tolist(),
            }
        )
    return rows


def main():
    args = sys.argv[1:]
    if args[:1] == ["ids"] and len(args) == 2:
        rows = load_ids(args[1])
    elif args[:1] == ["chat"] and len(args) in (5, 6):
        rows = load_chat(args[1], args[2], args[3], args[4] == "1", *args[5:])
    else:
        fail(__doc__)
    json.dump({"rows": rows}, sys.stdout)


if __name__ == "__main__":
    main()
