"""The four evaluation workloads, built from the shared prompt files (never copied into the repo).

| workload          | request                                                           | chat template |
| ----------------- | ----------------------------------------------------------------- | ------------- |
| `code_completion` | a HumanEval `prompt`, to be continued                             | no            |
| `code_edit`       | "rename function X to X_v2, return the whole code" over `prompt + canonical_solution` | yes |
| `summarization`   | "Summarize the following article" over an XSum article (<= 3000 chars) | yes      |
| `chat`            | a BIG-bench hhh request as a single user turn                     | yes           |

Code editing copies most of its input (n-gram drafting shines); chat overlaps little with its
input (the hardest case for it). The prompt files live in `shared/data/prompts/` next to the
repository; `$SPECDEC_DATA` points elsewhere. So that the demo runs on a machine without them,
one small code-edit request (`fallback_code_edit()`, our own snippet) ships in the package.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("code_completion", "code_edit", "summarization", "chat")
_FILES = {
    "code_completion": "humaneval_dev.jsonl",
    "code_edit": "humaneval_dev.jsonl",
    "summarization": "xsum_dev.jsonl",
    "chat": "chat_dev.jsonl",
}
ARTICLE_CHARS = 3000  # keeps summarisation prompts ~700 tokens: long enough to copy from, quick on CPU


@dataclass(frozen=True)
class Request:
    """One prompt of a workload.

    `text` is either the raw text to continue (`chat=False`) or the user turn of a chat
    request (`chat=True`, rendered with the tokenizer's chat template by `render`).
    """

    workload: str
    id: str
    text: str
    chat: bool

    def render(self, tokenizer) -> str:
        """The exact string the model sees (the chat template applied for chat requests)."""
        if not self.chat:
            return self.text
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"request {self.id} is a chat request but the tokenizer has no chat template")
        messages = [{"role": "user", "content": self.text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def input_ids(self, tokenizer):
        """int64 [1, L] token ids of the rendered prompt."""
        # The chat template already writes the special tokens; adding them again would
        # prepend a second BOS on tokenizers that add one.
        encoded = tokenizer(self.render(tokenizer), return_tensors="pt", add_special_tokens=not self.chat)
        return encoded["input_ids"]


def summarization_request(article: str, id: str = "summarization") -> Request:
    """The summarisation workload's chat request over `article` (cut to ARTICLE_CHARS)."""
    return Request("summarization", id, f"Summarize the following article.\n\n{article[:ARTICLE_CHARS]}", chat=True)


def code_edit_request(code: str, function_name: str, id: str = "code_edit") -> Request:
    """A chat request asking to rename `function_name` to `<name>_v2` in `code` and return all of it."""
    instruction = (
        f"Rename the function `{function_name}` to `{function_name}_v2` and return the whole code.\n\n"
        f"```python\n{code.rstrip()}\n```"
    )
    return Request("code_edit", id, instruction, chat=True)


# Our own snippet (not from any dataset): the demo's code-edit prompt when shared/ is absent.
_FALLBACK_CODE = '''\
def moving_average(values, window):
    """Return the averages of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages


def main():
    readings = [3.0, 4.5, 5.0, 4.0, 6.5, 7.0]
    print(moving_average(readings, 3))
'''


def fallback_code_edit() -> Request:
    """The code-edit request shipped with the package (used when the shared prompts are missing)."""
    return code_edit_request(_FALLBACK_CODE, "moving_average", id="builtin/moving_average")


def data_dir():
    """Folder holding the prompt files, or None if not found.

    Looked for in `$SPECDEC_DATA` (the `prompts/` folder itself or its parent), then in
    `shared/data/prompts` inside or beside each folder from this file (then from the working
    directory) up to the repository root.
    """
    candidates = []
    env = os.environ.get("SPECDEC_DATA")
    if env:
        candidates += [Path(env).expanduser(), Path(env).expanduser() / "prompts"]
    # From the package's own folder (a source checkout), then from the working directory
    # (an installed package run from a checkout, as in CI).
    for start in (Path(__file__).resolve().parent, Path.cwd().resolve()):
        for parent in [start, *start.parents]:
            candidates += [parent / "shared" / "data" / "prompts", parent.parent / "shared" / "data" / "prompts"]
            if (parent / ".git").exists():
                break  # the repository root: the shared folder sits beside it or inside it
    for folder in candidates:
        if (folder / _FILES["code_edit"]).is_file():
            return folder
    return None


def _read_jsonl(path: Path) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_workload(name: str, *, limit=None, data=None) -> list:
    """The requests of workload `name` (one of WORKLOADS), in file order, at most `limit`.

    data: the prompts folder (default: `data_dir()`). Raises FileNotFoundError, naming where
    it looked and `$SPECDEC_DATA`, when the prompt files are not found.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    folder = Path(data) if data is not None else data_dir()
    if folder is None or not (folder / _FILES[name]).is_file():
        raise FileNotFoundError(
            f"prompt file {_FILES[name]} not found ({folder or 'no shared/data/prompts beside the repository'}); "
            "set SPECDEC_DATA to the folder holding the prompt .jsonl files"
        )
    rows = _read_jsonl(folder / _FILES[name])
    requests = []
    seen = set()
    for row in rows:
        if name == "code_completion":
            req = Request(name, row["task_id"], row["prompt"], chat=False)
        elif name == "code_edit":
            req = code_edit_request(row["prompt"] + row["canonical_solution"], row["entry_point"], id=row["task_id"])
        elif name == "summarization":
            req = summarization_request(row["article"], id=row["id"])
        else:
            req = Request(name, row["id"], row["prompt"], chat=True)
        # The hhh file repeats a request once per candidate answer; a repeated prompt
        # would only weight that prompt more in averages.
        if req.text in seen:
            continue
        seen.add(req.text)
        requests.append(req)
        if limit is not None and len(requests) >= limit:
            break
    return requests


def build_workloads(names=WORKLOADS, *, limit=None, data=None) -> dict:
    """`{name: [Request, ...]}` for each workload in `names` (see `load_workload`)."""
    return {name: load_workload(name, limit=limit, data=data) for name in names}


def code_edit_prompts(limit=None) -> list:
    """Code-edit requests from the shared HumanEval file, or `[fallback_code_edit()]` without it."""
    try:
        return load_workload("code_edit", limit=limit)
    except FileNotFoundError:
        return [fallback_code_edit()]
