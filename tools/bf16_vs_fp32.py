"""bf16 against fp32 end to end on the default model: tokens/s of plain decoding and
default_drafter at batch 1 and 8 (48 new tokens, 2 threads, best of 2 interleaved rounds;
greedy; bf16 output may differ from fp32 where logits tie within bf16 rounding)."""
import time, torch
from specdec_kernels import models, generate
from specdec_kernels.heads.default import default_drafter
torch.set_num_threads(2)
prompts = ["def quicksort(arr):\n    \"\"\"Sort a list.\"\"\"\n", "Write a short story about a robot learning to paint.", "The history of the Roman empire", "import numpy as np\n\ndef softmax(x):"] * 2
res = {}
loaded = {dt: models.load_model(dtype=dt, verbose=False) for dt in ("float32", "bfloat16")}
for rnd in range(2):
    for dt, (model, tok) in loaded.items():
        tok.padding_side = "left"
        for b in (1, 8):
            enc = tok(prompts[:b], return_tensors="pt", padding=True)
            for name, dr in (("plain", None), ("default", default_drafter(model))):
                generate(model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=4, drafter=dr)
                t = time.perf_counter()
                out = generate(model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=48, drafter=dr)
                el = time.perf_counter() - t
                key = (dt, b, name)
                res[key] = max(res.get(key, 0), sum(out.stats.new_tokens) / el)
for k, v in sorted(res.items()):
    print(k, round(v, 1), "tok/s")
