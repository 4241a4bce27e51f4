"""The e2e benchmark's output: the summary table (text and Markdown), the speedup and
acceptance plots, the JSON record."""

from pathlib import Path

from .. import common
from .peers import PEER_METHODS
from .runner import BATCH1_ONLY, split_method


def _greedy_cell(r):
    """The "greedy == HF" cell: yes / NO (rows) for ours; for a peer the identical share."""
    c, identical = r["config"], r.get("greedy_identical")
    if c["method"] == "hf":
        return "-" if c["temperature"] else "(baseline)"
    if c["temperature"]:
        return "-"
    if identical is None:
        return "not compared"
    if c["method"] in PEER_METHODS:
        same = r["greedy_compared_rows"] - len(r["mismatches"])
        return f"{same}/{r['greedy_compared_rows']} identical"
    return "yes" if identical else f"NO ({len(r['mismatches'])} of {r['greedy_compared_rows']} rows differ)"


def table_rows(rows):
    """(headers, cells) of the summary table: per row its weights' dtype, tokens/s, the ratio to
    HF generate, the share of the plain-decoding floor (`floor.decode_floor`; "-" without one)."""
    depth = max((len(r.get("acceptance_by_depth") or []) for r in rows), default=0)
    depth = min(depth, 5)
    headers = ["workload", "B", "temp", "method", "dtype", "tok/s", "speedup", "of floor", "tok/step", "nodes/row"]
    headers += [f"acc@{d + 1}" for d in range(depth)] + ["plan %", "kernels %", "greedy == HF"]
    cells = []
    for r in rows:
        c = r["config"]
        if "skipped" in r:
            cells.append([c["workload"], str(c["batch"]), f"{c['temperature']:g}", c["method"], c.get("dtype", "-"),
                          "-", "-", "-", "-", "-"]
                         + ["-"] * depth + ["-", "-", "skipped: batch 1 only" if c["method"] in BATCH1_ONLY
                                            else f"skipped: {r['skipped']}"])
            continue
        acc = list(r.get("acceptance_by_depth") or [])[:depth]
        check = _greedy_cell(r)
        share = r.get("kernel_share")
        cells.append([c["workload"], str(c["batch"]), f"{c['temperature']:g}", c["method"], c.get("dtype", "-"),
                      f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup_vs_hf']:.2f}x" if r.get("speedup_vs_hf") else "-",
                      f"{r['floor_share']:.2f}" if r.get("floor_share") else "-",
                      f"{r['tokens_per_step']:.2f}" if r.get("tokens_per_step") else "-",
                      f"{r['nodes_per_step']:.2f}" if r.get("nodes_per_step") is not None else "-"]
                     + [f"{a:.2f}" for a in acc] + ["-"] * (depth - len(acc))
                     + [f"{100 * r['plan_share']:.1f}%" if r.get("plan_share") is not None else "-",
                        f"{100 * share['total']:.0f}%" if share else "-", check])
    return headers, cells


def split_rows(rows, batch=1):
    """(headers, cells): our batch-`batch` rows' decoding time per step split into draft /
    verify / accept (from `generate(timing=True)`, which the benchmark turns on on a CPU), and
    the draft time as a share of the verify time (the target step: its forward and `verify`),
    the MTP issue's overhead measure. Rows without a split (GPU runs, skipped rows) are left out."""
    headers = ["workload", "temp", "method", "steps", "draft ms/step", "verify ms/step", "accept ms/step",
               "draft / verify"]
    cells = []
    for r in rows:
        c, t = r["config"], r.get("time_s") or {}
        if c["batch"] != batch or not r.get("steps") or not t.get("verify"):
            continue
        per = {k: 1e3 * t[k] / r["steps"] for k in ("draft", "verify", "accept")}
        cells.append([c["workload"], f"{c['temperature']:g}", c["method"], str(r["steps"]), f"{per['draft']:.1f}",
                      f"{per['verify']:.1f}", f"{per['accept']:.1f}", f"{100 * t['draft'] / t['verify']:.1f}%"])
    return headers, cells


def _md_table(headers, cells):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    return lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]


def floor_lines(floor):
    """The floor (`floor.measure_floor`) in a few lines of text, or [] without one."""
    if not floor:
        return []
    lines = [f"Floor of plain decoding ({floor['dtype']} weights, {floor['threads']} threads): "
             f"{floor['weight_bytes'] / 1e6:.0f} MB of weights and {floor['flops_per_token'] / 1e6:.0f} MFLOP per token; "
             f"measured read bandwidth {floor['bandwidth'] / 1e9:.1f} GB/s (the faster of {floor['bandwidth_weight_sized'] / 1e9:.1f} "
             f"on an array the weights' size and {floor['bandwidth_dram'] / 1e9:.1f} beyond the last-level cache), matmul peak "
             f"{floor['peak_flops'] / 1e9:.0f} GFLOP/s ({floor['dtype']}; fp32 {floor['peak_flops_fp32'] / 1e9:.0f})."]
    for batch, f in floor["by_batch"].items():
        lines.append(f"  B={batch}: step >= max({1e3 * f['memory_s']:.2f} ms memory, {1e3 * f['compute_s']:.2f} ms "
                     f"compute) = {1e3 * f['step_s']:.2f} ms ({f['bound']}-bound): {f['tokens_per_s']:.1f} tok/s; "
                     "\"of floor\" = tok/s over this")
    return lines


def markdown(rows, header, floor=None):
    """The summary table as Markdown (the README's e2e table), the floor (`floor_lines`) when
    measured, then the batch-1 draft / verify / accept split (`split_rows`) when the rows have one."""
    headers, cells = table_rows(rows)
    lines = [header, ""] + _md_table(headers, cells)
    if floor:
        lines += [""] + [line.strip() + "  " for line in floor_lines(floor)]
    split_headers, split_cells = split_rows(rows)
    if split_cells:
        lines += ["", "Decoding time per step at batch 1 (generate(timing=True)):", ""]
        lines += _md_table(split_headers, split_cells)
    return "\n".join(lines) + "\n"


def plot_speedup(rows, path, title):
    """Bars: speedup vs HF (same sampling) per workload and method, one panel per (batch, temperature)."""
    plt = common.pyplot()
    if plt is None:
        return None
    panels = sorted({(r["config"]["batch"], r["config"]["temperature"]) for r in rows})
    workloads = list(dict.fromkeys(r["config"]["workload"] for r in rows))
    methods = [m for m in dict.fromkeys(r["config"]["method"] for r in rows) if m != "hf"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, (batch, temperature) in zip(axes[0], panels):
        for i, method in enumerate(methods):
            values = []
            for w in workloads:
                match = [r for r in rows if r["config"]["workload"] == w and r["config"]["batch"] == batch
                         and r["config"]["temperature"] == temperature and r["config"]["method"] == method]
                values.append((match[0].get("speedup_vs_hf") or 0.0) if match else 0.0)
            ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(workloads))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=20, fontsize=8)
        ax.set_title(f"B={batch}, {'greedy' if temperature == 0 else f'temperature {temperature:g}'}", fontsize=9)
    axes[0][0].set_ylabel("speedup vs HF generate (same sampling)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return common.save_figure(plt, fig, path)


def plot_acceptance(rows, path, title):
    """Lines: acceptance by depth (fraction of steps accepting >= d drafts) per method, one panel
    per workload, batch 1 (or the smallest batch), greedy and sampled."""
    plt = common.pyplot()
    if plt is None:
        return None
    ours = [r for r in rows if r.get("acceptance_by_depth")]
    workloads = list(dict.fromkeys(r["config"]["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.4), squeeze=False)
    batch = min((r["config"]["batch"] for r in ours), default=1)
    for ax, w in zip(axes[0], workloads):
        for r in ours:
            c = r["config"]
            if c["workload"] != w or c["batch"] != batch:
                continue
            acc, temperature = r["acceptance_by_depth"], c["temperature"]
            sampling = "greedy" if temperature == 0 else f"t={temperature:g}"
            ax.plot(range(1, len(acc) + 1), acc, marker="o", linestyle="-" if temperature == 0 else "--",
                    label=f"{c['method']} {sampling}")
        ax.set_title(f"{w}, B={batch}", fontsize=9)
        ax.set_xlabel("depth d")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("steps accepting >= d drafts")
    if axes[0][-1].get_legend_handles_labels()[0]:  # (a run without any of our rows plots nothing)
        axes[0][-1].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    return common.save_figure(plt, fig, path)


def plot_planner(rows, path, title):
    """Scatter per workload: verified draft nodes per row (the planner's choice, rounded) against
    the mean drafts the rows then accepted, for our adaptive rows (marker size: how many steps
    chose that size); the diagonal is "every verified node accepted"."""
    plt = common.pyplot()
    ours = [r for r in rows if r.get("size_vs_acceptance") and not split_method(r["config"]["method"])[0].endswith("_fixed")]
    if plt is None or not ours:
        return None
    workloads = list(dict.fromkeys(r["config"]["workload"] for r in ours))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        top = 1
        for r in ours:
            c = r["config"]
            if c["workload"] != w:
                continue
            sizes = [int(k) for k in r["size_vs_acceptance"]]
            steps = [v[0] for v in r["size_vs_acceptance"].values()]
            accepted = [v[1] for v in r["size_vs_acceptance"].values()]
            total = sum(steps)
            sampling = "greedy" if c["temperature"] == 0 else f"t={c['temperature']:g}"
            ax.scatter(sizes, accepted, s=[8 + 200 * n / total for n in steps], alpha=0.6,
                       label=f"{c['method']} B={c['batch']} {sampling}")
            top = max(top, *sizes)
        ax.plot([0, top], [0, top], color="black", linewidth=0.6, linestyle=":")
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("verified draft nodes per row (planner)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("accepted drafts per row")
    axes[0][-1].legend(fontsize=5)
    fig.suptitle(title, fontsize=9)
    return common.save_figure(plt, fig, path)


def write_results(rows, out_dir, *, device, model_label, settings, name=None, planned=None, complete=True):
    """JSON, Markdown table and the plots under out_dir; returns {kind: path}.

    planned: rows of the whole plan (default len(rows)). complete=False: the partial results
    of a run still going (written after every finished run): the JSON alone, with "complete":
    false, quietly; the Markdown and the plots come with the final call."""
    slug = name or common.device_slug(device)
    out_dir = Path(out_dir)
    result = common.metadata("e2e", device, "default dispatch", model=model_label, **settings)
    result["stat"] = ("tokens_per_s = generated tokens (to eos inclusive) / wall time summed over the batches, one "
                      "timed call each after a warm-up call per method; speedup_vs_hf = tokens_per_s / the hf row with "
                      "the same workload, batch and temperature")
    json_path = common.write_rows(result, rows, out_dir / f"e2e_{slug}.json",
                                  planned=len(rows) if planned is None else planned, complete=complete)
    paths = {"json": json_path}
    if not complete:
        return paths
    title = f"{model_label} ({settings.get('dtype', '?').replace('torch.', '')} weights) on {result['device']}"
    header = (f"End-to-end, {model_label} on {result['device']} ({result['date']}, commit {result['commit']}, "
              f"torch {result['torch']}, transformers {result['transformers']}; max_new_tokens "
              f"{settings['max_new_tokens']}, {settings['prompts_per_workload']} prompt(s) per workload and batch size)")
    paths["md"] = out_dir / f"e2e_{slug}.md"
    paths["md"].write_text(markdown(rows, header, settings.get("floor")))
    print(f"wrote {paths['md']}", flush=True)
    paths["speedup_png"] = plot_speedup(rows, out_dir / f"e2e_speedup_{slug}.png", title)
    paths["acceptance_png"] = plot_acceptance(rows, out_dir / f"e2e_acceptance_{slug}.png", title)
    paths["planner_png"] = plot_planner(rows, out_dir / f"e2e_planner_{slug}.png", title)
    return paths
